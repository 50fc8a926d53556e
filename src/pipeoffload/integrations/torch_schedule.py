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
``_Action`` (with ``OVERLAP_F_B`` sub-actions), ``_prepare_schedule_with_comms``,
``pipeline_order_with_comms``, ``_comp_type_to_function_map``, ``_has_backward``,
``_check_torch_compile_compatibility``, ``PipelineStage.args_recv_info`` and, from torch 2.15,
``_validate_send_waits``. torch's class names over these: integrations/torch_classes.py. What
differs between the tested versions: integrations/torch_versions.py.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from pipeoffload.core.actions import MARKER_KINDS, Action, Kind
from pipeoffload.core.schedule import Schedule
from pipeoffload.core.validate import validate
from pipeoffload.errors import ConfigError, IntegrationError
from pipeoffload.integrations.torch_versions import torch_pipelining
from pipeoffload.runtime.config import OffloadConfig, RuntimeConfig
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.offloader import ActivationOffloader
from pipeoffload.runtime.tied import TiedGradients, merge_ties

_TORCH = torch_pipelining(torch.__version__)  # raises IntegrationError on an untested torch

from torch.distributed.pipelining.schedules import (  # noqa: E402 - after the version check
    _check_torch_compile_compatibility,
    _PipelineScheduleRuntime,
)

from pipeoffload.integrations.torch_splice import (  # noqa: E402 - imports torch's schedules
    TransferKind,
    compute_row,
    forwards_only,
    splice,
)

_LEFT_TO_TORCH = (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B, *MARKER_KINDS)


