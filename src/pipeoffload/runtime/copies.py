"""How the offloader copies saved storages to host: the seam between its bookkeeping and CUDA,
and the queue of copies whose device memory waits for them (offloader.py Note: [release order]).

``CudaCopies`` queues the copies on a device-to-host side stream after what the compute stream
has queued so far and returns the event of their completion; ``HostCopies`` (CPU) copies at
once. The offloader asks an engine only these few things, so tests can give it one whose
copies finish late (tests/test_runtime_release.py) and check, on CPU, the release order that
CUDA streams would give.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch

CopyPairs = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (host destination, device source)


class CopyEngine(Protocol):
    """``synchronous``: copies are complete when ``copy_out`` returns (no event to wait on)."""

    synchronous: bool

    def copy_out(self, pairs: CopyPairs) -> object:
        """Start the copies after the compute stream's queued work; their completion event."""

    def done(self, event: object) -> bool:
        """Whether the copies of ``event`` have completed (never blocks)."""

    def compute_wait(self, event: object) -> None:
        """Make the compute stream (never the host) wait for ``event``."""

    def retire(self, tensor: torch.Tensor) -> None:
        """``tensor`` is dropped while a queued copy may still read it: keep the allocator from
        handing its memory out before the copy ran."""


class HostCopies:
    """CPU: plain copies, complete on return."""

    synchronous = True

    def copy_out(self, pairs: CopyPairs) -> object:
        for host, device in pairs:
            host.copy_(device)
        return None

    def done(self, event: object) -> bool:
        return True

    def compute_wait(self, event: object) -> None:
        return None

    def retire(self, tensor: torch.Tensor) -> None:
        return None


class CudaCopies:
    """Two side streams per offloader: ``d2h`` for copies out, ``h2d`` for copies back."""

    synchronous = False

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def copy_out(self, pairs: CopyPairs) -> object:
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self._device))
        self.d2h.wait_event(produced)
        with torch.cuda.stream(self.d2h):
            for host, device in pairs:
                host.copy_(device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(self.d2h)
        return copied

    def copy_in(self, hosts: Sequence[torch.Tensor],
                after: object | None = None) -> tuple[list[torch.Tensor], object]:
        """Device copies of host byte buffers (RELOAD, FETCH) and the event of their completion,
        which the compute stream must wait for before using them. They are allocated on the
        compute stream, which uses and frees them, so no ``record_stream`` ties their reuse to
        the host; the copy stream first waits for the compute stream's queued work (it may still
        use the blocks' previous tenants) and for ``after`` (the buffers' copy out)."""
        compute = torch.cuda.current_stream(self._device)
        targets = [torch.empty(h.numel(), dtype=torch.uint8, device=self._device) for h in hosts]
        allowed = torch.cuda.Event()
        allowed.record(compute)
        self.h2d.wait_event(allowed)
        if after is not None:
            self.h2d.wait_event(cast(torch.cuda.Event, after))  # an event of this engine
        with torch.cuda.stream(self.h2d):
            for target, host in zip(targets, hosts):
                target.copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.h2d)
        return targets, done

    # The events given back are the ones this engine's copies recorded.
    def done(self, event: object) -> bool:
        return cast(torch.cuda.Event, event).query()

    def compute_wait(self, event: object) -> None:
        torch.cuda.current_stream(self._device).wait_event(cast(torch.cuda.Event, event))

    def retire(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(self.d2h)


class CopyQueue:
    """Copies to host in queue order, and the device bytes that wait for them.

    Items are the offloader's storages (``nbytes``, ``pending``); ``release(item)`` drops an
    item's device memory. Copies complete in the order they were queued (one copy stream), so
    ``poll`` pops completed ones from the head, and waiting for one copy covers all before it.
    ``cap_bytes``: beyond it, ``add`` releases the oldest copies in stream order (settable:
    the offloader's default cap follows the largest activation seen).
    """

    def __init__(self, engine: CopyEngine, cap_bytes: int | None,
                 release: Callable[[Any], None]) -> None:
        self._engine = engine
        self.cap_bytes = cap_bytes
        # Weak when a bound method: the offloader owns this queue, and a strong reference back
        # would make the pair a cycle that outlives a dropped Pipeline until a full GC.
        self._release: Callable[[], Callable[[Any], None] | None] = (
            weakref.WeakMethod(release) if hasattr(release, "__self__") else lambda: release)
        self._queue: deque[tuple[object, list[Any]]] = deque()
        self.waiting_bytes = 0
        self.max_waiting_bytes = 0  # the most seen after the cap applied

    def add(self, event: object, items: list[Any]) -> None:
        for item in items:
            item.pending = True
            self.waiting_bytes += item.nbytes
        self._queue.append((event, items))
        if self.cap_bytes is not None and self.waiting_bytes > self.cap_bytes:
            self.poll()
            count, waiting = 0, self.waiting_bytes
            for _, queued in self._queue:
                if waiting <= self.cap_bytes:
                    break
                count += 1
                waiting -= sum(i.nbytes for i in queued if i.pending)
            self.release_oldest(count)
        self.max_waiting_bytes = max(self.max_waiting_bytes, self.waiting_bytes)

    def stop_waiting(self, item: Any) -> None:
        """``item`` no longer waits for its copy (released, reloaded, or gone)."""
        if item.pending:
            item.pending = False
            self.waiting_bytes -= item.nbytes

    def poll(self) -> None:
        """Release the items whose copy has completed, in host time (never blocks)."""
        while self._queue and self._engine.done(self._queue[0][0]):
            self._done(self._queue.popleft()[1])

    def release_oldest(self, count: int) -> None:
        """In stream order: the compute stream waits for the ``count`` oldest copies, then
        their items are released."""
        if count == 0:
            return
        popped = [self._queue.popleft() for _ in range(count)]
        self._engine.compute_wait(popped[-1][0])
        for _, items in popped:
            self._done(items)

    def release_through(self, items: list[Any]) -> None:
        """Release in stream order every copy up to the last one of ``items``."""
        mine = {id(item) for item in items}
        last = max((i for i, (_, queued) in enumerate(self._queue)
                    if any(id(q) in mine for q in queued)), default=None)
        if last is not None:
            self.release_oldest(last + 1)

    def forget(self) -> None:
        """End of a step: nothing waits any more (in-flight copies only matter to the pool)."""
        for _, items in self._queue:
            for item in items:
                self.stop_waiting(item)
        self._queue.clear()

    def _done(self, items: list[Any]) -> None:
        for item in items:
            if item.pending:  # else it stopped waiting meanwhile (reloaded or discarded)
                release = self._release()
                assert release is not None, "the offloader that owns this queue polls it"
                release(item)
