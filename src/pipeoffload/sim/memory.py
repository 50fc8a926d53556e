"""Resident activation over time: the memory accounting shared by the simulator and the
runtime's meter (design.md), read off a simulated timeline."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipeoffload.core.actions import Kind
from pipeoffload.core.schedule import Schedule
from pipeoffload.sim.costs import CostModel

if TYPE_CHECKING:
    from pipeoffload.sim.simulator import TimedAction

Change = tuple[float, float, int, float]
"""(time, program order, stage, factor): the stage's activation size times ``factor`` (+1 when
it is allocated, -1 when freed, a share while it streams out) changes the level at ``time``."""

_BY_TIME_AND_ORDER = operator.itemgetter(0, 1)
# The kinds as module names (Note: [hot loops], core/actions.py).
_F, _I, _W, _B = Kind.F, Kind.I, Kind.W, Kind.B
_OFFLOAD, _RELOAD, _FETCH, _RECOMPUTE = Kind.OFFLOAD, Kind.RELOAD, Kind.FETCH, Kind.RECOMPUTE
_MOVED = frozenset({_OFFLOAD, _RELOAD, _FETCH, _RECOMPUTE})  # kinds that change the accounting


def memory_events(schedule: Schedule, rank_timeline: Sequence[TimedAction],
                  sizes: Sequence[float], costs: CostModel) -> list[tuple[float, float]]:
    """Rank's resident-activation changes as (time, delta), in the order they happen.

    At a time tie, events follow the rank's program: an event of a compute action (its start,
    then its end) comes where that action is in the program, so zero-length actions still
    allocate and free in order; the end of a copy out frees right after its forward starts,
    and the start of a copy back allocates right before its backward. With positive durations
    this is "frees before allocations at a tie".

    Note: [memory accounting] (design.md) the activation of (s, m) is resident from the start of
    F(s, m) to the end of W(s, m) or B(s, m), except from the end of OFFLOAD(s, m) to the start
    of RELOAD(s, m); a fetched (s, m) stays off the device until its backward ends (Note:
    [fetch on use]). A recomputed (s, m) runs its F without autograd recording and keeps only
    its input (not counted: it is the previous stage's output), so it is resident from the
    start of its RECOMPUTE only.

    Note: [streaming offload] an offloaded (s, m) is copied out while its F runs, tensor by
    tensor as autograd saves it: the copy starts when the F starts (or when the D2H queue frees
    up) and cannot end before the F does. Only the part not yet copied is on the device, so
    such an (s, m) counts ``streamed_fraction`` of its size from the F's start to the copy's
    end: 0 when the copy keeps up with the forward, all of it when the copy starts after the
    forward ended.
    """
    return [(time, sizes[stage] * factor)
            for time, _, stage, factor in memory_changes(schedule, rank_timeline, costs)]


def memory_changes(schedule: Schedule, rank_timeline: Sequence[TimedAction],
                   costs: CostModel) -> list[Change]:
    """``memory_events`` before sizes are applied, sorted: one pass serves every size vector
    (M_a units and bytes). Program order keys are unique, so the order is fully determined."""
    if not rank_timeline:
        return []
    actions = schedule.ranks[rank_timeline[0].rank]
    order = {a: 2 * i for i, a in enumerate(actions)}
    copies: dict[tuple[int, int], TimedAction] = {}
    fetched: set[tuple[int, int]] = set()
    recomputed: set[tuple[int, int]] = set()
    reloads = False
    if any(kind in _MOVED for _, kind, _ in actions):
        for t in rank_timeline:
            s, kind, m = t[1]
            if kind is _OFFLOAD:
                copies[(s, m)] = t
            elif kind is _RELOAD:
                reloads = True
            elif kind is _FETCH:
                fetched.add((s, m))
            elif kind is _RECOMPUTE:
                recomputed.add((s, m))
    first_backward: dict[tuple[int, int], int] = {}  # where a copy back allocates
    for i, (s, kind, m) in enumerate(actions if reloads else ()):
        if kind is _I or kind is _B:
            first_backward.setdefault((s, m), 2 * i)
    copy_time = {s: costs.transfer_time(s, _OFFLOAD) for s in {s for s, _ in copies}}  # per stage
    changes: list[Change] = []
    add = changes.append
    # A TimedAction is (rank, action, start, end, lane, stall): unpacked, not read by name.
    for _, action, start, end, _, _ in rank_timeline:
        s, kind, m = action
        if kind is _F:
            copy = copies.get((s, m)) if copies else None
            if copy is not None:
                part = streamed_fraction(start, end, copy.start, copy_time[s])
                at = order[action]
                add((start, at, s, part))
                add((copy.end, at + 0.5, s, -part))
            elif not recomputed or (s, m) not in recomputed:
                add((start, order[action], s, 1.0))
        elif kind is _W or kind is _B:
            if not fetched or (s, m) not in fetched:
                add((end, order[action] + 1, s, -1.0))
        elif kind is _RECOMPUTE:
            add((start, order[action], s, 1.0))
        elif kind is _RELOAD:
            add((start, first_backward.get((s, m), order[action]) - 0.5, s, 1.0))
    changes.sort(key=_BY_TIME_AND_ORDER)
    return changes


def streamed_fraction(f_start: float, f_end: float, copy_start: float, copy_time: float) -> float:
    """The largest share of a forward's activation on the device while it streams out (the
    forward produces at a constant rate, the copy drains at one; see [streaming offload])."""
    if copy_start >= f_end:
        return 1.0
    f_time = f_end - f_start
    before = (copy_start - f_start) / f_time if f_time > 0 else 1.0
    if copy_time <= f_time or copy_time <= 0:
        return min(1.0, max(0.0, before))
    return min(1.0, max(0.0, 1.0 - (f_end - copy_start) / copy_time))


def curve(changes: list[Change], sizes: Sequence[float]
          ) -> tuple[tuple[tuple[float, float], ...], float]:
    """The level after each change, as (time, level) points from (0, 0), and its peak."""
    level = peak = 0.0
    points = [(0.0, 0.0)]
    for time, _, stage, factor in changes:
        level += sizes[stage] * factor
        if level > peak:
            peak = level
        points.append((time, level))
    return tuple(points), peak


def peak(changes: list[Change], sizes: Sequence[float]) -> float:
    """The highest level ``curve`` would reach."""
    level = top = 0.0
    for _, _, stage, factor in changes:
        level += sizes[stage] * factor
        if level > top:
            top = level
    return top
