"""Where an offload plan's transfers go in each rank's program: the plain schedule's compute
actions numbered once per planning call (``ComputeIndex``), a simulation's timing read onto those
numbers (``Timing``), RELOAD placement against that timing (``place_reloads``) and the
planned schedule (``insert``).

Every plan of one call (the ``limit:`` search makes several) asks the same questions of the
same plain schedule, so they are answered by index into per-rank lists made once, not by
looking actions up in dictionaries per item and per plan.
"""

from __future__ import annotations

import functools
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from itertools import islice
from operator import itemgetter, le, sub

from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.schedule import Schedule
from pipeoffload.offload.select import Item
from pipeoffload.sim.simulator import SimResult

# The kinds as module names (Note: [hot loops], core/actions.py).
_F, _I, _B, _OFFLOAD = Kind.F, Kind.I, Kind.B, Kind.OFFLOAD
_RELOAD, _FETCH, _OFFLOAD_WAIT = Kind.RELOAD, Kind.FETCH, Kind.OFFLOAD_WAIT
_COMPUTE = frozenset(kind for kind in Kind if kind.is_compute)
_KIND, _ITEM = itemgetter(1), itemgetter(0, 2)  # an action's kind, its (stage, microbatch)
# An Action from a tuple of its fields, without NamedTuple's Python-level __new__: 17 ms
# instead of 24 ms per 82k actions (``insert`` makes one per transfer, ~6 x 10^5 per plan at
# p = 64, m = 1024).
_action = functools.partial(tuple.__new__, Action)


class ComputeIndex:
    """The plain schedule's compute actions per rank (``compute``), each one's place in its
    rank's program (``place``), each action's index in ``compute`` (``index``, per rank), each
    item's first backward pass (I, else B) as such an index (``backward``), and ``rank_of``
    per stage."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.rank_of = schedule.stage_to_rank
        self.compute = [[a for a in actions if a[1] in _COMPUTE] for actions in schedule.ranks]
        self.place: list[Sequence[int]] = [
            range(len(actions)) if len(compute) == len(actions) else
            [i for i, action in enumerate(actions) if action[1] in _COMPUTE]
            for actions, compute in zip(schedule.ranks, self.compute)]
        # per rank: compute action -> its index
        self.index = [{a: i for i, a in enumerate(compute)} for compute in self.compute]
        self.backward = {(a[0], a[2]): i for compute in self.compute
                         for i, a in enumerate(compute) if a[1] is _I or a[1] is _B}

    @functools.cached_property
    def latest_backward_first(self) -> list[list[tuple[int, int, Item]]]:
        """Per rank, every item with a backward pass as (backward index, F index, item), latest
        backward first (sorted once: every plan places its copies back in this order)."""
        by_rank: list[list[tuple[int, int, Item]]] = [[] for _ in self.compute]
        for item, b_index in self.backward.items():
            rank = self.rank_of[item[0]]
            f_index = self.index[rank][(item[0], _F, item[1])]  # type: ignore[index]  # equals its Action
            by_rank[rank].append((b_index, f_index, item))
        for backwards in by_rank:
            backwards.sort(reverse=True)
        return by_rank

    def backward_action(self, item: Item) -> Action:
        """The action that consumes the item's activation first (I, or B without a split)."""
        return self.compute[self.rank_of[item[0]]][self.backward[item]]


class Timing:
    """A simulation of the plain schedule or of a plan, read onto ``ComputeIndex`` indices: per
    rank, each compute action's end and its start less its stall (when it could have started
    without waiting for a copy back), and each copy out's end; ``ordered``: per rank, whether
    the ends never fall (always, as simulated; checked, since the search for a program point
    relies on it)."""

    def __init__(self, compute_index: ComputeIndex, result: SimResult) -> None:
        self.ends: list[list[float]] = []
        self.ready: list[list[float]] = []
        self.copied: dict[Item, float] = {}
        # Read by position in each rank's program, in C (Note: [hot loops], core/actions.py):
        # a plan's compute actions are the plain schedule's, in the same order.
        for rank, actions in enumerate(result.schedule.ranks):
            start, end = result.rank_times(rank)
            kinds = list(map(_KIND, actions))
            where = [i for i, kind in enumerate(kinds) if kind in _COMPUTE]
            if list(map(actions.__getitem__, where)) != compute_index.compute[rank]:
                raise AssertionError(f"rank {rank}: the result's compute actions are not the "
                                     "plain schedule's")
            waits = result.rank_waits(rank)
            self.ends.append(list(map(end.__getitem__, where)))
            self.ready.append(list(map(sub, map(start.__getitem__, where),
                                       map(waits.__getitem__, where))))
            copies, _, copy_ends = result.kind_times(rank, _OFFLOAD)[0]
            self.copied.update(zip(map(_ITEM, copies), copy_ends))
        # A rank's compute runs one action at a time, so its ends never fall: searchable.
        self.ordered = [all(map(le, ends, islice(ends, 1, None))) for ends in self.ends]


