"""Grouped interleaved 1F1B: PipeOffload's base schedule (v chunks per rank, loop placement).

Follows Wan et al., "PipeOffload" (ICML 2025) and the authors' "group interleaved 1F1B":
microbatches enter in groups of g (ceil(p/2) <= g <= p, default ceil(p/2)). The building block
of one group (Note [building blocks], block.py), on rank d, with one F / I / W slot each:
- F of (chunk c, j-th microbatch of the group) at slot 3gc + 3j + d;
- I of (chunk c, j) at 3g(v-1) + p + 3g(v-1-c) + 3j + 2(p-1-d): chunks in reverse order, each
  rank two slots after the next one; W in the slot right after its I;
- group G is shifted by 3gvG slots.
Sorted by slot, rank d runs p - d + (v-1)g forwards before its first I, then one F, one I and
one W in turn, so rank 0's peak is p + (v-1)g chunk activations, (p + (v-1)g)/v M_a, and the
memory stays flat in time (what makes offloading the longest-lived chunk pay, docs/method.md
section 4). g = p is Megatron's interleaving with p - d - 1 fewer warm-up forwards; smaller g
shortens every lifespan. Splitting the backward lets the next rank's I start one slot earlier
than a full B would, which is what keeps the bubble close to interleaved 1F1B's.
Where we differ: for g < 2p/3 the block asks chunk c's first I on rank p-1 to start before
chunk c+1's last I (on rank 0) ends; execution simply waits, which costs some bubble instead of
extra warm-up forwards (which would raise the peak this schedule exists to lower). We do not
``tighten`` (block.py) this order: letting I's pass pending W's trims the bubble slightly but
keeps reloaded activations resident until their deferred W, which raises rank 0's peak under
full offload (1.5 -> 3 M_a at p=16, v=2, g=8, m=64, offload ratio 0.5). When g does not
divide m the last group is shorter and keeps the slots of a full one.
"""

from __future__ import annotations

import itertools
import math

from pipeoffload.core.actions import Kind
from pipeoffload.core.errors import ConfigError
from pipeoffload.core.families.base import (
    FamilySpec,
    PlannerHints,
    PresetSpec,
    check_common,
    check_int,
)
from pipeoffload.core.families.block import order_by_slot
from pipeoffload.core.schedule import Schedule, loop_placement
from pipeoffload.core.validate import validate

NAME = "grouped-interleaved"


def grouped_interleaved(pp: int, microbatches: int, chunks: int = 2,
                        group_size: int | None = None) -> Schedule:
    """Grouped interleaved 1F1B with ``chunks`` stages per rank and groups of ``group_size``
    microbatches (default ceil(pp/2))."""
    check_common(NAME, pp, microbatches)
    check_int("chunks", chunks, 2, NAME, "use chunks >= 2, or 1f1b for one stage per rank")
    low = math.ceil(pp / 2)
    g = low if group_size is None else check_int("group_size", group_size, 1, NAME)
    if not low <= g <= pp:
        raise ConfigError(
            f"{NAME}: group_size={g} is out of range for pp={pp}; use "
            f"ceil(pp/2) <= group_size <= pp, i.e. {low}..{pp} (smaller holds less memory)"
        )
    v = chunks

    def slot(stage: int, kind: Kind) -> int:  # of microbatch 0 (group 0, j = 0)
        chunk, rank = divmod(stage, pp)
        if kind is Kind.F:
            return 3 * g * chunk + rank
        backward = 3 * g * (v - 1) + pp + 3 * g * (v - 1 - chunk) + 2 * (pp - 1 - rank)
        return backward if kind is Kind.I else backward + 1

    # Microbatch j of group k: every pass 3 g v k + 3 j slots after microbatch 0's.
    later = [3 * g * v * group + 3 * j for group, j in map(divmod, range(microbatches),
                                                          itertools.repeat(g))]
    placement = loop_placement(pp, chunks)
    ranks = order_by_slot(placement, microbatches, (Kind.F, Kind.I, Kind.W), slot, later)
    return validate(Schedule(ranks, placement, microbatches, NAME))


SPEC = FamilySpec(
    name=NAME,
    description="PipeOffload's base: interleaved, groups of g in [p/2, p], flat memory",
    build=grouped_interleaved,
    options=("chunks", "group_size"),
    aliases=("groupinterleaved", "groupedinterleaved1f1b", "groupinterleaved1f1b", "grouped"),
    split_backward=True,
    planner=PlannerHints(by_default=True),
)

#: PipeOffload's presets (docs/method.md section 4): grouped-interleaved, v = 2, g = ceil(p/2).
PO_H = PresetSpec(
    name="po-h",
    description="PipeOffload: grouped-interleaved, g=ceil(p/2), longest-lived chunk offloaded",
    family=NAME,
    offload="chunks:1",
)
PO_F = PresetSpec(
    name="po-f",
    description="PipeOffload: grouped-interleaved, g=ceil(p/2), full offload",
    family=NAME,
    offload="all",
)
