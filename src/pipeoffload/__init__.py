"""pipeoffload: pipeline-parallel schedules with activation offload (PipeOffload, ICML 2025).

Build a schedule, check it, simulate and draw it, plan activation offload into it, and run it
on PyTorch. Everything but ``Pipeline`` and the training-loop helpers around it
(``init_distributed``, ``split_blocks``, ``clip_grad_norm_``, ``average_gradients``,
``zero_optimizer``, ``save_checkpoint`` / ``load_checkpoint``) is pure Python and imports
without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeoffload.api import build_schedule, plan_schedule, schedule_names
from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.schedule import Schedule
from pipeoffload.core.text import read_csv, write_csv
from pipeoffload.core.validate import validate
from pipeoffload.errors import PipeoffloadError
from pipeoffload.offload.plan import OffloadPolicy, add_offload
from pipeoffload.sim.costs import CostModel, HostLink
from pipeoffload.sim.simulator import simulate

if TYPE_CHECKING:
    from pipeoffload.distributed import (
        average_gradients,
        clip_grad_norm_,
        init_distributed,
        load_checkpoint,
        save_checkpoint,
        zero_optimizer,
    )
    from pipeoffload.runtime.blocks import split_blocks
    from pipeoffload.runtime.config import OffloadConfig, RuntimeConfig
    from pipeoffload.runtime.meter import ActivationMeter
    from pipeoffload.runtime.pipeline import Pipeline

__all__ = [
    "Action",
    "ActivationMeter",
    "CostModel",
    "HostLink",
    "Kind",
    "OffloadConfig",
    "OffloadPolicy",
    "Pipeline",
    "PipeoffloadError",
    "RuntimeConfig",
    "Schedule",
    "add_offload",
    "average_gradients",
    "build_schedule",
    "clip_grad_norm_",
    "init_distributed",
    "load_checkpoint",
    "plan_schedule",
    "read_csv",
    "save_checkpoint",
    "schedule_names",
    "simulate",
    "split_blocks",
    "validate",
    "write_csv",
    "zero_optimizer",
]


_LAZY = {
    "Pipeline": "pipeoffload.runtime.pipeline",
    "RuntimeConfig": "pipeoffload.runtime.config",
    "OffloadConfig": "pipeoffload.runtime.config",
    "ActivationMeter": "pipeoffload.runtime.meter",
    "split_blocks": "pipeoffload.runtime.blocks",
    **{name: "pipeoffload.distributed" for name in (
        "init_distributed", "average_gradients", "clip_grad_norm_", "save_checkpoint",
        "load_checkpoint", "zero_optimizer")},
}


def __getattr__(name: str) -> Any:
    # The runtime needs torch; import it only when asked for, so the pure core stays torch-free.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pipeoffload' has no attribute {name!r}")
