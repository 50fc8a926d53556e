"""ZB-V in torch's order: torch.distributed.pipelining's ``ScheduleZBVZeroBubble``.

From Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism" (ICLR 2024, arXiv 2401.10241),
section 6, as torch writes it with loops (our ``zbv``, v_shape.py, builds ZB-V from the paper's
building block and tightens it by a greedy replay: another order with the same bubble and peaks
at p = 4 and 8, docs/schedules.md). V placement: rank r holds stage r (chunk 0) and 2p-1-r
(chunk 1). With n = max(2p-1, m) microbatches per chunk, rank r runs
  1. 2(p-r)-1 x F0;  2. r x (F1 F0);  3. p-r x (F1 I1 W1);
  4. while chunk 1 has forwards left: [F0 while chunk 0 has], I0 W0, F1 I1 W1;
  5. r x (I0 I1);  6. p-r x (I0 W0);  then the W1's left, then the W0's left;
and every action of a microbatch >= m is dropped (torch's padding to 2p-1 microbatches).
Where we differ: nothing in the order, which is torch's (tests compare it with torch's own).
"""

from __future__ import annotations

from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.families.base import FamilySpec, check_common
from pipeoffload.core.schedule import Placement, Schedule, v_placement
from pipeoffload.core.validate import validate

NAME = "torch-zbv"


def _rank_order(pp: int, rank: int, microbatches: int) -> list[Action]:
    n = max(2 * pp - 1, microbatches)
    stages = (rank, 2 * pp - 1 - rank)
    count = {(chunk, kind): 0 for chunk in (0, 1) for kind in (Kind.F, Kind.I, Kind.W)}
    order: list[Action] = []

    def run(chunk: int, kind: Kind) -> None:
        order.append(Action(stages[chunk], kind, count[chunk, kind]))
        count[chunk, kind] += 1

    for _ in range(2 * (pp - rank) - 1):
        run(0, Kind.F)
    for _ in range(rank):
        run(1, Kind.F)
        run(0, Kind.F)
    for _ in range(pp - rank):
        run(1, Kind.F)
        run(1, Kind.I)
        run(1, Kind.W)
    while count[1, Kind.F] < count[0, Kind.F] or count[0, Kind.F] < n:
        if count[0, Kind.F] < n:
            run(0, Kind.F)
        run(0, Kind.I)
        run(0, Kind.W)
        run(1, Kind.F)
        run(1, Kind.I)
        run(1, Kind.W)
    for _ in range(rank):
        run(0, Kind.I)
        run(1, Kind.I)
    for _ in range(pp - rank):
        run(0, Kind.I)
        run(0, Kind.W)
    for chunk in (1, 0):
        while count[chunk, Kind.W] < count[chunk, Kind.I]:
            run(chunk, Kind.W)
    return [a for a in order if a.microbatch < microbatches]


def torch_zbv(pp: int, microbatches: int) -> Schedule:
    """ZB-V on ``pp`` ranks (2 stages each) in torch's order."""
    check_common(NAME, pp, microbatches)
    ranks = [_rank_order(pp, r, microbatches) for r in range(pp)]
    return validate(Schedule(ranks, v_placement(pp), microbatches, NAME))


SPEC = FamilySpec(
    name=NAME,
    description="ZB-V in torch's order (ScheduleZBVZeroBubble): V placement, I/W split, "
                "peak about p",
    build=torch_zbv,
    fixed_chunks=2,
    aliases=("zbvtorch",),
    placement=Placement.V,
    split_backward=True,
    w_deferred=True,
)
