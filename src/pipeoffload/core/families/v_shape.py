"""The V-shape schedules: ZB-V, V-Half and V-Min (two chunks per rank, V placement).

Rank r holds stage r (chunk 0) and stage 2p-1-r (chunk 1), so a microbatch runs down the ranks
and back up, and the last stage's backward starts on the rank that just ran it. Each schedule is
a building block with a period of 6 slots per microbatch (F0, F1, I1, I0, W1, W0 on every rank;
Note [building blocks], block.py):
- ZB-V, from Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), section 6: on rank r,
  step k runs F0 of k+2p-r-1, I0 and W0 of k, F1 of k+p, I1 and W1 of k+p-r (the paper's steady
  state); the whole block is shifted by p-1-r slots. Peak p M_a (2p chunk activations) and no
  bubble in the steady state.
- V-Half and V-Min, from Qi et al., "Pipeline Parallelism with Controllable Memory" (NeurIPS
  2024): the paper's slot formulas (docs/method.md section 6) for F0, F1, I1, I0 and W passes in
  the first free slot after their I. Peaks about p/2 + 1 and p/3 + 1 M_a.
Then, as those papers do for warm-up and cool-down, ``tighten`` (block.py) replays each order on
the unit clock: ready I's go ahead of pending W's, W's fill waits, and forwards are pulled into
the fill bubble while the rank stays within the block's own peak, so no peak rises.
Where we differ: the papers' cool-down reordering is a search; ours is that greedy replay.
"""

from __future__ import annotations

from pipeoffload.core.actions import Kind
from pipeoffload.core.families.base import FamilySpec, PlannerHints, check_common
from pipeoffload.core.families.block import first_free_slot, order_by_slot, order_peaks, tighten
from pipeoffload.core.schedule import Placement, Schedule, v_placement
from pipeoffload.core.validate import validate

ZBV = "zbv"
V_HALF = "v-half"
V_MIN = "v-min"
_PERIOD = 6
_KINDS = (Kind.F, Kind.I, Kind.W)


def _zbv_slots(pp: int) -> dict[tuple[int, Kind], int]:
    """ZB-V's block: (stage, kind) -> slot of microbatch 0."""
    slots = {}
    for r in range(pp):
        shift = pp - 1 - r
        steps = {(0, Kind.F): -(2 * pp - r - 1), (0, Kind.I): 0, (0, Kind.W): 0,
                 (1, Kind.F): -pp, (1, Kind.I): -(pp - r), (1, Kind.W): -(pp - r)}
        phase = {(0, Kind.F): 0, (0, Kind.I): 1, (0, Kind.W): 2,
                 (1, Kind.F): 3, (1, Kind.I): 4, (1, Kind.W): 5}
        for (chunk, kind), step in steps.items():
            stage = r if chunk == 0 else 2 * pp - 1 - r
            slots[stage, kind] = _PERIOD * step + phase[chunk, kind] + shift
    return slots


def _controllable_slots(pp: int, f0: list[int], f1: list[int], i1: list[int], i0: list[int]
                        ) -> dict[tuple[int, Kind], int]:
    """A block from F0 / F1 / I1 / I0 slots per rank; each W takes the first free slot
    (mod the period) after its I, chunk 1's first since its I comes first."""
    slots = {}
    for r in range(pp):
        s0, s1 = r, 2 * pp - 1 - r
        taken = {f0[r] % _PERIOD, f1[r] % _PERIOD, i1[r] % _PERIOD, i0[r] % _PERIOD}
        if len(taken) != 4:
            raise AssertionError(f"block slots collide on rank {r} for pp={pp}")
        w1 = first_free_slot(taken, i1[r] + 1, _PERIOD)
        taken.add(w1 % _PERIOD)
        w0 = first_free_slot(taken, i0[r] + 1, _PERIOD)
        slots.update({(s0, Kind.F): f0[r], (s1, Kind.F): f1[r], (s1, Kind.I): i1[r],
                      (s0, Kind.I): i0[r], (s1, Kind.W): w1, (s0, Kind.W): w0})
    return slots


def _v_min_slots(pp: int) -> dict[tuple[int, Kind], int]:
    x = 2 if pp % 3 == 0 else 0
    ranks = range(pp)
    return _controllable_slots(pp, list(ranks), [2 * pp - 1 - r for r in ranks],
                               [2 * pp + x + r for r in ranks], [4 * pp + x - 1 - r for r in ranks])


def _v_half_slots(pp: int) -> dict[tuple[int, Kind], int]:
    x = 3 if pp % 2 == 0 else 0
    ranks = range(pp)
    return _controllable_slots(pp, [2 * r for r in ranks], [3 * pp - 2 - r for r in ranks],
                               [3 * pp + x - 1 + 2 * r for r in ranks],
                               [6 * pp + x - r - 2 for r in ranks])


def _build(name: str, pp: int, microbatches: int,
           slots: dict[tuple[int, Kind], int]) -> Schedule:
    placement = v_placement(pp)
    ranks = order_by_slot(placement, microbatches, _KINDS, lambda stage, kind: slots[stage, kind],
                          range(0, _PERIOD * microbatches, _PERIOD))
    block = Schedule(ranks, placement, microbatches, name)
    return validate(tighten(block, f_cap=order_peaks(block.ranks)))


def zbv(pp: int, microbatches: int) -> Schedule:
    """ZB-V on ``pp`` ranks (2 chunks each): peak p M_a, bubble about that of the fill only."""
    check_common(ZBV, pp, microbatches)
    return _build(ZBV, pp, microbatches, _zbv_slots(pp))


def v_half(pp: int, microbatches: int) -> Schedule:
    """V-Half on ``pp`` ranks (2 chunks each): peak about p/2 + 1 M_a."""
    check_common(V_HALF, pp, microbatches)
    return _build(V_HALF, pp, microbatches, _v_half_slots(pp))


def v_min(pp: int, microbatches: int) -> Schedule:
    """V-Min on ``pp`` ranks (2 chunks each): peak about p/3 + 1 M_a."""
    check_common(V_MIN, pp, microbatches)
    return _build(V_MIN, pp, microbatches, _v_min_slots(pp))


SPEC_ZBV = FamilySpec(
    name=ZBV,
    description="zero bubble V: 2 chunks per rank in V placement, peak p, almost no bubble",
    build=zbv,
    fixed_chunks=2,
    aliases=("zbvzerobubble", "zerobubblev", "vzb", "zb-v"),
    placement=Placement.V,
    split_backward=True,
    w_deferred=True,
    planner=PlannerHints(by_default=True),
)
SPEC_V_HALF = FamilySpec(
    name=V_HALF,
    description="V-Half (controllable memory): V placement, peak about p/2 + 1, half of 1F1B's",
    build=v_half,
    fixed_chunks=2,
    placement=Placement.V,
    split_backward=True,
    w_deferred=True,
    planner=PlannerHints(by_default=True),
)
SPEC_V_MIN = FamilySpec(
    name=V_MIN,
    description="V-Min (controllable memory): V placement, peak about p/3 + 1, a third of 1F1B's",
    build=v_min,
    fixed_chunks=2,
    placement=Placement.V,
    split_backward=True,
    w_deferred=True,
    planner=PlannerHints(by_default=True),
)
