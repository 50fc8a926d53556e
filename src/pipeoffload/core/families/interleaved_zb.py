"""Interleaved zero bubble: torch.distributed.pipelining's ``ScheduleInterleavedZeroBubble``.

From Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism" (ICLR 2024, arXiv 2401.10241), as
torch ships it and names it (its ZB1P: the backward split into I and W, W passes filling the
bubbles, 1F1B's memory per chunk), over Megatron's interleaved order (interleaved.py): v chunks
per rank in loop placement, forwards and backwards walking the same table of (chunk,
microbatch) in rounds of g = m / max(1, m // p) microbatches (m must split into such rounds).
On rank r:
- warm-up: (v-1)g + p-r-1 forwards (one per hop, where interleaved 1F1B runs two), capped at v*m;
- steady state: one forward, then one I, chunks of the I's reversed;
- every I queues its W; once r I's have run, each I is followed by the oldest queued W, so a W
  runs r backward passes after its I (rank 0 at once); the queue drains at the end.
Peak per rank (v-1)g + p - r + 1 chunk activations at most (warm-up plus the I's whose W waits).
Where we differ from the paper: its ZB-1p comes from a scheduler over profiled F / I / W times
for one stage per rank; this is torch's fixed order for any v (v = 1: one stage per rank).
"""

from __future__ import annotations

from collections import deque

from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.families.base import FamilySpec, check_common, check_int
from pipeoffload.core.families.interleaved import chunk_table, round_group
from pipeoffload.core.schedule import Schedule, loop_placement
from pipeoffload.core.validate import validate

NAME = "interleaved-zb"


def _rank_order(pp: int, rank: int, chunks: int, table: list[tuple[int, int]],
                warmup: int) -> list[Action]:
    """``warmup`` forwards, then a forward and an I in turn, then the remaining I's; each I's W
    ``rank`` backward passes later, in the order of the I's."""
    fwd = [Action(chunk * pp + rank, Kind.F, mb) for chunk, mb in table]
    bwd = [Action((chunks - 1 - chunk) * pp + rank, Kind.I, mb) for chunk, mb in table]
    warm = min(warmup, len(table))
    order = fwd[:warm]
    weights: deque[Action] = deque()
    for k, backward in enumerate(bwd):
        if warm + k < len(fwd):
            order.append(fwd[warm + k])
        order.append(backward)
        weights.append(Action(backward.stage, Kind.W, backward.microbatch))
        if k >= rank:
            order.append(weights.popleft())
    return order + list(weights)


def interleaved_zb(pp: int, microbatches: int, chunks: int = 2) -> Schedule:
    """torch's interleaved zero bubble with ``chunks`` stages per rank."""
    check_common(NAME, pp, microbatches)
    check_int("chunks", chunks, 1, NAME)
    group = round_group(NAME, pp, microbatches)
    table = chunk_table(microbatches, chunks, group)
    ranks = [_rank_order(pp, r, chunks, table, (chunks - 1) * group + pp - r - 1)
             for r in range(pp)]
    return validate(Schedule(ranks, loop_placement(pp, chunks), microbatches, NAME))


SPEC = FamilySpec(
    name=NAME,
    description="torch's interleaved zero bubble (ZB1P): interleaved order, I/W split, W "
                "delayed r passes on rank r",
    build=interleaved_zb,
    options=("chunks",),
    aliases=("interleavedzerobubble", "zb1p", "interleavedzb"),
    split_backward=True,
    w_deferred=True,
)
