"""Where an offload plan's transfers go in each rank's program: the plain schedule's compute
actions numbered once per planning call (``Layout``), a simulation's timing read onto those
numbers (``Timing``), RELOAD placement against that timing (``place_reloads``) and the
planned schedule (``insert``).

Every plan of one call (the ``limit:`` search makes several) asks the same questions of the
same plain schedule, so they are answered by index into per-rank lists made once, not by
looking actions up in dictionaries per item and per plan.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.schedule import Schedule
from pipeoffload.offload.select import Item
from pipeoffload.sim.simulator import SimResult

# The kinds as module names (Note: [hot loops], core/actions.py).
_F, _I, _B, _OFFLOAD = Kind.F, Kind.I, Kind.B, Kind.OFFLOAD
_RELOAD, _FETCH, _OFFLOAD_WAIT = Kind.RELOAD, Kind.FETCH, Kind.OFFLOAD_WAIT
_COMPUTE = frozenset(kind for kind in Kind if kind.is_compute)
# Action from a full tuple of its fields, without NamedTuple's Python-level __new__.
_action = functools.partial(tuple.__new__, Action)


class Layout:
    """The plain schedule's compute actions per rank (``compute``), each one's place in its
    rank's program (``place``), each item's forward and first backward pass (I, else B) as
    indices into ``compute`` (``forward``, ``backward``), and ``rank_of`` per stage."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.rank_of = schedule.stage_to_rank
        self.compute: list[list[Action]] = []
        self.place: list[list[int]] = []
        self.index: list[dict[Action, int]] = []  # per rank: compute action -> its index
        self.forward: dict[Item, int] = {}
        self.backward: dict[Item, int] = {}
        for actions in schedule.ranks:
            compute, place = [], []
            for position, action in enumerate(actions):
                if action[1] in _COMPUTE:
                    compute.append(action)
                    place.append(position)
            self.compute.append(compute)
            self.place.append(place)
            self.index.append({action: i for i, action in enumerate(compute)})
            for i, (s, kind, m) in enumerate(compute):
                if kind is _F:
                    self.forward[(s, m)] = i
                elif kind is _I or kind is _B:
                    self.backward[(s, m)] = i

    def backward_action(self, item: Item) -> Action:
        """The action that consumes the item's activation first (I, or B without a split)."""
        return self.compute[self.rank_of[item[0]]][self.backward[item]]


class Timing:
    """A simulation of the plain schedule or of a plan, read onto ``Layout`` indices: per rank,
    each compute action's end and its start less its stall (when it could have started without
    waiting for a copy back), and each copy out's end."""

    def __init__(self, layout: Layout, result: SimResult) -> None:
        self.ends: list[list[float]] = []
        self.ready: list[list[float]] = []
        self.copied: dict[Item, float] = {}
        copied = self.copied
        for rank, timeline in enumerate(result.timeline):
            index = layout.index[rank]
            count = len(layout.compute[rank])
            ends, ready = [0.0] * count, [0.0] * count
            # A TimedAction is (rank, action, start, end, lane, stall): unpacked, not by name.
            for _, action, start, end, _, stall in timeline:
                i = index.get(action)
                if i is not None:
                    ends[i] = end
                    ready[i] = start - stall
                elif action[1] is _OFFLOAD:
                    copied[(action[0], action[2])] = end
            self.ends.append(ends)
            self.ready.append(ready)


def place_reloads(layout: Layout, items: Iterable[Item], timing: Timing,
                  reload_time: list[float], margin: float, tolerance: float,
                  keep_stalling: bool, skipped: dict[Item, str],
                  out_ends: dict[Item, float]) -> dict[Item, int]:
    """For each item, how many compute actions ahead of its backward its RELOAD goes.

    Per rank, a backward pass over the H2D queue in deadline order: each copy back must end
    ``margin`` before its backward starts (as it would without stalls) and before the next
    copy back on the queue starts; it is then issued at the latest program point that lets it
    start in time. Items whose copy back would have to start before their copy out ends (as
    ``timing`` simulated it, else as ``out_ends`` forecasts) gain nothing and are skipped (or
    kept, stalling, if ``keep_stalling``).
    """
    rank_of, backward, forward = layout.rank_of, layout.backward, layout.forward
    by_rank: list[list[tuple[int, Item]]] = [[] for _ in layout.compute]
    for item in items:
        by_rank[rank_of[item[0]]].append((backward[item], item))
    leads: dict[Item, int] = {}
    copied = timing.copied
    for rank, backwards in enumerate(by_rank):
        if not backwards:
            continue
        ends, ready = timing.ends[rank], timing.ready[rank]
        next_start = float("inf")
        # Latest backward first (each item has its own backward: no ties).
        backwards.sort(reverse=True)
        for b_index, item in backwards:
            finish = min(ready[b_index] - margin, next_start)
            latest = finish - reload_time[item[0]]
            f_index = forward[item]
            # The program reaches the point before compute[j] when compute[j-1] ends.
            j = b_index
            while j > f_index + 1 and ends[j - 1] > latest + tolerance:
                j -= 1
            issue = ends[j - 1]
            out_end = copied.get(item)
            if out_end is None:
                out_end = out_ends[item]
            if issue <= out_end + tolerance or issue > latest + tolerance:
                if not keep_stalling or issue <= out_end + tolerance:
                    skipped[item] = ("too short-lived: the copy back would have to start "
                                     "before the copy out ends" if issue <= out_end +
                                     tolerance else
                                     "its copies cannot hide behind compute (stall)")
                    continue
            leads[item] = b_index - j
            next_start = min(next_start, max(issue, out_end))
    return leads


def insert(layout: Layout, leads: dict[Item, int], waits: dict[Action, Item],
           fetches: set[Item]) -> Schedule:
    """The plain schedule with OFFLOAD after each chosen F, its RELOAD ``lead`` compute actions
    ahead of its backward (or its FETCH right before it, for ``fetches``), and OFFLOAD_WAITs
    (``waits``: forward -> item) before forwards.

    Each insertion is an event (place in the program, where around the action there, order
    among copies back at one place, action); the program between events is copied in slices.
    At one place: the copies back in backward order, the wait, the action, the copy out.
    """
    rank_of, place, forward, backward = layout.rank_of, layout.place, layout.forward, \
        layout.backward
    events: list[list[tuple[int, int, int, Action]]] = [[] for _ in layout.compute]
    back = [(item, lead, _RELOAD) for item, lead in leads.items()]
    back += [(item, 0, _FETCH) for item in fetches]
    for item, lead, kind in back:
        s, m = item
        rank = rank_of[s]
        b_index, rank_place, add = backward[item], place[rank], events[rank].append
        add((rank_place[b_index - lead], 0, b_index, _action((s, kind, m))))
        if kind is _RELOAD or item not in leads:  # one copy out per item
            add((rank_place[forward[item]], 3, 0, _action((s, _OFFLOAD, m))))
    for f, (s, m) in waits.items():
        rank = rank_of[f[0]]
        events[rank].append((place[rank][forward[(f[0], f[2])]], 1, 0,
                             _action((s, _OFFLOAD_WAIT, m))))
    ranks = []
    for actions, rank_events in zip(layout.schedule.ranks, events):
        rank_events.sort()
        out: list[Action] = []
        done = 0  # actions[:done] are in ``out``
        for at, where, _, copy in rank_events:
            if where == 3:  # after the action at ``at``
                at += 1
            if done < at:
                out.extend(actions[done:at])
                done = at
            out.append(copy)
        out.extend(actions[done:])
        ranks.append(out)
    return layout.schedule.with_ranks(ranks)
