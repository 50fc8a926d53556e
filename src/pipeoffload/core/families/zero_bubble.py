"""ZB-H1 and ZB-H2: the handcrafted zero-bubble schedules, one stage per rank.

Follows Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism" (ICLR 2024), section 3: the
backward is split into I (input gradient, the paper's "B") and W (weight gradient), and W
passes, which nothing waits for, fill the bubbles. Both come out of building blocks (Note
[building blocks], block.py) with period 3 slots (F, I, W):
- ZB-H1: F and I where 1F1B puts F and its backward (F at i, I at 3p - 2 - 2i on stage i); W of
  microbatch j at 3p - 1 + i + 3j, so the steady state on stage i is F of x, I of x-(p-1-i),
  W of x-(p-1). Every rank holds at most p microbatches, like 1F1B's rank 0; the makespan is
  3m + p - 1 (the paper's (p-1)(T_F + T_B - T_W) bubble).
- ZB-H2: F at i, I at 6p - 5 - 5i, W at 6p - 4 + i: 2(p-i)-1 warm-up forwards, steady state F
  of x, I of x-2(p-1-i), W of x-2(p-1); peak 2p - 1 microbatches. Sorted by slot, the last
  2i W's of rank i already land at its tail (the paper's "reorder W passes at the tail"), and
  every rank is busy from its first action to its last. That needs the 2p - 1 microbatches its
  warm-up holds, so ZB-H2 rejects fewer (ZB-H1 is the schedule for small m).
Where we differ: the paper derives the orders by hand from a figure; ours come from the slot
formulas above. The paper's ZB-H2 also drops the optimizer-step synchronisation to gain more;
we keep the synchronous step, so from time 0 ZB-H2's makespan equals ZB-H1's (docs/method.md).
"""

from __future__ import annotations

from pipeoffload.core.actions import Kind
from pipeoffload.core.errors import ConfigError
from pipeoffload.core.families.base import FamilySpec, PlannerHints, check_common
from pipeoffload.core.families.block import order_by_slot
from pipeoffload.core.schedule import Schedule, loop_placement
from pipeoffload.core.validate import validate

H1 = "zb-h1"
H2 = "zb-h2"
_KINDS = (Kind.F, Kind.I, Kind.W)


def zb_h1(pp: int, microbatches: int) -> Schedule:
    """ZB-H1 on ``pp`` ranks: 1F1B's memory, about a third of its bubble."""
    check_common(H1, pp, microbatches)

    def slot(stage: int, kind: Kind) -> int:  # microbatch mb's: 3 mb later
        offset = {Kind.F: stage, Kind.I: 3 * pp - 2 - 2 * stage, Kind.W: 3 * pp - 1 + stage}
        return offset[kind]

    placement = loop_placement(pp, 1)
    ranks = order_by_slot(placement, microbatches, _KINDS, slot, range(0, 3 * microbatches, 3))
    return validate(Schedule(ranks, placement, microbatches, H1))


def zb_h2(pp: int, microbatches: int) -> Schedule:
    """ZB-H2 on ``pp`` ranks: no idle slot inside any rank's busy span, peak about 2p."""
    check_common(H2, pp, microbatches)
    if microbatches < 2 * pp - 1:
        raise ConfigError(
            f"{H2}: microbatches={microbatches} is too few for pp={pp}; its warm-up fills the "
            f"pipeline with 2*pp-1 = {2 * pp - 1} microbatches. Use microbatches >= {2 * pp - 1}"
            f", or {H1} (same makespan from time 0, any microbatch count)"
        )

    def slot(stage: int, kind: Kind) -> int:  # microbatch mb's: 3 mb later
        offset = {Kind.F: stage, Kind.I: 6 * pp - 5 - 5 * stage, Kind.W: 6 * pp - 4 + stage}
        return offset[kind]

    placement = loop_placement(pp, 1)
    ranks = order_by_slot(placement, microbatches, _KINDS, slot, range(0, 3 * microbatches, 3))
    return validate(Schedule(ranks, placement, microbatches, H2))


def fills_warm_up(pp: int, microbatches: int) -> bool:
    """Whether ZB-H2 builds at this count: its warm-up takes 2pp - 1 microbatches."""
    return microbatches >= 2 * pp - 1


SPEC_H1 = FamilySpec(
    name=H1,
    description="zero bubble H1: I/W split, 1F1B's peak (p), about 1/3 of its bubble",
    build=zb_h1,
    fixed_chunks=1,
    aliases=("zerobubbleh1",),
    split_backward=True,
    w_deferred=True,
    planner=PlannerHints(by_default=True),
)
SPEC_H2 = FamilySpec(
    name=H2,
    description="zero bubble H2: I/W split, no gap inside each rank's span, peak about 2p",
    build=zb_h2,
    fixed_chunks=1,
    aliases=("zerobubbleh2",),
    split_backward=True,
    w_deferred=True,
    planner=PlannerHints(microbatches=fills_warm_up),
)
