"""A torch.distributed.pipelining schedule that runs any pipeoffload ``Schedule``, offload included.

    stages = [PipelineStage(module_s, s, schedule.num_stages, device)
              for s in schedule.stages_on_rank(rank)]
    pipe = PipeOffloadSchedule(stages, schedule, loss_fn=loss_fn)
    pipe.step(x, target=y, losses=losses)           # torch's own step() contract

How: it is a ``_PipelineScheduleRuntime`` (the runtime torchtitan uses for CSV schedules). The
schedule's compute actions (F / I / W / B) go through torch's own lowering, so UNSHARD /
RESHARD (FSDP), REDUCE_GRAD (data-parallel sync and grad scaling), SEND / RECV, DDP's no_sync
and DTensor receives stay torch's. Our transfer actions (OFFLOAD / RELOAD / FETCH /
OFFLOAD_WAIT) are then spliced back after the compute action they followed on that rank, plus
four hidden actions per offloaded (stage, microbatch) (Note: [torch splice]).

Private torch API used (hence the version pin, ``SUPPORTED_TORCH``): ``_PipelineScheduleRuntime``,
``_Action``, ``_prepare_schedule_with_comms``, ``pipeline_order_with_comms``,
``_comp_type_to_function_map``, ``PipelineStage.args_recv_info`` and, from torch 2.15,
``_validate_send_waits``. What differs between the tested versions: integrations/torch_versions.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from enum import Enum
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from pipeoffload.core.actions import MARKER_KINDS, Action, Kind
from pipeoffload.core.schedule import Schedule
from pipeoffload.core.validate import validate
from pipeoffload.errors import ConfigError, IntegrationError
from pipeoffload.integrations.torch_versions import torch_pipelining
from pipeoffload.runtime.config import OffloadConfig
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.offloader import ActivationOffloader

_TORCH = torch_pipelining(torch.__version__)  # raises IntegrationError on an untested torch

from torch.distributed.pipelining.schedules import (  # noqa: E402 - after the version check
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    _Action,
    _PipelineScheduleRuntime,
)


class TransferKind(str, Enum):
    """The computation types this schedule adds to torch's (text form as ours: ``0OFFLOAD3``)."""

    OFFLOAD = "OFFLOAD"
    RELOAD = "RELOAD"
    FETCH = "FETCH"
    OFFLOAD_WAIT = "OFFLOAD_WAIT"
    SCOPE_BEGIN = "SCOPE_BEGIN"  # hidden: open the offloader's saved-tensor scope before F
    SCOPE_END = "SCOPE_END"  # hidden: close it after F (which includes the loss on the last stage)
    BACKWARD_READY = "BACKWARD_READY"  # hidden: before I / B, wait for the RELOAD copy
    FREE = "FREE"  # hidden: after the last backward pass (W, or B), drop the host copies
    UNSHARD_AGAIN = "UNSHARD_AGAIN"  # hidden: before I / W on an FSDP stage (Note: [split FSDP])


_TO_TORCH = {Kind.F: FORWARD, Kind.I: BACKWARD_INPUT, Kind.W: BACKWARD_WEIGHT,
             Kind.B: FULL_BACKWARD}
_TRANSFER = {Kind.OFFLOAD: TransferKind.OFFLOAD, Kind.RELOAD: TransferKind.RELOAD,
             Kind.FETCH: TransferKind.FETCH, Kind.OFFLOAD_WAIT: TransferKind.OFFLOAD_WAIT}
_LEFT_TO_TORCH = (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B, *MARKER_KINDS)


