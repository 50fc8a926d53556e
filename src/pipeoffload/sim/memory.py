"""Resident activation over time: the memory accounting shared by the simulator and the
runtime's meter (design.md), read off a simulated timeline."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from enum import IntEnum
from itertools import accumulate, chain
from operator import itemgetter, mul

from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.classes import Shares
from pipeoffload.core.schedule import Schedule
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.timeline import TimedAction


class Role(IntEnum):
    """What a memory change is, in the order the changes of one program position sort in."""

    COPY_BACK = 0  # a copy back allocates, right before the backward pass at this position
    START = 1  # the forward or RECOMPUTE at this position starts: it allocates
    COPY_OUT_END = 2  # the copy out of the forward at this position ends: it frees
    END = 3  # the last backward pass (W or B) at this position ends: it frees


Change = tuple[float, int, Role, int, float]
"""(time, position, role, stage, factor): at ``time``, in the way ``role`` says, the rank's
action at ``position`` in its program changes the level by the stage's activation size times
``factor`` (+1 when it is allocated, -1 when freed, a share while it streams out). A copy back
is placed at its item's first backward pass (at its own position, without one). Sorted by
(time, position, role), which is unique per rank: at a time tie, changes follow the program
(``memory_events``). offload/limit.py reads changes back to their actions by position."""

_TIME, _KIND = itemgetter(0), itemgetter(1)  # of a Change; of an Action
_STAGE, _FACTOR = itemgetter(3), itemgetter(4)  # of a Change
_COPY_BACK, _START, _COPY_OUT_END, _END = Role.COPY_BACK, Role.START, Role.COPY_OUT_END, Role.END
# The kinds as module names (Note: [hot loops], core/actions.py).
_F, _I, _W, _B = Kind.F, Kind.I, Kind.W, Kind.B
_OFFLOAD, _RELOAD, _FETCH, _RECOMPUTE = Kind.OFFLOAD, Kind.RELOAD, Kind.FETCH, Kind.RECOMPUTE
_MOVED = frozenset({_OFFLOAD, _RELOAD, _FETCH, _RECOMPUTE})  # kinds that change the accounting
_WHOLE = (1.0, 0.0)  # (moved, dropped) of an item without a class choice


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
            for time, _, _, stage, factor in memory_changes(schedule, rank_timeline, costs)]


def memory_changes(schedule: Schedule, rank_timeline: Sequence[TimedAction],
                   costs: CostModel) -> list[Change]:
    """``memory_events`` before sizes are applied, sorted: one pass serves every size vector
    (M_a units and bytes). (time, position, role) is unique per change, so the order is fully
    determined."""
    if not rank_timeline:
        return []
    actions = schedule.ranks[rank_timeline[0].rank]
    start, end = rank_times(actions, rank_timeline)
    return rank_changes(actions, start, end, copy_seconds(schedule, costs),
                        schedule.class_shares)


def rank_times(actions: Sequence[Action], rank_timeline: Sequence[TimedAction]
               ) -> tuple[list[float], list[float]]:
    """When each of a rank's ``actions`` started and ended in its timeline, by position (0.0
    for an action the timeline lacks)."""
    position = {a: i for i, a in enumerate(actions)}
    start = [0.0] * len(actions)
    end = [0.0] * len(actions)
    for _, action, began, ended, _, _ in rank_timeline:
        i = position[action]  # a FETCH read lands on its marker, which no change reads
        start[i], end[i] = began, ended
    return start, end


def copy_seconds(schedule: Schedule, costs: CostModel) -> list[float]:
    """Each stage's OFFLOAD time: ``rank_changes``'s last argument."""
    return [costs.transfer_time(s, _OFFLOAD) for s in range(schedule.num_stages)]


def rank_changes(actions: Sequence[Action], start: Sequence[float], end: Sequence[float],
                 copy_seconds: Sequence[float], shares: Shares | None = None) -> list[Change]:
    """``memory_changes`` of one rank from its program: ``start[i]`` and ``end[i]`` are when
    ``actions[i]`` ran (read for F, I, W, B, RECOMPUTE, OFFLOAD and RELOAD only),
    ``copy_seconds[s]`` is stage s's OFFLOAD time and ``shares`` the schedule's class choices
    (``Schedule.class_shares``; Note: [class accounting], core/classes.py). The simulator calls
    it with its own arrays (no timeline lookups); ``memory_changes`` with a timeline's."""
    copies: dict[tuple[int, int], int] = {}  # an offloaded (s, m) -> its OFFLOAD's position
    reloads: dict[tuple[int, int], int] = {}  # a reloaded (s, m) -> its RELOAD's position
    fetched: set[tuple[int, int]] = set()
    recomputed: set[tuple[int, int]] = set()
    for i in [position for position, action in enumerate(actions) if action[1] in _MOVED]:
        s, kind, m = actions[i]
        if kind is _OFFLOAD:
            copies[(s, m)] = i
        elif kind is _RELOAD:
            reloads[(s, m)] = i
        elif kind is _FETCH:
            fetched.add((s, m))
        else:
            recomputed.add((s, m))
    changes: list[Change] = []
    add = changes.append
    chosen = shares or {}
    for i, (s, kind, m) in enumerate(actions):
        moved, dropped = chosen[(s, m)] if chosen and (s, m) in chosen else _WHOLE
        if kind is _F:
            copy = copies.get((s, m)) if copies else None
            if copy is not None:
                part = streamed_fraction(start[i], end[i], start[copy], copy_seconds[s] * moved)
                if moved != 1.0 or dropped:
                    part *= moved
                    add((start[i], i, _START, s, 1.0 - moved - dropped + part))
                else:
                    add((start[i], i, _START, s, part))
                add((end[copy], i, _COPY_OUT_END, s, -part))
            elif not recomputed or (s, m) not in recomputed:
                add((start[i], i, _START, s, 1.0 - dropped))
        elif kind is _W or kind is _B:
            if not fetched or (s, m) not in fetched:
                add((end[i], i, _END, s, -1.0))
            elif moved != 1.0:
                add((end[i], i, _END, s, moved - 1.0))  # what was not read on use
        elif kind is _RECOMPUTE:
            add((start[i], i, _START, s, 1.0))
        if kind is _I or kind is _B:
            # A copy back allocates right before the first backward pass of its (s, m), as
            # the recompute of its dropped classes does.
            copy = reloads.pop((s, m), None) if reloads else None
            if copy is not None:
                add((start[copy], i, _COPY_BACK, s, moved))
            if dropped:
                add((start[i], i, _COPY_BACK, s, dropped))
    for (s, m), copy in reloads.items():  # without a backward pass: where it is
        add((start[copy], copy, _COPY_BACK, s, chosen.get((s, m), _WHOLE)[0]))
    # (time, position, role) is unique, so a plain tuple sort never compares further and is
    # the sort by those, without a key tuple per change.
    changes.sort()
    return changes


