"""How the offloader copies saved storages to host: the seam between its bookkeeping and CUDA.

``CudaCopies`` queues the copies on a device-to-host side stream after what the compute stream
has queued so far and returns the event of their completion; ``HostCopies`` (CPU) copies at
once. The offloader asks an engine only these few things, so tests can give it one whose
copies finish late (tests/test_runtime_release.py) and check, on CPU, the release order that
CUDA streams would give.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

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

    def done(self, event: object) -> bool:
        return event.query()  # type: ignore[attr-defined]

    def compute_wait(self, event: object) -> None:
        torch.cuda.current_stream(self._device).wait_event(event)  # type: ignore[arg-type]

    def retire(self, tensor: torch.Tensor) -> None:
        tensor.record_stream(self.d2h)