class PipeOffloadSchedule(_PipelineScheduleRuntime):
    """Runs ``schedule``'s actions for this rank over torch ``PipelineStage``s.

    ``stages`` must be this rank's stages, ``schedule.stages_on_rank(rank)``; the microbatch count
    is the schedule's. ``loss_fn``, ``scale_grads`` and the other keyword arguments are torch's
    (``PipelineScheduleMulti``). ``offload_config`` and ``meter`` go to the activation offloader
    (created only when the schedule offloads). Gradients equal those of the same schedule without
    offload bitwise, since offload only moves saved tensors.
    """

    def __init__(
        self,
        stages: Sequence[Any],
        schedule: Schedule,
        n_microbatches: int | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        *,
        offload_config: OffloadConfig | None = None,
        meter: ActivationMeter | None = None,
        **torch_options: Any,
    ) -> None:
        schedule = validate(schedule)
        if n_microbatches is not None and n_microbatches != schedule.microbatches:
            raise ConfigError(
                f"n_microbatches={n_microbatches}, but schedule {schedule.name!r} has "
                f"{schedule.microbatches} microbatches; build it with "
                f"microbatches={n_microbatches}, or leave n_microbatches out")
        if schedule.has_kind(Kind.RECOMPUTE):
            raise ConfigError(
                f"schedule {schedule.name!r} has RECOMPUTE actions, which torch's pipelining "
                "runtime cannot run; wrap the stage modules in torch's activation checkpointing "
                "(torch.utils.checkpoint, or torchtitan's activation_checkpoint option) instead, "
                "or run the schedule with pipeoffload.Pipeline")
        _check_stages(stages, schedule)
        super().__init__(list(stages), n_microbatches=schedule.microbatches, loss_fn=loss_fn,
                         **torch_options)
        self.schedule = schedule
        ours = schedule.without(*_LEFT_TO_TORCH) if schedule.has_kind(*_LEFT_TO_TORCH) \
            else schedule
        self._fsdp = {st.stage_index: [m for m in st.submod.modules() if isinstance(m, FSDPModule)]
                      for st in self._stages}
        compute = {rank: [_Action(a.stage, _TO_TORCH[a.kind], a.microbatch) for a in row
                          if a.kind in _TO_TORCH]
                   for rank, row in enumerate(ours.ranks)}
        # torch's lowering adds UNSHARD / RESHARD, REDUCE_GRAD and SEND / RECV, and sets the
        # stage -> rank map from the actions.
        self._prepare_schedule_with_comms(compute)
        self.pipeline_order = compute
        fsdp_stages = {s for s, modules in self._fsdp.items() if modules}
        self.pipeline_order_with_comms = {
            rank: _splice(ours.ranks[rank], lowered, fsdp_stages if rank == self.rank else set())
            for rank, lowered in self.pipeline_order_with_comms.items()}
        if _TORCH.send_waits:
            _check_send_waits(self.pipeline_order_with_comms)
        self._offload_config = offload_config or OffloadConfig()
        self._offloader: ActivationOffloader | None = None
        if schedule.has_kind(Kind.OFFLOAD):
            params = [t for st in self._stages
                      for t in (*st.submod.parameters(), *st.submod.buffers())]
            if meter is not None:
                meter.exclude(params)
            device = self._stages[0].device
            if device.type == "cpu":
                # CPU tensors carry no index; a stage built on "cpu:1" (torchtitan does) would
                # otherwise keep every saved tensor as if it lived on another device.
                device = torch.device("cpu")
            self._offloader = ActivationOffloader(device, self._offload_config, params, meter)
        self._open: dict[tuple[int, int], AbstractContextManager[None]] = {}
        for kind, handler in self._handlers().items():
            # register_custom_function() accepts only torch's own kinds; the runtime's dispatch
            # is a lookup of action.computation_type in this dict, before its built-in kinds.
            self._comp_type_to_function_map[kind] = self._wrap(handler)

    @classmethod
    def from_torch(cls, torch_schedule: Any, schedule: Schedule,
                   **options: Any) -> PipeOffloadSchedule:
        """The same stages, loss, microbatch count and grad scaling as ``torch_schedule`` (any
        torch pipelining schedule), running ``schedule`` instead."""
        stages = getattr(torch_schedule, "_stages", None)
        if stages is None:
            stages = [getattr(torch_schedule, "_stage", None)]
        if stages[0] is None:
            raise ConfigError(f"{type(torch_schedule).__name__} holds no PipelineStage; pass a "
                              "torch.distributed.pipelining schedule")
        if torch_schedule._n_microbatches != schedule.microbatches:
            raise ConfigError(
                f"the torch schedule runs {torch_schedule._n_microbatches} microbatches but "
                f"schedule {schedule.name!r} has {schedule.microbatches}; build it with "
                f"microbatches={torch_schedule._n_microbatches}")
        return cls(stages, schedule, loss_fn=torch_schedule._loss_fn,
                   scale_grads=torch_schedule.scale_grads, **options)

    @property
    def offloader(self) -> ActivationOffloader | None:
        """The activation offloader, when the schedule has OFFLOAD actions."""
        return self._offloader

    def _handlers(self) -> dict[TransferKind, Callable[[tuple[int, int]], None]]:
        def need() -> ActivationOffloader:
            assert self._offloader is not None, "transfer action without OFFLOAD in the schedule"
            return self._offloader

        return {
            TransferKind.OFFLOAD: lambda key: need().offload(key),
            TransferKind.RELOAD: lambda key: need().reload(key),
            TransferKind.FETCH: lambda key: need().fetch_on_use(key),
            TransferKind.OFFLOAD_WAIT: lambda key: need().wait_offloaded(key),
            TransferKind.SCOPE_BEGIN: self._scope_begin,
            TransferKind.SCOPE_END: lambda key: self._open.pop(key).__exit__(None, None, None),
            TransferKind.BACKWARD_READY: lambda key: need().wait_reloaded(key),
            TransferKind.FREE: lambda key: need().discard(key),
            TransferKind.UNSHARD_AGAIN: self._unshard_again,
        }

    def _unshard_again(self, key: tuple[int, int]) -> None:
        """Note: [split FSDP] torch's split backward names a stage's weights by the module's
        parameters when I (and then W) runs, but autograd holds the unsharded parameters the
        forward used. An FSDP group resharded in between (by ``reshard_after_forward=True``, or
        by a loss that reshards it, as torchtitan's chunked loss does to norm + lm_head) is named
        by its sharded DTensors then, and its weights silently get no gradient (docs/torchtitan.md,
        "The final norm's gradient"). Unsharding it again restores what torch's runtime assumes
        between UNSHARD and RESHARD (a no-op for groups that stayed unsharded); the gradients go
        to the unsharded parameters, which REDUCE_GRAD reduces as for a full backward."""
        for module in self._fsdp[key[0]]:
            module.unshard()

    def _wrap(self, handler: Callable[[tuple[int, int]], None]) -> Callable[[Any, Any], None]:
        def run(action: Any, ctx: Any) -> None:
            handler((action.stage_index, action.microbatch_index))
            if self._offloader is not None:
                self._offloader.poll()

        return run

    def _scope_begin(self, key: tuple[int, int]) -> None:
        assert self._offloader is not None
        stage = next(s for s in self._stages if s.stage_index == key[0])
        # The stage's input (the receive buffer of this microbatch, or for a stage fed on this
        # rank the previous stage's output), read just before F takes it: torch holds it for the
        # backward whatever we do (up to 2.14 also as a buffer kept for the whole run), so
        # copying it to host would free nothing; it stays like a parameter.
        keep = [info.buffer for info in stage.args_recv_info.get(key[1], ())
                if isinstance(getattr(info, "buffer", None), torch.Tensor)]
        scope = self._offloader.scope(key, self.rank, self._offload_config.stream, keep=keep)
        scope.__enter__()
        self._open[key] = scope

    def _step_microbatches(self, *args: Any, **kwargs: Any) -> None:
        try:
            super()._step_microbatches(*args, **kwargs)
        except BaseException:
            for scope in reversed(list(self._open.values())):
                scope.__exit__(None, None, None)
            self._open.clear()
            if self._offloader is not None:
                self._offloader.abandon()
            raise
        if self._offloader is not None:
            self._offloader.finish()


