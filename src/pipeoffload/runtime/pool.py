"""A pool of host byte buffers for offloaded activations, reused across steps.

On CUDA the buffers are pinned (so copies are asynchronous) and a buffer returns to the pool
with the event of the last copy that reads or writes it; it is handed out again only once that
event has completed, so the host never waits. Sizes may change between steps: a request takes the
smallest free buffer that is large enough, else a new one is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False)
class _Slot:
    buffer: torch.Tensor  # 1-D uint8, the whole allocation
    ready: object | None  # torch.cuda.Event that must complete before reuse, or None


class HostBufferPool:
    """Host uint8 buffers by size; ``take`` returns a view of exactly ``nbytes``."""

    def __init__(self, pin_memory: bool) -> None:
        self._pin = pin_memory
        self._free: list[_Slot] = []
        self._lent: dict[int, torch.Tensor] = {}  # id(view) -> whole buffer
        self.allocated_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        best: _Slot | None = None
        for slot in self._free:
            if slot.buffer.numel() < nbytes:
                continue
            if slot.ready is not None and not slot.ready.query():  # type: ignore[attr-defined]
                continue
            if best is None or slot.buffer.numel() < best.buffer.numel():
                best = slot
        if best is None:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)
            self.allocated_bytes += nbytes
        else:
            self._free.remove(best)
            buffer = best.buffer
        view = buffer[:nbytes]
        self._lent[id(view)] = buffer
        return view

    def give_back(self, view: torch.Tensor, ready: object | None = None) -> None:
        """Return a buffer from ``take``; ``ready`` is the event of its last pending copy."""
        buffer = self._lent.pop(id(view))
        self._free.append(_Slot(buffer, ready))
