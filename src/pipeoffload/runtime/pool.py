"""Host memory for offloaded activations: a few large segments carved into blocks, reused across
steps, bounded by what the current plan needs.

Note: [host pool]
- Segments and blocks: requests are served from segments (one large host allocation each),
  first fit by address in ``ALIGN``-byte units; a block handed back carries the event of its
  last copy and is reused once that event completed; free neighbours merge. On CUDA a segment
  is page-locked by ``cudaHostRegister`` on page-aligned pageable memory (as
  torch.distributed.checkpoint's state-dict stager does, torch/cuda/_pin_memory_utils.py), so
  the pinned bytes are exactly the segment bytes: torch's own pinned allocator
  (CachingHostAllocator) rounds every allocation up to a power of two
  (aten/src/ATen/core/CachingHostAllocator.h, ``PowerOf2Ceil``), up to twice what was asked,
  and keeps freed blocks cached.
- No allocation inside a step when reserved: ``reserve(nbytes)`` (Pipeline.reserve_host_memory,
  from the plan's sizes) allocates before the first step. A request that finds no ready block
  waits on the host for the copy events of a free block that fits (they only wait for work
  queued before, whose receives the host has passed: no NCCL deadlock); only when no free block
  fits does the pool grow, which on CUDA is a device-wide synchronisation (docs/runtime.md "GPU
  rules"): ``strict`` pools (NCCL) warn when that happens, naming the bytes to reserve.
- Bounded: at the end of a step every block is free again; ``end_step`` then keeps one segment
  of ``need * (1 + MARGIN)`` bytes, need being the most any of the last ``RECENT_STEPS`` steps
  had in use at once (or the reservation, if larger), whenever the pool holds more than one
  segment or more than ``SHRINK_ABOVE`` times that need (shapes changed), after waiting for
  the segments' last copies. Over 200 steps of sequence lengths rising 8 -> 256, or drawn at
  random, the pool stays below 1.25 times the largest step's need (1.23 and 1.24), in a step
  and after it (tests/test_runtime_pool.py checks 1.5; it grew to 82 times before). Between
  steps a device-wide sync cannot deadlock NCCL (every operation of the step has its match
  posted; tests/test_runtime_rendezvous.py).
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeoffload.core.actions import Action, Kind

ALIGN = 16  # bytes: any dtype's alignment; copies need none, and tiny tensors waste little
PAGE = 4096
MARGIN = 0.125  # segment bytes above the step's need: first-fit fragmentation (measured below)
SHRINK_ABOVE = 1.5  # rebuild when the pool holds more than this times the recent need
RECENT_STEPS = 8  # the need is the largest of this many last steps: fewer rebuilds as shapes vary
GROWTH_FRACTION = 0.25  # a new segment is at least this fraction of the pool, so few are made


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(eq=False)
class _Block:
    offset: int
    size: int
    free: bool = True
    # Copies that must end before reuse: the copy engine's events (torch.cuda.Event, or the
    # CPU tests' fake events), read through query() and synchronize() only.
    events: list[Any] = field(default_factory=list)

    def ready(self) -> bool:
        self.events = [e for e in self.events if not e.query()]
        return not self.events

    def wait(self) -> None:
        for event in self.events:
            event.synchronize()
        self.events = []


@dataclass(eq=False)
class _Segment:
    buffer: torch.Tensor  # 1-D uint8
    blocks: list[_Block]  # by offset, covering the buffer


class HostMemory:
    """Where segments come from: plain host memory, or (``pinned``) page-locked memory
    registered with CUDA and unregistered when the segment is dropped."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self.allocations = 0  # segments made so far (tests count allocations inside a step)

    def allocate(self, nbytes: int) -> torch.Tensor:
        self.allocations += 1
        if not self.pinned:
            return torch.empty(nbytes, dtype=torch.uint8)
        size = -(-nbytes // PAGE) * PAGE
        raw = torch.empty(size + PAGE, dtype=torch.uint8)
        start = (-raw.data_ptr()) % PAGE
        segment = raw[start:start + size]
        cudart = torch.cuda.cudart()
        code = int(cudart.cudaHostRegister(segment.data_ptr(), size, 1))  # 1: portable
        if code != 0:
            raise RuntimeError(f"cudaHostRegister of {size} bytes of host memory failed "
                               f"(cudaError {code}); lower the offload or the host pool")
        weakref.finalize(segment, cudart.cudaHostUnregister, segment.data_ptr())
        return segment


class HostBufferPool:
    """Host uint8 buffers for copies of device storages (Note: [host pool]); ``take`` returns
    a view of exactly ``nbytes``, ``give_back`` returns it with the event of its last copy."""

    def __init__(self, pin_memory: bool, strict: bool = False,
                 memory: HostMemory | None = None) -> None:
        self._memory = memory or HostMemory(pin_memory)
        self._strict = strict
        self._segments: list[_Segment] = []
        self._lent: dict[int, tuple[_Segment, _Block]] = {}  # data_ptr of a view -> its block
        self._in_use = 0
        self._step_need = 0  # most bytes in use at once since the last end_step
        self._recent: list[int] = []  # the needs of the last RECENT_STEPS steps
        self._reserved_need = 0  # what reserve() was asked for
        self.last_step_need = 0
        self.peak_bytes = 0  # the most the pool held, ever
        self._warned = False

    @property
    def allocated_bytes(self) -> int:
        """Host bytes the pool holds now (pinned bytes on CUDA)."""
        return sum(s.buffer.numel() for s in self._segments)

    @property
    def allocations(self) -> int:
        return self._memory.allocations

    def reserve(self, nbytes: int) -> None:
        """Hold at least ``nbytes`` in one segment (the plan's need; before the first step)."""
        self._reserved_need = max(self._reserved_need, _aligned(nbytes))
        self._rebuild_if_needed(self._reserved_need)

    def take(self, nbytes: int) -> torch.Tensor:
        size = _aligned(max(nbytes, 1))
        found = self._find(size, ready_only=True) or self._find(size, ready_only=False)
        if found is None:
            found = self._grow(size)
        segment, block = found
        block.wait()  # nothing when ready; else the host waits for that block's copies
        self._split(segment, block, size)
        block.free = False
        view = segment.buffer[block.offset:block.offset + nbytes]
        self._lent[view.data_ptr()] = (segment, block)
        self._in_use += block.size
        self._step_need = max(self._step_need, self._in_use)
        return view

    def give_back(self, view: torch.Tensor, ready: object | None = None) -> None:
        """Return a buffer from ``take``; ``ready`` is the event of its last pending copy."""
        segment, block = self._lent.pop(view.data_ptr())
        block.free = True
        if ready is not None:
            block.events.append(ready)
        self._in_use -= block.size
        self._merge(segment, block)

    def end_step(self) -> None:
        """A step ended (every buffer is back): keep the pool to what the step needed."""
        self.last_step_need = self._step_need
        self._step_need = self._in_use
        self._recent = [*self._recent, self.last_step_need][-RECENT_STEPS:]
        if not self._lent:
            self._rebuild_if_needed(max(*self._recent, self._reserved_need))

    def _rebuild_if_needed(self, need: int) -> None:
        held = self.allocated_bytes
        if need == 0 or (len(self._segments) == 1 and need <= held <= SHRINK_ABOVE * need):
            return
        if self._lent:  # cannot move lent buffers: only grow
            if held < need:
                self._add_segment(need - held)
            return
        for segment in self._segments:
            for block in segment.blocks:
                block.wait()
        self._segments = []
        self._add_segment(_aligned(math.ceil(need * (1 + MARGIN))))

    def _find(self, size: int, ready_only: bool) -> tuple[_Segment, _Block] | None:
        for segment in self._segments:
            for block in segment.blocks:
                if block.free and block.size >= size and (not ready_only or block.ready()):
                    return segment, block
        return None

    def _grow(self, size: int) -> tuple[_Segment, _Block]:
        nbytes = _aligned(max(size, math.ceil(GROWTH_FRACTION * self.allocated_bytes)))
        if self._strict and not self._warned:
            self._warned = True
            warnings.warn(
                f"the host pool allocates {nbytes} bytes of pinned memory inside a step (it "
                f"holds {self.allocated_bytes}, the step needs {self._in_use + size} so far): a "
                "device-wide synchronisation that can deadlock NCCL (docs/runtime.md, GPU "
                "rules); reserve more before the first step (Pipeline.reserve_host_memory)",
                stacklevel=3)
        return self._add_segment(nbytes)

    def _add_segment(self, nbytes: int) -> tuple[_Segment, _Block]:
        buffer = self._memory.allocate(nbytes)
        block = _Block(0, buffer.numel())
        segment = _Segment(buffer, [block])
        self._segments.append(segment)
        self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        return segment, block

    @staticmethod
    def _split(segment: _Segment, block: _Block, size: int) -> None:
        if block.size > size:
            rest = _Block(block.offset + size, block.size - size, events=list(block.events))
            segment.blocks.insert(segment.blocks.index(block) + 1, rest)
            block.size = size

    @staticmethod
    def _merge(segment: _Segment, block: _Block) -> None:
        """Join the free ``block`` with its free neighbours."""
        blocks = segment.blocks
        index = blocks.index(block)
        if index + 1 < len(blocks) and blocks[index + 1].free:
            after = blocks.pop(index + 1)
            block.size += after.size
            block.events += after.events
        if index and blocks[index - 1].free:
            before = blocks[index - 1]
            before.size += block.size
            before.events += block.events
            blocks.pop(index)


def plan_need(order: Iterable[tuple[int, Action]], stage_bytes: Mapping[int, int]) -> int:
    """The most host bytes the offloaded activations of ``order`` (a rank's actions, or local
    mode's interleaving) hold at once, given each stage's activation bytes per microbatch: a
    (stage, microbatch) with an OFFLOAD holds its buffers from its F (copies stream out while it
    runs) until its RELOAD gives them back, or, read back by FETCH, until its W or B ends.
    Blocks are aligned to ``ALIGN`` bytes per storage, which the pool's margin absorbs."""
    order = list(order)
    offloaded = {(a.stage, a.microbatch) for _, a in order if a.kind is Kind.OFFLOAD}
    held: set[tuple[int, int]] = set()
    need = peak = 0
    for _, action in order:
        key = (action.stage, action.microbatch)
        if key not in offloaded:
            continue
        if action.kind is Kind.F:
            held.add(key)
            need += stage_bytes[action.stage]
            peak = max(peak, need)
        elif key in held and action.kind in (Kind.RELOAD, Kind.W, Kind.B):
            held.discard(key)
            need -= stage_bytes[action.stage]
    return peak
