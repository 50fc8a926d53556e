"""A pool of host byte buffers for offloaded activations, reused across steps.

On CUDA the buffers are pinned (so copies are asynchronous) and a buffer returns to the pool
with the event of the last copy that reads or writes it; it is handed out again only once that
event has completed, so the host never waits. Sizes may change between steps: a request takes the
smallest free and ready buffer that is large enough, else a new one is allocated.
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
        self._free: dict[int, list[_Slot]] = {}  # buffer size -> free slots of that size
        self._lent: dict[int, torch.Tensor] = {}  # id(view) -> whole buffer
        self.allocated_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        # Steady state asks for the sizes it gave back, so try an exact fit first, then the
        # smallest larger buffer whose last copy is done, before allocating a new one.
        sizes = sorted(size for size, slots in self._free.items() if size >= nbytes and slots)
        buffer = None
        for size in sizes:
            slots = self._free[size]
            for index, slot in enumerate(slots):
                if slot.ready is None or slot.ready.query():  # type: ignore[attr-defined]
                    buffer = slots.pop(index).buffer
                    break
            if buffer is not None:
                break
        if buffer is None:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)
            self.allocated_bytes += nbytes
        view = buffer[:nbytes]
        self._lent[id(view)] = buffer
        return view

    def give_back(self, view: torch.Tensor, ready: object | None = None) -> None:
        """Return a buffer from ``take``; ``ready`` is the event of its last pending copy."""
        buffer = self._lent.pop(id(view))
        self._free.setdefault(buffer.numel(), []).append(_Slot(buffer, ready))
