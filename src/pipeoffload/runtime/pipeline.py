"""Pipeline: run any schedule (offload included) on real stage modules, under torch.distributed
or in one process (local mode)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.deps import Dependencies
from pipeoffload.core.schedule import Schedule
from pipeoffload.core.validate import validate
from pipeoffload.errors import ConfigError
from pipeoffload.runtime.config import RuntimeConfig
from pipeoffload.runtime.executor import RankExecutor, StepData
from pipeoffload.runtime.lowering import order_conflicts, with_comms
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.microbatch import as_tuple, check_same, signature, split
from pipeoffload.runtime.offloader import ActivationOffloader
from pipeoffload.runtime.p2p import DistTransport, LocalTransport
from pipeoffload.runtime.stage import StageRunner

Tensors = torch.Tensor | Sequence[torch.Tensor]


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
    ) -> None:
        self.config = config or RuntimeConfig()
        self.schedule = validate(schedule)
        self.meter = meter
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed:
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
            self.ranks: tuple[int, ...] = (rank,)
        else:
            self.ranks = tuple(range(schedule.num_ranks))
        self._check_stages(stages)
        modules = dict(stages)
        self.device = torch.device(device) if device is not None else _device_of(modules)
        self._runners = {
            s: StageRunner(s, module, schedule.is_first_stage(s), schedule.is_last_stage(s),
                           loss_fn, schedule.microbatches)
            for s, module in modules.items()
        }
        params = [p for m in modules.values() for p in (*m.parameters(), *m.buffers())]
        if meter is not None:
            meter.exclude(params)
        self._offloader = None
        if schedule.has_kind(Kind.OFFLOAD):
            self._offloader = ActivationOffloader(self.device, self.config.offload, params, meter)
        self._lowered = with_comms(schedule)
        if self.distributed:
            if dist.get_backend(group) == "nccl":
                self._check_nccl_order(backward_group)
            self._transport: LocalTransport | DistTransport = DistTransport(
                group, self.device, self.config.p2p_timeout_s, schedule.num_stages,
                schedule.microbatches, backward_group)
        else:
            self._transport = LocalTransport()
        self._executors = {
            rank: RankExecutor(rank, self._lowered,
                               {s: r for s, r in self._runners.items()
                                if schedule.rank_of(s) == rank},
                               self._transport, self._offloader, meter,
                               self.config.clone_hand_off, self.config.offload.stream)
            for rank in self.ranks
        }
        self._order = _interleave(self._lowered, self.ranks)
        self._input_sig = None
        if example_inputs is not None:
            self._input_sig = signature(as_tuple(example_inputs, "example_inputs"))

    @property
    def offloader(self) -> ActivationOffloader | None:
        """The activation offloader, when the schedule has OFFLOAD actions."""
        return self._offloader

    def _abandon_step(self) -> None:
        """Drop what a failed step left behind, so that a later step starts clean (in local mode;
        under torch.distributed the peers of a failed step are in an unknown state)."""
        self._transport.abandon()
        for executor in self._executors.values():
            executor.abandon()
        for runner in self._runners.values():
            runner.abandon()
        if self._offloader is not None:
            self._offloader.abandon()

    def _check_nccl_order(self, backward_group: dist.ProcessGroup | None) -> None:
        problems = order_conflicts(self._lowered, per_direction=backward_group is not None)
        if not problems:
            return
        fix = "use gloo, or reorder the SEND/RECV actions"
        if backward_group is None and not order_conflicts(self._lowered, per_direction=True):
            fix = ("pass backward_group=dist.new_group(<the same ranks>) so each direction has "
                   "its own communicator")
        raise ConfigError(
            "NCCL matches messages between two ranks in the order they are posted, and this "
            "schedule receives some in another order than it sends them: "
            + "; ".join(problems[:3]) + f"; {fix}")

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

    def step(self, inputs: Tensors | None = None,
             target: Tensors | None = None) -> torch.Tensor | None:
        """Run one training step's forward and backward; see the class docstring."""
        has_first = any(runner.is_first for runner in self._runners.values())
        has_last = any(runner.is_last for runner in self._runners.values())
        m = self.schedule.microbatches
        batch = as_tuple(inputs, "inputs")
        targets = as_tuple(target, "target")
        if has_first and not batch:
            raise ConfigError("this process holds a first stage, so step() needs inputs")
        if batch and targets and batch[0].shape[0] != targets[0].shape[0]:
            raise ConfigError(f"inputs have batch size {batch[0].shape[0]} but target has "
                              f"{targets[0].shape[0]} (dim 0); they must match")
        micro_inputs = (split(batch, m, "inputs", self.device) if has_first
                        else [() for _ in range(m)])
        micro_targets = (split(targets, m, "target", self.device) if has_last
                         else [() for _ in range(m)])
        if has_first:
            if self._input_sig is None:
                self._input_sig = signature(micro_inputs[0])
            check_same(self._input_sig, micro_inputs[0], "one microbatch of inputs")
        data = StepData(list(micro_inputs), list(micro_targets))
        del micro_inputs, micro_targets, batch, targets
        self._transport.begin_step()
        try:
            for rank, action in self._order:
                self._executors[rank].run(action, data)
            self._transport.finish()
            for executor in self._executors.values():
                executor.finish()
            if self._offloader is not None:
                self._offloader.finish()
        except BaseException:
            self._abandon_step()
            raise
        if not has_last:
            return None
        if len(data.losses) < m:  # the last stage of some routes only: this rank's share
            return torch.stack([data.losses[i] for i in sorted(data.losses)]).sum() / m
        losses = [data.losses[i] for i in range(m)]
        return torch.stack(losses).mean()


def _device_of(modules: Mapping[int, nn.Module]) -> torch.device:
    for module in modules.values():
        for tensor in module.parameters():
            return tensor.device
    return torch.device("cpu")


def _interleave(schedule: Schedule, ranks: tuple[int, ...]) -> list[tuple[int, Action]]:
    """One execution order of ``ranks``' lists that respects every dependency among them.

    For one rank it is that rank's list. For several (local mode) each rank runs as far as it
    can, round robin, like the validator's clockless run; dependencies on ranks outside
    ``ranks`` do not exist here (local mode holds them all).
    """
    if len(ranks) == 1:
        return [(ranks[0], a) for a in schedule.ranks[ranks[0]]]
    deps = Dependencies(schedule)
    done: set[Action] = set()
    pointer = {r: 0 for r in ranks}
    order: list[tuple[int, Action]] = []
    progress = True
    while progress:
        progress = False
        for rank in ranks:
            actions = schedule.ranks[rank]
            while pointer[rank] < len(actions):
                action = actions[pointer[rank]]
                if any(d not in done for d in deps.of(action)):
                    break
                done.add(action)
                order.append((rank, action))
                pointer[rank] += 1
                progress = True
    assert all(pointer[r] == len(schedule.ranks[r]) for r in ranks), "validated schedule deadlocked"
    return order
