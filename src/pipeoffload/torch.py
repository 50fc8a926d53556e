"""``pipeoffload.torch``: run pipeoffload schedules inside torch.distributed.pipelining.

    from pipeoffload.torch import PipeOffloadSchedule
    pipe = PipeOffloadSchedule(stages, build_schedule("po-f", pp=4, microbatches=8,
                                                      offload_ratio=0.5), loss_fn=loss_fn)
    pipe.step(x, target=y, losses=losses)

See integrations/torch_schedule.py for the contract. (This module is named like the torch package;
every module of pipeoffload uses absolute imports, so ``import torch`` anywhere in it is torch.)
"""

from __future__ import annotations

from pipeoffload.integrations.torch_schedule import PipeOffloadSchedule, TransferKind
from pipeoffload.integrations.torch_versions import SUPPORTED_TORCH, check_torch_version

__all__ = ["SUPPORTED_TORCH", "PipeOffloadSchedule", "TransferKind", "check_torch_version"]
