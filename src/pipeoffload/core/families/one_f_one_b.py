"""1F1B (one forward, one backward), as a building block.

Follows Narayanan et al., "PipeDream" / Megatron's non-interleaved 1F1B: rank i runs p-i-1
warm-up forwards, then alternates F and B, then drains the remaining backwards. Here it comes
out of the building block of Note [building blocks] (block.py): stage i runs F of microbatch j
at slot i + 3j and its full backward B (2 slots) at 3p - 2 - 2i + 3j. Sorting by slot gives
exactly that order (p - i forwards precede the first backward), rank i's peak is p - i
microbatches and the bubble is (p-1)/(m+p-1). For m < p the warm-up simply holds all m.
"""

from __future__ import annotations

from pipeoffload.core.actions import Kind
from pipeoffload.core.families.base import FamilySpec, PlannerHints, check_common
from pipeoffload.core.families.block import order_by_slot
from pipeoffload.core.schedule import Schedule, loop_placement
from pipeoffload.core.validate import validate

NAME = "1f1b"


def one_f_one_b(pp: int, microbatches: int) -> Schedule:
    """1F1B on ``pp`` ranks, one stage each, with full backwards."""
    check_common(NAME, pp, microbatches)

    def slot(stage: int, kind: Kind) -> int:  # microbatch mb's: 3 mb later
        return stage if kind is Kind.F else 3 * pp - 2 - 2 * stage

    placement = loop_placement(pp, 1)
    ranks = order_by_slot(placement, microbatches, (Kind.F, Kind.B), slot,
                          range(0, 3 * microbatches, 3))
    return validate(Schedule(ranks, placement, microbatches, NAME))


SPEC = FamilySpec(
    name=NAME,
    description="one forward one backward; 1 stage per rank; rank i holds p-i microbatches",
    build=one_f_one_b,
    fixed_chunks=1,
    aliases=("onefoneb", "pipedream", "pipedreamflush"),
    planner=PlannerHints(by_default=True, at_one_rank=True),
)
