"""torch.distributed.pipelining's schedule classes, by name and constructor, running our orders.

    from pipeoffload.torch import ScheduleInterleaved1F1B   # was: from torch.distributed.pipelining
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=8, loss_fn=loss_fn, offload="all")

Each class builds the zoo schedule whose order is the torch class's own (``FAMILIES_OF_TORCH``;
tests/test_torch_orders.py compares them with what torch's classes dump), plans ``offload`` into
it (a target as ``build_schedule`` takes it: ``"all"``, ``"chunks:1"``, a ratio with
``schedule_options={"offload_ratio": 0.5}``; default none) and runs it as a
``PipeOffloadSchedule``. ``get_schedule_class`` maps torch's names and ours to a class.

Where they differ from torch's (docs/runtime.md, "Drop-in classes"): every class takes one stage
or a list of this rank's stages (torch's single-stage classes take one); ``Schedule1F1B`` also
runs fewer microbatches than stages (torch refuses); the split-backward classes refuse compiled
stages at construction like torch's, and so does ``PipeOffloadSchedule`` for any schedule with
I / W; ``ScheduleForwardOnly`` is torch's private ``_ScheduleForwardOnly`` (GPipe's forwards).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from pipeoffload.api import build_schedule
from pipeoffload.core import registry
from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.families.dualpipev import dualpipev_overlapped
from pipeoffload.core.registry import canonical_name, normalise
from pipeoffload.errors import ConfigError
from pipeoffload.integrations.torch_schedule import PipeOffloadSchedule, refuse_compiled

FAMILIES_OF_TORCH: dict[str, str] = {
    "GPipe": "gpipe",
    "1F1B": "1f1b",
    "Interleaved1F1B": "interleaved-1f1b",
    "LoopedBFS": "looped-bfs",
    "InterleavedZeroBubble": "interleaved-zb",
    "ZBVZeroBubble": "torch-zbv",
    "DualPipeV": "dualpipev",
    "ForwardOnly": "gpipe",
}
"""torch's schedule name (its class without ``Schedule``) -> the zoo family with its order."""


class _TorchNamed(PipeOffloadSchedule):
    """A torch-named class: builds ``family`` for the given stages, then runs it."""

    family: ClassVar[str]

    def __init__(
        self,
        stages: Any,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        args_chunk_spec: Any = None,
        kwargs_chunk_spec: Any = None,
        output_merge_spec: Any = None,
        scale_grads: bool = True,
        backward_requires_autograd: bool = True,
        defer_pp_recv: bool = False,
        *,
        offload: Any = None,
        schedule_options: dict[str, Any] | None = None,
        **adapter_options: Any,
    ) -> None:
        stages = list(stages) if isinstance(stages, Sequence) else [stages]
        if not stages:
            raise ConfigError(f"{type(self).__name__}: no PipelineStage given; pass this "
                              "rank's stages")
        options = {"chunks": len(stages), **(schedule_options or {})}
        try:
            schedule = build_schedule(self.family, pp=stages[0].group_size,
                                      microbatches=n_microbatches, offload=offload, **options)
        except ConfigError as error:
            raise ConfigError(f"{type(self).__name__} over {len(stages)} stage(s) per rank, "
                              f"{stages[0].group_size} rank(s), {n_microbatches} microbatches: "
                              f"{error}") from error
        if schedule.has_kind(Kind.I):
            refuse_compiled(stages, type(self).__name__)
        super().__init__(stages, schedule, loss_fn=loss_fn, args_chunk_spec=args_chunk_spec,
                         kwargs_chunk_spec=kwargs_chunk_spec,
                         output_merge_spec=output_merge_spec, scale_grads=scale_grads,
                         backward_requires_autograd=backward_requires_autograd,
                         defer_pp_recv=defer_pp_recv, overlapped=self._overlapped(schedule),
                         **adapter_options)

    @staticmethod
    def _overlapped(schedule: Any) -> frozenset[Action]:
        return frozenset()

    @classmethod
    def from_torch(cls, torch_schedule: Any, schedule: Any = None,
                   **options: Any) -> PipeOffloadSchedule:
        """This class over ``torch_schedule``'s stages, loss, microbatch count, chunk specs and
        grad scaling (``schedule``: run that pipeoffload Schedule instead, as
        ``PipeOffloadSchedule``); ``options`` as the constructor's (``offload=``, ...)."""
        if schedule is not None:
            return PipeOffloadSchedule.from_torch(torch_schedule, schedule, **options)
        stages = getattr(torch_schedule, "_stages", None) or [torch_schedule._stage]
        return cls(stages, torch_schedule._n_microbatches, loss_fn=torch_schedule._loss_fn,
                   args_chunk_spec=torch_schedule._args_chunk_spec,
                   kwargs_chunk_spec=torch_schedule._kwargs_chunk_spec,
                   output_merge_spec=torch_schedule._output_merge_spec,
                   scale_grads=torch_schedule.scale_grads, **options)


