"""Checkpoint state under tensor parallelism: DTensors saved as local shards, loaded back.

Note: [sharded checkpoint] Under tensor parallelism parameters, master weights and AdamW
moments are DTensors. Each tensor-parallel rank of replica 0 writes its local shards as plain
tensors to its own stage file (``stage_file(s, tp_index)``), and loads them back into the
shards of the same layout; a checkpoint therefore only resumes with the same tp (the
manifest records it and check_compatible refuses another; no resharding).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from pipeoffload.runtime.shards import ShardLayout, is_dtensor, local_shard


def local_state(value: Any) -> Any:
    """``value`` with every DTensor replaced by its local shard (plain tensors save and load
    with ``weights_only``)."""
    if isinstance(value, torch.Tensor):
        return local_shard(value).detach()
    if isinstance(value, dict):
        return {k: local_state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(local_state(v) for v in value)
    return value


@torch.no_grad()
def load_tensors(targets: Mapping[Any, torch.Tensor], saved: Mapping[Any, Any]) -> None:
    """Copy ``saved`` (plain tensors) into ``targets`` (tensors or DTensors, by their local
    shards); the names and shapes must match."""
    if set(targets) != set(saved):
        missing, extra = set(targets) - set(saved), set(saved) - set(targets)
        raise KeyError(f"names differ: missing {sorted(map(str, missing))[:3]}, unexpected "
                       f"{sorted(map(str, extra))[:3]}")
    for key, target in targets.items():
        local = local_shard(target)
        value = saved[key]
        if tuple(local.shape) != tuple(value.shape):
            raise ValueError(f"{key}: shape {list(value.shape)} saved, {list(local.shape)} here")
        local.copy_(value)


def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """After ``load_state_dict``: wrap the moments of DTensor parameters back into DTensors of
    the parameter's layout (they were saved as local shards)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if not is_dtensor(param):
                continue
            state = optimizer.state.get(param, {})
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and not is_dtensor(value) and value.dim():
                    state[key] = ShardLayout.of(param).rebuild(value)