def _check_stages(stages: Sequence[Any], schedule: Schedule) -> None:
    if not stages:
        raise ConfigError("no PipelineStage given; pass this rank's stages")
    rank, world = stages[0].group_rank, stages[0].group_size
    if world != schedule.num_ranks:
        raise ConfigError(
            f"the stages' process group has {world} ranks but schedule {schedule.name!r} has "
            f"{schedule.num_ranks}; build the schedule with pp={world}")
    given = sorted(s.stage_index for s in stages)
    expected = sorted(schedule.stages_on_rank(rank))
    if given != expected:
        raise ConfigError(
            f"rank {rank} was given PipelineStages {given}, but schedule {schedule.name!r} "
            f"(stage_to_rank {list(schedule.stage_to_rank)}) places stages {expected} there; "
            f"build PipelineStage(module_s, s, {schedule.num_stages}, device) for s in "
            f"schedule.stages_on_rank({rank})")
    for stage in stages:
        if stage.num_stages != schedule.num_stages:
            raise ConfigError(
                f"PipelineStage {stage.stage_index} was built with num_stages="
                f"{stage.num_stages} but schedule {schedule.name!r} has {schedule.num_stages}")


def _check_send_waits(lowered: dict[int, list[Any]]) -> None:
    """torch's own check that every SEND_F / SEND_B has one WAIT_SEND after it, run on the
    spliced lists (torch runs it before the splice)."""
    from torch.distributed.pipelining.schedules import _validate_send_waits

    try:
        _validate_send_waits(lowered)
    except ValueError as error:
        raise IntegrationError(
            f"pipeoffload.torch: the action lists with our transfer actions spliced in fail "
            f"torch's send-wait check: {error}. This is a pipeoffload bug; please report it "
            "with the schedule") from error