class ScheduleGPipe(_TorchNamed):
    """torch's ScheduleGPipe: every forward, then every backward (``gpipe``)."""

    family = "gpipe"


class Schedule1F1B(_TorchNamed):
    """torch's Schedule1F1B (``1f1b``); also runs fewer microbatches than stages."""

    family = "1f1b"


class ScheduleInterleaved1F1B(_TorchNamed):
    """torch's ScheduleInterleaved1F1B (``interleaved-1f1b``), one or more stages per rank."""

    family = "interleaved-1f1b"


class ScheduleLoopedBFS(_TorchNamed):
    """torch's ScheduleLoopedBFS (``looped-bfs``), one or more stages per rank."""

    family = "looped-bfs"


class ScheduleInterleavedZeroBubble(_TorchNamed):
    """torch's ScheduleInterleavedZeroBubble (``interleaved-zb``), one or more stages per rank."""

    family = "interleaved-zb"


class ScheduleZBVZeroBubble(_TorchNamed):
    """torch's ScheduleZBVZeroBubble (``torch-zbv``), two stages per rank in V placement."""

    family = "torch-zbv"


class ScheduleDualPipeV(_TorchNamed):
    """torch's ScheduleDualPipeV (``dualpipev``): its overlapped pairs run as ``OVERLAP_F_B``
    actions, so a function registered for that kind runs each pair, as in torch."""

    family = "dualpipev"

    @staticmethod
    def _overlapped(schedule: Any) -> frozenset[Action]:
        return dualpipev_overlapped(schedule.num_ranks, schedule.microbatches)


class ScheduleForwardOnly(_TorchNamed):
    """torch's ``_ScheduleForwardOnly``: every forward, nothing else (GPipe's forwards; the
    backward passes of the order are skipped, as torch skips them without a loss). A target or
    a losses list is refused, as torch refuses them."""

    family = "gpipe"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._has_backward = False

    def _step_microbatches(self, arg_mbs: Any = None, kwarg_mbs: Any = None,
                           target_mbs: Any = None, losses: Any = None,
                           *args: Any, **kwargs: Any) -> None:
        if target_mbs is not None or losses is not None:
            raise RuntimeError("Forward-only schedule does not support loss computation")
        self._has_backward = False
        super()._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, *args, **kwargs)


_CLASSES: dict[str, type[_TorchNamed]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved1f1b": ScheduleInterleaved1F1B,
    "loopedbfs": ScheduleLoopedBFS,
    "interleavedzerobubble": ScheduleInterleavedZeroBubble,
    "zbvzerobubble": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
    "forwardonly": ScheduleForwardOnly,
}


def get_schedule_class(schedule_name: str) -> type:
    """The class for a torch schedule name (as torch's ``get_schedule_class`` takes it, with or
    without ``Schedule``, any case) or one of ours (``po-f``, ``zbv``, ...: a class that builds
    that schedule for the stages it is given). torch's ``PipelineScheduleSingle`` /
    ``PipelineScheduleMulti`` (bases for CSV schedules) are returned as torch's."""
    from torch.distributed.pipelining import schedules

    key = normalise(schedule_name)
    key = key.removeprefix("schedule") if key.removeprefix("schedule") in _CLASSES else key
    if key in _CLASSES:
        return _CLASSES[key]
    if key in ("pipelineschedulesingle", "pipelineschedulemulti"):
        return schedules.PipelineScheduleSingle if key.endswith("single") \
            else schedules.PipelineScheduleMulti
    preset = registry.preset(schedule_name)
    family = preset.name if preset is not None else canonical_name(
        schedule_name, also=tuple(registry.PRESETS))
    return type(f"Schedule_{family.replace('-', '_')}", (_TorchNamed,),
                {"family": family, "__module__": __name__,
                 "__doc__": f"pipeoffload's {family} as a torch schedule class."})
