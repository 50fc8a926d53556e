"""What each process holds of the model's state, measured from its tensors after a run:
parameters, gradients (as the backward accumulates them), the optimizer's master weights and
AdamW moments, beside the planner's prediction of the masters and moments for the same run
(planner/optimizer.py ``optimizer_bytes``, sharded over dp * cp ranks as costing.py prices it;
equal on CPU, except the padding ZeRO-1 adds: fewer than dp * cp elements per bucket,
parallel/zero.py Note: [zero-1 layout])."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from pipeoffload.parallel import checkpoint as ckpt
from pipeoffload.parallel.optimizer import PipelineOptimizer
from pipeoffload.parallel.topology import Topology
from pipeoffload.planner.optimizer import OptimizerSpec, optimizer_bytes
from pipeoffload.runtime.shards import local_shard


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(local_shard(t).numel() * t.element_size() for t in tensors)


def gradient_bytes(stages: Mapping[int, nn.Module]) -> int:
    """Bytes of the gradients the stages' parameters hold now (this process's shards)."""
    return _nbytes([p.grad for m in stages.values() for p in m.parameters()
                    if p.grad is not None])


def model_state(stages: Mapping[int, nn.Module], optimizer: PipelineOptimizer, grad_bytes: int,
                topology: Topology, *, zero: int, dtype: str) -> tuple[dict[str, Any], ...]:
    """Per global rank (a collective): ``parameters``, ``gradients``, ``masters``,
    ``moments`` and ``optimizer_state`` (masters + moments) in bytes, measured, and
    ``predicted_optimizer_state``, the planner's bytes for this process's parameters (under
    ``zero`` 3 the whole parameters, of which FSDP2 left this process its 1/dp)."""
    trainable = [p for m in stages.values() for p in m.parameters() if p.requires_grad]
    numel = sum(p.numel() if zero == 3 else local_shard(p).numel() for p in trainable)
    element = 8 if dtype == "fp64" else 4  # float32 masters and moments (fp64 runs: float64)
    spec = OptimizerSpec(master_bytes=element, state_bytes=2 * element, sharded=zero >= 1)
    held = optimizer.state_bytes()
    mine = {"rank": topology.rank,
            "parameters": _nbytes([p for m in stages.values() for p in m.parameters()]),
            "gradients": grad_bytes, **held,
            "optimizer_state": held["masters"] + held["moments"],
            "predicted_optimizer_state": optimizer_bytes(
                numel, spec, dp=topology.grad_replicas if topology.distributed else 1)}
    if not topology.distributed:
        return (mine,)
    return tuple(ckpt._gather_json(mine))