def place_reloads(compute_index: ComputeIndex, items: Iterable[Item], timing: Timing,
                  reload_time: list[float], margin: float, tolerance: float,
                  keep_stalling: bool, skipped: dict[Item, str],
                  out_ends: dict[Item, float], moved: dict[Item, float] | None = None
                  ) -> dict[Item, int]:
    """For each of ``items`` (distinct), how many compute actions ahead of its backward its
    RELOAD goes.

    Per rank, a backward pass over the H2D queue in deadline order: each copy back must end
    ``margin`` before its backward starts (as it would without stalls) and before the next
    copy back on the queue starts; it is then issued at the latest program point that lets it
    start in time. Items whose copy back would have to start before their copy out ends (as
    ``timing`` simulated it, else as ``out_ends`` forecasts) gain nothing and are skipped (or
    kept, stalling, if ``keep_stalling``). ``moved``: the share of a whole copy an item's class
    choice moves (Note: [class accounting], core/classes.py), 1 for an item it lacks.
    """
    wanted = set(items)
    moved = moved or {}
    leads: dict[Item, int] = {}
    copied = timing.copied
    for rank, backwards in enumerate(compute_index.latest_backward_first):
        ends, ready, ordered = timing.ends[rank], timing.ready[rank], timing.ordered[rank]
        next_start = float("inf")
        # Latest backward first (each item has its own backward: no ties).
        for b_index, f_index, item in backwards:
            if item not in wanted:
                continue
            # min() and max() as conditionals (the same pick, ties included): one call
            # fewer per item, at 10^5 items per plan.
            finish = ready[b_index] - margin
            if next_start < finish:
                finish = next_start
            latest = finish - (reload_time[item[0]] * moved[item] if moved and item in moved
                               else reload_time[item[0]])
            # The program reaches the point before compute[j] when compute[j-1] ends: the
            # latest point after the F that it reaches by ``latest``.
            if ordered:
                j = bisect_right(ends, latest + tolerance, f_index + 1, b_index)
            else:
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
            free = out_end if out_end > issue else issue
            if free < next_start:
                next_start = free
    return leads


def insert(compute_index: ComputeIndex, leads: dict[Item, int], waits: dict[Action, Item],
           fetches: set[Item]) -> Schedule:
    """The plain schedule with OFFLOAD after each chosen F, its RELOAD ``lead`` compute actions
    ahead of its backward (or its FETCH right before it, for ``fetches``), and OFFLOAD_WAITs
    (``waits``: forward -> item) before forwards.

    What goes before and after each place in a rank's program is listed by place (at one
    place: the copies back in backward order, the wait, the action, the copy out), so that
    the program is read once and no action is looked up by value.
    """
    rank_of, place, backward = compute_index.rank_of, compute_index.place, compute_index.backward
    index = compute_index.index
    ranks = compute_index.schedule.ranks
    before: list[list[list[Action] | None]] = [[None] * len(actions) for actions in ranks]
    after: list[list[Action | None]] = [[None] * len(actions) for actions in ranks]
    back: list[list[tuple[int, int, Action]]] = [[] for _ in ranks]
    copies = [(item, lead, _RELOAD) for item, lead in leads.items()]
    copies += [(item, 0, _FETCH) for item in fetches]
    for item, lead, kind in copies:
        s, m = item
        rank = rank_of[s]
        b_index, rank_place = backward[item], place[rank]
        back[rank].append((rank_place[b_index - lead], b_index, _action((s, kind, m))))
        if kind is _RELOAD or item not in leads:  # one copy out per item
            at = rank_place[index[rank][(s, _F, m)]]  # type: ignore[index]  # equals its Action
            after[rank][at] = _action((s, _OFFLOAD, m))
    for rank_back, rank_before in zip(back, before):
        rank_back.sort()  # by place, then in backward order
        for at, _, copy in rank_back:
            slot = rank_before[at]
            if slot is None:
                rank_before[at] = [copy]
            else:
                slot.append(copy)
    for forward, (s, m) in waits.items():
        rank = rank_of[forward[0]]
        at = place[rank][index[rank][forward]]
        wait = _action((s, _OFFLOAD_WAIT, m))
        slot = before[rank][at]
        if slot is None:
            before[rank][at] = [wait]
        else:
            slot.append(wait)
    planned = []
    for actions, rank_before, rank_after in zip(ranks, before, after):
        out: list[Action] = []
        add = out.append
        for action, ahead, behind in zip(actions, rank_before, rank_after):
            if ahead is not None:
                out += ahead
            add(action)
            if behind is not None:
                add(behind)
        planned.append(out)
    return compute_index.schedule.with_ranks(planned)
