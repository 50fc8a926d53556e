"""Pipeline: run any schedule (offload included) on real stage modules, under torch.distributed
or in one process (local mode)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from pipeoffload.checks import check_instance
from pipeoffload.core.actions import MARKER_KINDS, Action, Kind
from pipeoffload.core.schedule import Schedule
from pipeoffload.core.validate import validate
from pipeoffload.errors import ConfigError
from pipeoffload.runtime.config import RuntimeConfig
from pipeoffload.runtime.executor import RankExecutor, StepData
from pipeoffload.runtime.groups import (
    backend_for,
    check_nccl_layout,
    require_bound_device,
    uses_nccl,
)
from pipeoffload.runtime.inputs import StageCall, check_form, positional, wrap_stages
from pipeoffload.runtime.lowering import (
    Channel,
    forward_only,
    interleave,
    peer_connections,
    with_comms,
)
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.microbatch import as_tuple, check_same, signature, split
from pipeoffload.runtime.offloader import ActivationOffloader
from pipeoffload.runtime.p2p import DistTransport, LocalTransport
from pipeoffload.runtime.pool import HostBufferPool, plan_need
from pipeoffload.runtime.sequence import SequenceSplit
from pipeoffload.runtime.sharding import ShardedStage
from pipeoffload.runtime.shards import is_dtensor
from pipeoffload.runtime.stage import StageRunner
from pipeoffload.runtime.tied import TiedGradients, TiedSpec, merge_ties

Tensors = torch.Tensor | Sequence[torch.Tensor]


@dataclass(frozen=True)
class PipelineStats:
    """What the last steps held and moved (``Pipeline.stats()``).

    - ``peak_bytes``: per rank of this process, the peak resident activation bytes the meter saw
      since its last reset (empty without a meter).
    - ``stage_bytes``: per stage of this process, the largest activation one microbatch saved
      in its last forward (from the meter, since its last reset; empty without one).
    - ``host_pool_bytes``: host memory the offloader's pool holds now (pinned bytes on CUDA),
      reused across steps and kept near what a step needs (runtime/pool.py Note: [host pool]).
    - ``host_pool_need_bytes``: the most of it the last step had in use at once.
    - ``fetched_bytes``: bytes FETCH read back to the device so far.
    - ``tied``: ties whose gradients are summed across stages (Note: [tied parameters]).
    - ``kept_bytes``: saved bytes the offloader left on the device in the last step, by reason
      (parameter, small, ...; ``ActivationOffloader.kept_bytes``); empty without offload.
    """

    peak_bytes: dict[int, int]
    stage_bytes: dict[int, int]
    host_pool_bytes: int
    fetched_bytes: int
    tied: tuple[str, ...]
    kept_bytes: dict[str, int]
    host_pool_need_bytes: int = 0


class Pipeline:
    """Executes ``schedule`` with the stage modules held by this process.

    - Under torch.distributed (initialised, e.g. by torchrun), this process is rank
      ``dist.get_rank(group)`` of the pipeline and ``stages`` must be exactly the stages the
      schedule places on that rank. Otherwise (local mode) ``stages`` must hold every stage and
      the whole schedule runs here, the ranks' lists interleaved in an order that respects
      core.deps.Dependencies.
    - ``step(inputs, target=...)`` splits the batch along dim 0 into the schedule's
      microbatches, runs the actions, accumulates gradients into ``.grad`` as the mean over
      microbatches, and returns the mean loss where the last stage lives (None elsewhere).
      With several routes (DualPipe, Note: [routes] in core/schedule.py) a process holding
      the last stage of only some routes returns its share, sum(its losses) / microbatches:
      the shares of all ranks add up to the mean loss.
      The last stage computes ``loss_fn(output, *target_microbatch)`` (``loss_fn(output)``
      without target); every rank may pass inputs and target, each uses what it needs.
    - ``meter``: an ActivationMeter to measure resident activation bytes per rank (optional).
    - ``example_inputs``: one microbatch's inputs, to check the first step's shapes too; without
      it shapes are learnt on the first step and later steps must repeat them.
    - ``backward_group``: a second communicator over the same ranks for gradient messages, so
      that backends matching messages by order (NCCL) see each direction in a consistent order
      (V-shaped schedules interleave the two directions between a pair of ranks differently on
      the two sides). Gloo matches by tag and needs none.
    - ``channel_groups``: one process group over the same ranks per ``lowering.Channel``
      (forward / backward x towards a higher / lower rank; ``groups.new_channel_groups`` makes
      them). NCCL needs them: with one F and one B communicator some schedules deadlock (Note:
      [NCCL channels]); on NCCL the constructor runs runtime/rendezvous.py's model over this
      rank's view of the schedule and refuses a layout that would deadlock or pair the wrong
      messages. On gloo they are optional and make sends faster (separate sockets per
      direction); ``launch.connect`` makes them for both.
    - ``stage_kwargs``: ``{stage: {name: value}}`` constants passed as keyword arguments to that
      stage on every microbatch (Note: [stage contract], runtime/inputs.py).
    - ``tied``: ``{tie: {stage: parameter name}}`` over all stages, one parameter used by several
      stages, whose gradients are summed (Note: [tied parameters], runtime/tied.py); a stage
      module's ``tied_parameters`` attribute in the same form counts too.
    - ``context``: this process's share of every sequence under context parallelism
      (runtime/sequence.py Note: [causal split]): ``step`` takes whole sequences and keeps
      this rank's tokens of every input and target with a sequence dimension (dim 1), and
      returns the mean loss over the context-parallel ranks (the whole sequence's). The stages
      must attend over the group (parallel/context.py), and gradients be averaged over it.
    - torch's UNSHARD / RESHARD / REDUCE_GRAD markers in the schedule are skipped. A stage
      module wrapped with FSDP2's ``fully_shard`` (an ``FSDPModule``, ``reshard_after_forward=
      False``) is unsharded before its first F of a step and resharded after its last B (or,
      where the schedule splits the backward into I and W, its last W), its gradients
      reduce-scattered once, after that action (runtime/sharding.py Note: [sharded stages]).
    - Before the first step: ``connect_peers()`` sets up every P2P connection (the first
      ``step`` calls it), and ``reserve_host_memory(stage_bytes)`` allocates the offloader's
      host buffers from the plan (docs/runtime.md, "GPU rules": on NCCL neither may happen
      inside a step).
    """

    def __init__(
        self,
        stages: Mapping[int, nn.Module],
        schedule: Schedule,
        loss_fn: Callable[..., torch.Tensor],
        group: dist.ProcessGroup | None = None,
        config: RuntimeConfig | None = None,
        device: torch.device | str | None = None,
        meter: ActivationMeter | None = None,
        example_inputs: Tensors | None = None,
        backward_group: dist.ProcessGroup | None = None,
        channel_groups: Mapping[Channel, dist.ProcessGroup] | None = None,
        stage_kwargs: Mapping[int, Mapping[str, Any]] | None = None,
        tied: TiedSpec | None = None,
        context: SequenceSplit | None = None,
    ) -> None:
        check_instance("Pipeline: schedule", schedule, Schedule, "a Schedule")
        if not callable(loss_fn):
            raise TypeError(f"Pipeline: loss_fn must be callable (loss_fn(output, *target)), "
                            f"got {type(loss_fn).__name__} {loss_fn!r:.60}")
        check_instance("Pipeline: config", config, RuntimeConfig, "a RuntimeConfig",
                       optional=True)
        self.config = config or RuntimeConfig()
        self.context = context
        self.schedule = validate(schedule)
        schedule = schedule.without(*MARKER_KINDS)  # itself when it has none
        self.meter = meter
        self.distributed = dist.is_available() and dist.is_initialized()
        self.ranks = self._ranks_here(schedule, group)
        self._check_stages(stages)
        self._stages = dict(stages)
        self.device = (torch.device(device) if device is not None else _device_of(
            stages, self.distributed and backend_for(group, "cuda") == "nccl"))
        nccl = self.distributed and uses_nccl(group, self.device)
        if nccl:
            require_bound_device()
        modules = wrap_stages(stages, stage_kwargs or {}, schedule.num_stages,
                              schedule.is_first_stage)
        self._runners = {
            s: StageRunner(s, module, schedule.is_first_stage(s), schedule.is_last_stage(s),
                           loss_fn, schedule.microbatches)
            for s, module in modules.items()
        }
        params = [p for m in modules.values() for p in (*m.parameters(), *m.buffers())]
        if meter is not None:
            meter.exclude(params)
        self._offloader = self._new_offloader(schedule, params, nccl)
        self._lowered = with_comms(schedule)
        self._connected = not self.distributed
        self._nccl_groups = (group, backward_group, channel_groups) if nccl else None
        self._transport = self._new_transport(group, backward_group, channel_groups, nccl)
        # Gloo posts receives ahead; NCCL posts each in place (p2p.py Note: [NCCL posting]).
        self._lookahead = self.config.recv_lookahead if self.distributed and not nccl else 0
        self._executors = self._new_executors(self._lowered)
        self._order = interleave(self._lowered, self.ranks)
        self._forward_only: tuple[list[tuple[int, Action]], dict[int, RankExecutor]] | None = None
        ties = merge_ties([tied or {}, *(getattr(m, "tied_parameters", {})
                                         for m in stages.values())], schedule.num_stages)
        self._tied = TiedGradients(ties, stages, schedule, group, self.device, self.distributed,
                                   self.config.p2p_timeout_s)
        self._input_sig = None
        self._input_names: tuple[str, ...] | None = None
        if example_inputs is not None:
            self._input_names, example = positional(example_inputs)
            self._input_sig = signature(as_tuple(example, "example_inputs"))

    def _ranks_here(self, schedule: Schedule, group: dist.ProcessGroup | None
                    ) -> tuple[int, ...]:
        """The pipeline ranks this process runs: its own under torch.distributed (checked
        against the group), every rank in local mode."""
        if not self.distributed:
            return tuple(range(schedule.num_ranks))
        world = dist.get_world_size(group)
        if world != schedule.num_ranks:
            raise ConfigError(
                f"the process group has {world} ranks but schedule {schedule.name!r} has "
                f"{schedule.num_ranks}; build the schedule with pp={world} or pass a group "
                f"of {schedule.num_ranks} ranks")
        rank = dist.get_rank(group)
        if rank < 0:
            raise ConfigError("this process is not a member of the given process group; "
                              "create the Pipeline only on the group's ranks")
        return (rank,)

    def _new_offloader(self, schedule: Schedule, params: list[torch.Tensor], nccl: bool
                       ) -> ActivationOffloader | None:
        """The activation offloader, where the schedule offloads."""
        recomputed = [item for item, choice in schedule.classes if choice.recomputed]
        if not schedule.has_kind(Kind.OFFLOAD) and not recomputed:
            return None
        # On NCCL the pool warns when it must allocate inside a step (Note: [host pool]).
        pool = HostBufferPool(self.device.type == "cuda" and self.config.offload.pin_memory,
                              strict=nccl)
        offloader = ActivationOffloader(self.device, self.config.offload, params, self.meter,
                                        pool=pool)
        whole = {(a.stage, a.microbatch) for actions in schedule.ranks for a in actions
                 if a.kind is Kind.RECOMPUTE}
        both = [item for item in recomputed if item in whole]
        if both:
            raise ConfigError(
                f"(stage, microbatch) {both[0]} has a RECOMPUTE of its whole chunk and a class "
                "choice that recomputes classes; recompute one way or the other")
        if recomputed and (any(is_dtensor(p) for p in params)
                           or self.context is not None and self.context.cp > 1):
            raise ConfigError(
                f"(stage, microbatch) {recomputed[0]} recomputes tensor classes, which the "
                "runtime does without tensor or context parallelism and --zero 3 only (their "
                "forwards communicate, which a recompute on one rank cannot repeat); keep or "
                "offload those classes (Note: [class recompute])")
        if schedule.classes or self.config.offload.measure_classes:  # Note: [class offload]
            offloader.tagger.attach(runner.module for runner in self._runners.values())
        return offloader

    def _new_transport(self, group: dist.ProcessGroup | None,
                       backward_group: dist.ProcessGroup | None,
                       channel_groups: Mapping[Channel, dist.ProcessGroup] | None,
                       nccl: bool) -> LocalTransport | DistTransport:
        """How messages travel: a mailbox in local mode, else torch.distributed (on NCCL after
        checking the lowered schedule's layout of communicators)."""
        if not self.distributed:
            return LocalTransport()
        if nccl:
            check_nccl_layout(self._lowered, group, backward_group, channel_groups)
        schedule = self._lowered
        return DistTransport(group, self.device, self.config.p2p_timeout_s, schedule.num_stages,
                             schedule.microbatches, backward_group, channel_groups, nccl)

    def _new_executors(self, lowered: Schedule) -> dict[int, RankExecutor]:
        """One executor of ``lowered`` per rank this process runs."""
        return {
            rank: RankExecutor(rank, lowered, self._runners_of(rank), self._transport,
                               self._offloader, self.meter, self.config.clone_hand_off,
                               self.config.offload.stream, device=self.device,
                               recv_lookahead=self._lookahead, sharded=self._sharded_of(rank))
            for rank in self.ranks
        }

    def _sharded_of(self, rank: int) -> dict[int, ShardedStage]:
        """The FSDP2 stages of ``rank`` (Note: [sharded stages])."""
        from torch.distributed.fsdp import FSDPModule

        return {s: cast(ShardedStage, self._stages[s]) for s in self._runners_of(rank)
                if isinstance(self._stages[s], FSDPModule)}

    @property
    def offloader(self) -> ActivationOffloader | None:
        """The activation offloader, when the schedule has OFFLOAD actions."""
        return self._offloader

    def connect_peers(self) -> None:
        """Set up every P2P connection of this rank before the first step, in one order on
        every rank (p2p.py Note: [NCCL posting]); ``step`` calls it on its first run. Under
        torch.distributed every rank of the pipeline must call it (or step) together."""
        if self._connected:
            return
        assert isinstance(self._transport, DistTransport)
        metadata = sum(1 for rank in self.ranks for a in self._lowered.ranks[rank]
                       if a.kind is Kind.SEND_F)
        self._transport.connect_peers(peer_connections(self._lowered), metadata)
        self._connected = True

    def reserve_host_memory(self, stage_bytes: Mapping[int, int]) -> int:
        """Allocate the offloader's host buffers before the first step (pinned on CUDA), sized
        by this plan: the most bytes its offloaded activations hold at once on this process's
        ranks, given each stage's activation bytes of one microbatch (e.g. measured, or
        ``ActivationMeter.stage_activation_bytes``). Returns that need in bytes (0 without
        offload). On NCCL, pinned memory allocated inside a step can deadlock (docs/runtime.md,
        GPU rules), so reserve before the first step there."""
        if self._offloader is None:
            return 0
        missing = sorted({a.stage for _, a in self._order if a.kind is Kind.OFFLOAD}
                         - set(stage_bytes))
        if missing:
            raise ConfigError(f"reserve_host_memory: no activation bytes for offloaded stages "
                              f"{missing}; pass {{stage: bytes of one microbatch}} for each")
        need = plan_need(self._order, stage_bytes)
        self._offloader.reserve_host(need)
        return need

    def _abandon_step(self) -> None:
        """Drop what a failed step left behind, so that a later step starts clean (in local mode;
        under torch.distributed the peers of a failed step are in an unknown state)."""
        self._transport.abandon()
        for executor in self._executors.values():
            executor.abandon()
        for executor in (self._forward_only[1] if self._forward_only else {}).values():
            executor.abandon()
        for runner in self._runners.values():
            runner.abandon()
        if self._offloader is not None:
            self._offloader.abandon()
        self._tied.abandon()

    def _check_stages(self, stages: Mapping[int, nn.Module]) -> None:
        expected = sorted(s for r in self.ranks for s in self.schedule.stages_on_rank(r))
        given = sorted(stages)
        if given == expected:
            for s, module in stages.items():
                if not isinstance(module, nn.Module):
                    raise ConfigError(f"stages[{s}] is a {type(module).__name__}, not an nn.Module")
            return
        where = (f"rank {self.ranks[0]} of a {self.schedule.num_ranks}-rank pipeline"
                 if self.distributed else "local mode (torch.distributed is not initialised), "
                 "which runs every rank in this process")
        raise ConfigError(
            f"stages {given} were given, but in {where} schedule {self.schedule.name!r} "
            f"(placement {self.schedule.placement.value}, stage_to_rank "
            f"{list(self.schedule.stage_to_rank)}) needs exactly stages {expected}; pass "
            f"stages={{i: module_i for i in {expected}}}")

    def stats(self) -> PipelineStats:
        """Peaks, bytes per stage, host pool and fetched bytes so far (see PipelineStats)."""
        stage_bytes: dict[int, int] = {}
        peaks: dict[int, int] = {}
        if self.meter is not None:
            for (stage, _), nbytes in self.meter.stage_scope_bytes.items():
                if stage in self._runners:
                    stage_bytes[stage] = max(stage_bytes.get(stage, 0), nbytes)
            peaks = {rank: self.meter.peak_bytes(rank) for rank in self.ranks}
        offloader = self._offloader
        return PipelineStats(peaks, dict(sorted(stage_bytes.items())),
                             offloader.host_pool_bytes if offloader is not None else 0,
                             offloader.fetched_bytes if offloader is not None else 0,
                             tuple(self._tied.names),
                             offloader.kept_bytes if offloader is not None else {},
                             offloader.host_pool_need_bytes if offloader is not None else 0)

    def _prepare(self, inputs: Tensors | Mapping[str, torch.Tensor] | None,
                 target: Tensors | None) -> StepData:
        """Split a step's batch into the microbatches this process's stages use."""
        has_first = any(runner.is_first for runner in self._runners.values())
        has_last = any(runner.is_last for runner in self._runners.values())
        m = self.schedule.microbatches
        names, inputs = positional(inputs)
        check_form(target, "target")
        batch = self._local_tokens(as_tuple(inputs, "inputs"))
        targets = self._local_tokens(as_tuple(target, "target"))
        if has_first and not batch:
            raise ConfigError("this process holds a first stage, so step() needs inputs")
        if batch and targets and batch[0].dim() and targets[0].dim() and \
                batch[0].shape[0] != targets[0].shape[0]:  # 0-d: split() says which
            raise ConfigError(f"inputs have batch size {batch[0].shape[0]} but target has "
                              f"{targets[0].shape[0]} (dim 0); they must match")
        micro_inputs = (split(batch, m, "inputs", self.device) if has_first
                        else [() for _ in range(m)])
        micro_targets = (split(targets, m, "target", self.device) if has_last
                         else [() for _ in range(m)])
        if has_first:
            if self._input_sig is None:
                self._input_sig, self._input_names = signature(micro_inputs[0]), names
            if names != self._input_names:
                raise ConfigError(
                    f"inputs are {_describe(names)}, but this Pipeline was set up for "
                    f"{_describe(self._input_names)}; pass the same form every step")
            check_same(self._input_sig, micro_inputs[0], "one microbatch of inputs")
            for runner in self._runners.values():
                if runner.is_first:
                    assert isinstance(runner.module, StageCall)
                    runner.module.names = names
        return StepData(list(micro_inputs), list(micro_targets))

    def _local_tokens(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Under context parallelism this rank's tokens of each [batch, seq, ...] tensor."""
        if self.context is None or self.context.cp == 1:
            return tensors
        return tuple(self.context.shard(t) if t.dim() >= 2 else t for t in tensors)

    def _mean_loss(self, data: StepData) -> torch.Tensor | None:
        if not any(runner.is_last for runner in self._runners.values()):
            return None
        m = self.schedule.microbatches
        if len(data.losses) < m:  # the last stage of some routes only: this rank's share
            loss = torch.stack([data.losses[i] for i in sorted(data.losses)]).sum() / m
        else:
            loss = torch.stack([data.losses[i] for i in range(m)]).mean()
        return loss if self.context is None else self.context.mean_over_ranks(loss)

    def step(self, inputs: Tensors | Mapping[str, torch.Tensor] | None = None,
             target: Tensors | None = None) -> torch.Tensor | None:
        """Run one training step's forward and backward; see the class docstring. A dict of
        ``inputs`` goes to the first stage(s) as keyword arguments (Note: [stage contract])."""
        return self._run(self._order, self._executors, inputs, target, training=True)

    def evaluate(self, inputs: Tensors | Mapping[str, torch.Tensor] | None = None,
                 target: Tensors | None = None) -> torch.Tensor | None:
        """Forward only, for validation: the mean loss over the schedule's microbatches where
        the last stage lives (None elsewhere), as ``step`` returns it, but with no autograd
        graph, nothing saved, offloaded or sent back, and ``.grad`` untouched. The F actions run
        in the schedule's order, so every rank of the pipeline calls it together. Modules keep
        their mode: call ``.eval()`` on them first to switch dropout off."""
        order, executors = self._forward_only_program()
        return self._run(order, executors, inputs, target, training=False)

    def _run(self, order: list[tuple[int, Action]], executors: Mapping[int, RankExecutor],
             inputs: Tensors | Mapping[str, torch.Tensor] | None, target: Tensors | None, *,
             training: bool) -> torch.Tensor | None:
        """One pass of ``order``: a training step, or (not ``training``) forward only with no
        autograd graph, offload or tied-gradient exchange."""
        learnt = self._input_sig is None  # shapes learnt by a step are forgotten if it fails
        data = self._prepare(inputs, target)
        self.connect_peers()  # for evaluate: the step's connections, a superset of its own
        self._transport.begin_step()
        if training:
            self._tied.begin_step()
        try:
            with contextlib.nullcontext() if training else torch.no_grad():
                for rank, action in order:
                    executors[rank].run(action, data)
            self._transport.finish()
            for executor in executors.values():
                executor.finish()
            if training:
                if self._offloader is not None:
                    self._offloader.finish()
                self._tied.finish_step()
        except BaseException:
            self._abandon_step()
            if learnt:
                self._input_sig = self._input_names = None
            raise
        return self._mean_loss(data)

    def _runners_of(self, rank: int) -> dict[int, StageRunner]:
        return {s: r for s, r in self._runners.items() if self.schedule.rank_of(s) == rank}

    def _forward_only_program(self) -> tuple[list[tuple[int, Action]], dict[int, RankExecutor]]:
        """The step's schedule without backward, transfers and recomputation: its F actions and
        their SEND_F / RECV_F, in the same order (made once)."""
        if self._forward_only is None:
            lowered = forward_only(self._lowered)
            if self._nccl_groups is not None:
                check_nccl_layout(lowered, *self._nccl_groups)
            executors = {
                rank: RankExecutor(rank, lowered, self._runners_of(rank),
                                   self._transport, None, None, self.config.clone_hand_off,
                                   device=self.device, recv_lookahead=self._lookahead,
                                   forward_only=True, sharded=self._sharded_of(rank))
                for rank in self.ranks
            }
            self._forward_only = (interleave(lowered, self.ranks), executors)
        return self._forward_only


def _describe(names: tuple[str, ...] | None) -> str:
    return "positional tensors" if names is None else f"a dict with keys {list(names)}"


def _device_of(modules: Mapping[int, nn.Module], nccl: bool) -> torch.device:
    """The device of the stages' parameters; for parameter-free stages the current CUDA device
    on NCCL (its tensors must live there), else the CPU."""
    for module in modules.values():
        for tensor in module.parameters():
            return tensor.device
    if nccl:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