def streamed_fraction(f_start: float, f_end: float, copy_start: float, copy_time: float) -> float:
    """The largest share of a forward's activation on the device while it streams out (the
    forward produces at a constant rate, the copy drains at one; see [streaming offload])."""
    if copy_start >= f_end:
        return 1.0
    f_time = f_end - f_start
    if copy_time <= f_time or copy_time <= 0:
        share = (copy_start - f_start) / f_time if f_time > 0 else 1.0
    else:
        share = 1.0 - (f_end - copy_start) / copy_time
    # Clamped to [0, 1] as min(1.0, max(0.0, share)) would, without two calls per forward.
    share = share if share > 0.0 else 0.0
    return share if share < 1.0 else 1.0


def curve(changes: list[Change], sizes: Sequence[float]
          ) -> tuple[tuple[tuple[float, float], ...], float]:
    """The level after each change, as (time, level) points from (0, 0), and its peak."""
    levels = _levels(changes, sizes)
    return tuple(zip(chain((0.0,), map(_TIME, changes)), levels)), max(levels)


def peak(changes: list[Change], sizes: Sequence[float]) -> float:
    """The highest level ``curve`` would reach (the same sums, made in C)."""
    return max(accumulate(_weights(changes, sizes), initial=0.0))


def _levels(changes: list[Change], sizes: Sequence[float]) -> list[float]:
    """0.0, then the level after each change (summed in order, as a running total would)."""
    return list(accumulate(_weights(changes, sizes), initial=0.0))


def _weights(changes: list[Change], sizes: Sequence[float]) -> Iterator[float]:
    """Each change's size times its factor."""
    return map(mul, map(sizes.__getitem__, map(_STAGE, changes)), map(_FACTOR, changes))