def _splice(row: Sequence[Action], lowered: list[Any], fsdp_stages: set[int]) -> list[Any]:
    """``lowered`` (torch's compute, comm and FSDP actions for one rank) with our transfer
    actions put back.

    Note: [torch splice] each transfer action goes right after the compute action it followed
    in ``row`` (before any, at the head). Around an offloaded (stage, microbatch) we add hidden
    actions: SCOPE_BEGIN / SCOPE_END around its F (the saved-tensor scope covers the stage's
    forward and the loss torch computes inside F), BACKWARD_READY before its I / B, and FREE
    after its last backward pass (W after I, or B). Before each I and W of a stage in
    ``fsdp_stages`` goes an UNSHARD_AGAIN (Note: [split FSDP]).
    """
    offloaded = {(a.stage, a.microbatch) for a in row if a.kind is Kind.OFFLOAD}
    last_backward = {(a.stage, a.microbatch): _TO_TORCH[a.kind] for a in row
                     if a.kind in (Kind.B, Kind.W)}
    after: dict[tuple[int, Any, int], list[Any]] = {}
    head: list[Any] = []
    anchor: tuple[int, Any, int] | None = None
    for action in row:
        if action.kind in _TO_TORCH:
            anchor = (action.stage, _TO_TORCH[action.kind], action.microbatch)
        else:
            moved = _Action(action.stage, _TRANSFER[action.kind], action.microbatch)
            (head if anchor is None else after.setdefault(anchor, [])).append(moved)
    out = list(head)
    for t in lowered:
        key = (t.stage_index, t.microbatch_index)
        kind = t.computation_type
        hit = key in offloaded
        if hit and kind == FORWARD:
            out.append(_Action(key[0], TransferKind.SCOPE_BEGIN, key[1]))
        if hit and kind in (BACKWARD_INPUT, FULL_BACKWARD):
            out.append(_Action(key[0], TransferKind.BACKWARD_READY, key[1]))
        if key[0] in fsdp_stages and kind in (BACKWARD_INPUT, BACKWARD_WEIGHT):
            out.append(_Action(key[0], TransferKind.UNSHARD_AGAIN, key[1]))
        out.append(t)
        if hit and kind == FORWARD:
            out.append(_Action(key[0], TransferKind.SCOPE_END, key[1]))
        if hit and kind in (FULL_BACKWARD, BACKWARD_WEIGHT) and last_backward.get(key) == kind:
            out.append(_Action(key[0], TransferKind.FREE, key[1]))
        out.extend(after.pop((t.stage_index, kind, t.microbatch_index), []))
    assert not after, f"transfer actions without their compute action: {after}"
    return out