class PipeOffloadSchedule(_PipelineScheduleRuntime):
    """Runs ``schedule``'s actions for this rank over torch ``PipelineStage``s.

    ``stages`` must be this rank's stages, ``schedule.stages_on_rank(rank)``; the microbatch count
    is the schedule's. ``loss_fn``, ``scale_grads`` and the other keyword arguments are torch's
    (``PipelineScheduleMulti``); without ``loss_fn`` it runs forwards only, as torch does.
    ``offload_config`` and ``meter`` go to the activation offloader (created only when the
    schedule offloads). ``overlapped``: forwards that run with the backward after them as one
    ``OVERLAP_F_B`` action (``core.families.dualpipev.dualpipev_overlapped``). Tied parameters
    declared by the stage modules (``tied_parameters``, as ``pipeoffload.hf`` sets them) get their
    summed gradient after each step, as in ``Pipeline`` (Note: [tied parameters]). Gradients equal
    those of the same schedule without offload bitwise, since offload only moves saved tensors.

    Stages that carry no ``stage_index`` (torch's schedule-plan tests use such stand-ins) are
    taken as this rank's in the schedule's order; the order and its lowering are built, and
    nothing is checked that needs more of them.
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
        overlapped: Collection[Action] = (),
        tied_timeout_s: float = RuntimeConfig().p2p_timeout_s,
        **torch_options: Any,
    ) -> None:
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be a pipeoffload Schedule (build_schedule), got "
                            f"{type(schedule).__name__}")
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
        stages = list(stages)
        _check_stages(stages, schedule)
        if schedule.has_kind(Kind.I):
            refuse_compiled(stages, f"{schedule.name!r} (I / W split)")
        super().__init__(stages, n_microbatches=schedule.microbatches, loss_fn=loss_fn,
                         **torch_options)
        self.schedule = schedule
        self._ours = schedule.without(*_LEFT_TO_TORCH) if schedule.has_kind(*_LEFT_TO_TORCH) \
            else schedule
        self._fsdp = {st.stage_index: [m for m in st.submod.modules() if isinstance(m, FSDPModule)]
                      for st in stages if isinstance(getattr(st, "submod", None), torch.nn.Module)}
        self._compute = {rank: compute_row(row, overlapped)
                         for rank, row in enumerate(self._ours.ranks)}
        # torch's lowering adds UNSHARD / RESHARD, REDUCE_GRAD and SEND / RECV, and sets the
        # stage -> rank map from the actions; our override splices our actions back in.
        self._prepare_schedule_with_comms(self._compute)
        self.pipeline_order = self._compute
        self._offload_config = offload_config or OffloadConfig()
        self._offloader: ActivationOffloader | None = None
        modules = {st.stage_index: st.submod for st in stages
                   if isinstance(getattr(st, "submod", None), torch.nn.Module)}
        params = [t for m in modules.values() for t in (*m.parameters(), *m.buffers())]
        device = _device(stages[0])
        if schedule.has_kind(Kind.OFFLOAD) and modules:
            if meter is not None:
                meter.exclude(params)
            self._offloader = ActivationOffloader(device, self._offload_config, params, meter)
        ties = merge_ties([getattr(m, "tied_parameters", {}) for m in modules.values()],
                          schedule.num_stages)
        self._tied = TiedGradients(ties, modules, schedule, getattr(stages[0], "group", None),
                                   device, dist.is_available() and dist.is_initialized(),
                                   tied_timeout_s)
        self._open: dict[tuple[int, int], AbstractContextManager[None]] = {}
        for kind, handler in self._handlers().items():
            # register_custom_function() accepts only torch's own kinds; the runtime's dispatch
            # is a lookup of action.computation_type in this dict, before its built-in kinds.
            cast(dict[Any, Any], self._comp_type_to_function_map)[kind] = self._wrap(handler)

    def _prepare_schedule_with_comms(self, actions: dict[int, list[Any]],
                                     format: str = "compute_only") -> None:
        """torch's lowering, then our transfer actions spliced back (Note: [torch splice]).
        Called again by a caller (as torch's tests do after building a schedule), it lowers
        again; an order other than our schedule's runs without offload, or is refused when the
        schedule offloads (its transfers were planned for its own order)."""
        # torch annotates its lists as holding _Action | None; ours hold _Actions only.
        super()._prepare_schedule_with_comms(actions, format)  # type: ignore[arg-type]
        ours = getattr(self, "_ours", None)
        if ours is None or format != "compute_only":
            return
        same = {rank: [a for a in row if a is not None] for rank, row in actions.items()} \
            == self._compute
        if not same and ours.has_kind(Kind.OFFLOAD, Kind.FETCH):
            raise ConfigError(
                f"schedule {ours.name!r} plans offload for its own order; an other order given "
                "to _prepare_schedule_with_comms cannot keep it. Build the schedule for that "
                "order with pipeoffload (schedule_from_rows, then build_schedule's offload)")
        fsdp_stages = {s for s, modules in getattr(self, "_fsdp", {}).items() if modules}
        self.pipeline_order_with_comms = {
            rank: splice(ours.ranks[rank] if same else (), lowered,
                         fsdp_stages if rank == self.rank else set())
            for rank, lowered in self.pipeline_order_with_comms.items()}
        if _TORCH.send_waits:
            _check_send_waits(self.pipeline_order_with_comms)

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

    def _handlers(self) -> dict[TransferKind, Callable[[tuple[int, int]], object]]:
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

    def _wrap(self, handler: Callable[[tuple[int, int]], object]
              ) -> Callable[[Any, Any], None]:
        def run(action: Any, ctx: Any) -> None:
            if not self._has_backward:
                return  # forwards only (eval, or no loss_fn): nothing is kept for a backward
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
        keep = [buffer for info in stage.args_recv_info.get(key[1], ())
                if isinstance(buffer := getattr(info, "buffer", None), torch.Tensor)]
        scope = self._offloader.scope(key, self.rank, self._offload_config.stream, keep=keep)
        scope.__enter__()
        self._open[key] = scope

    @property
    def tied(self) -> list[str]:
        """The ties whose gradients each step sums (Note: [tied parameters])."""
        return self._tied.names

    def _step_microbatches(self, *args: Any, **kwargs: Any) -> None:
        """torch's step over our spliced lists; without a backward (``eval()``, no ``loss_fn``)
        over this rank's forward work only (Note: [forwards only])."""
        training = self._has_backward
        lists = self.pipeline_order_with_comms
        if training:
            self._tied.begin_step()
        else:
            self.pipeline_order_with_comms = {**lists, self.rank: forwards_only(lists[self.rank])}
        try:
            super()._step_microbatches(*args, **kwargs)
        except BaseException:
            for scope in reversed(list(self._open.values())):
                scope.__exit__(None, None, None)
            self._open.clear()
            if self._offloader is not None:
                self._offloader.abandon()
            if training:
                self._tied.abandon()
            raise
        finally:
            self.pipeline_order_with_comms = lists
        if self._offloader is not None:
            self._offloader.finish()
        if training:
            self._tied.finish_step()


def refuse_compiled(stages: Sequence[Any], schedule_name: str) -> None:
    """torch's RuntimeError for a split-backward schedule over ``torch.compile``d stages, with
    torch's message: the split fails mid-step under inductor ("non-empty donated buffers")."""
    _check_torch_compile_compatibility(list(stages), schedule_name)


def _device(stage: Any) -> torch.device:
    """The stage's device as a ``torch.device`` (a stage may be built with ``"cpu"``). CPU tensors
    carry no index; a stage built on "cpu:1" (torchtitan does) would otherwise keep every saved
    tensor as if it lived on another device."""
    device = torch.device(getattr(stage, "device", "cpu"))
    return torch.device("cpu") if device.type == "cpu" else device


def _check_stages(stages: Sequence[Any], schedule: Schedule) -> None:
    if not stages:
        raise ConfigError("no PipelineStage given; pass this rank's stages")
    for i, stage in enumerate(stages):
        if not hasattr(stage, "group_rank") or isinstance(stage, type):
            raise TypeError(f"stages[{i}] is {stage!r}, not a torch PipelineStage; wrap each "
                            "stage module in torch.distributed.pipelining.PipelineStage")
    rank, world = stages[0].group_rank, stages[0].group_size
    if world != schedule.num_ranks:
        raise ConfigError(
            f"the stages' process group has {world} ranks but schedule {schedule.name!r} has "
            f"{schedule.num_ranks}; build the schedule with pp={world}")
    if any(not hasattr(s, "stage_index") for s in stages):
        placed = schedule.stages_on_rank(rank)
        if len(stages) != len(placed):
            raise ConfigError(
                f"rank {rank} was given {len(stages)} stages, but schedule {schedule.name!r} "
                f"places {len(placed)} there ({list(placed)})")
        return
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
    # torch >= 2.14 only; the caller asks torch_versions.py first (mypy runs on 2.13).
    from torch.distributed.pipelining.schedules import (  # type: ignore[attr-defined, unused-ignore]
        _validate_send_waits,
    )

    try:
        _validate_send_waits(lowered)
    except ValueError as error:
        raise IntegrationError(
            f"pipeoffload.torch: the action lists with our transfer actions spliced in fail "
            f"torch's send-wait check: {error}. This is a pipeoffload bug; please report it "
            "with the schedule") from error
