"""``pipeoffload.torch``: run pipeoffload schedules inside torch.distributed.pipelining.

Drop-in classes named and built like torch's (switching is the import line):

    from pipeoffload.torch import ScheduleInterleaved1F1B   # was torch.distributed.pipelining
    pipe = ScheduleInterleaved1F1B(stages, n_microbatches=8, loss_fn=loss_fn, offload="all")
    pipe.step(x, target=y, losses=losses)

or any pipeoffload schedule, by name (``get_schedule_class("po-f")``) or built:

    from pipeoffload.torch import PipeOffloadSchedule
    pipe = PipeOffloadSchedule(stages, build_schedule("po-f", pp=4, microbatches=8,
                                                      offload_ratio=0.5), loss_fn=loss_fn)

See integrations/torch_schedule.py and torch_classes.py for the contracts. (This module is named
like the torch package; every module of pipeoffload uses absolute imports, so ``import torch``
anywhere in it is torch.)
"""

from __future__ import annotations

from pipeoffload.integrations.torch_classes import (
    FAMILIES_OF_TORCH,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleForwardOnly,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
    get_schedule_class,
)
from pipeoffload.integrations.torch_schedule import PipeOffloadSchedule
from pipeoffload.integrations.torch_splice import TransferKind
from pipeoffload.integrations.torch_versions import SUPPORTED_TORCH, check_torch_version

__all__ = [
    "FAMILIES_OF_TORCH",
    "SUPPORTED_TORCH",
    "PipeOffloadSchedule",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleForwardOnly",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleZBVZeroBubble",
    "TransferKind",
    "check_torch_version",
    "get_schedule_class",
]
