"""Saved tensors that are DTensors: the offloader and the meter work on their local shard.

Under tensor parallelism (torch.distributed.tensor) autograd saves DTensors, wrapper subclasses
with no storage of their own; each holds this rank's shard as a plain tensor. The memory is the
shard's, so the meter counts the shard's storage and the offloader moves the shard and rebuilds
the DTensor around the reloaded shard (same mesh, placements, global shape and stride) when
autograd unpacks it. A tensor-parallel style's plain output can be an AsyncCollectiveTensor
(the result of a collective not yet waited for); its memory is its waited inner tensor, which
is what is counted, moved and given back. Other tensor subclasses are left alone (kept on the
device, reported).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch

try:  # torch.distributed may be built without DTensor (e.g. some macOS wheels)
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - depends on the torch build
    # Without DTensor no tensor is one: the names stay, as None, for is_dtensor's test.
    DTensor = AsyncCollectiveTensor = None  # type: ignore[assignment, misc]


def is_dtensor(tensor: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(tensor, DTensor)


def is_pending_collective(tensor: torch.Tensor) -> bool:
    """An AsyncCollectiveTensor: a plain tensor's value once its collective is waited for."""
    return AsyncCollectiveTensor is not None and isinstance(tensor, AsyncCollectiveTensor)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor that holds ``tensor``'s memory on this rank (itself unless a DTensor or
    an AsyncCollectiveTensor, whose collective this waits for)."""
    if is_dtensor(tensor):
        with torch.no_grad():
            tensor = cast(DTensor, tensor).to_local()
    if is_pending_collective(tensor):
        tensor = cast(Any, tensor).trigger_wait()  # an AsyncCollectiveTensor's own method
    return tensor


def local_shards(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [local_shard(t) for t in tensors]


@dataclass(frozen=True, eq=False)
class ShardLayout:
    """How to rebuild a DTensor around its local shard: mesh, placements, global shape and
    stride."""

    mesh: Any
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    @staticmethod
    def of(tensor: torch.Tensor) -> ShardLayout:
        dtensor = cast(DTensor, tensor)
        return ShardLayout(dtensor.device_mesh, tuple(dtensor.placements), dtensor.shape,
                           tuple(dtensor.stride()))

    def rebuild(self, shard: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return DTensor.from_local(shard, self.mesh, self.placements, run_check=False,
                                      shape=self.shape, stride=self.stride)


@dataclass(frozen=True, eq=False)
class SavedShard:
    """What the offloader hands autograd for a saved DTensor: its shard as packed by the plain
    path (``inner``) and the layout to rebuild it."""

    inner: object
    layout: ShardLayout
