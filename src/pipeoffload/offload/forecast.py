"""What the offload planner reads off the plain schedule's simulation before it simulates a
plan: how late each action may start without growing the makespan, and when copies out end.

The planner postpones forwards (OFFLOAD_WAIT) to let copies out drain; a postponement is free
exactly when the forward still starts by its latest start, so the planner spends this slack
instead of guessing. A copy back that would have to start before its copy out ends gains
nothing; copies out queue on their host link, so their ends are forecast with the queue.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from itertools import chain, repeat
from operator import itemgetter
from typing import cast

from pipeoffload.core.actions import Action, Kind
from pipeoffload.offload.select import Item
from pipeoffload.sim.simulator import SimResult

_ITEM = itemgetter(0, 2)  # an action's (stage, microbatch)


def latest_starts(result: SimResult, horizon: float) -> dict[Action, float]:
    """Per action of ``result``'s schedule, the latest start that lets every action still end
    by ``horizon`` (at least the makespan), given the same durations and program order.

    Contract: if every action starts no later than its value here, none ends after
    ``horizon``. Each rank's next action is treated as waiting for the previous one to end,
    transfers included (a conservative reading of non-blocking actions: less slack, never
    more), and a dependency across ranks costs the cost model's P2P latency.
    """
    program = result.program
    actions, owner, needs, index = program.actions, program.owner, program.needs, program.index
    p2p = result.costs.p2p_time
    count = len(actions)
    duration = [0.0] * count
    get = index.get
    for rank in result.timeline:
        for _, action, start, end, _, _ in rank:  # TimedAction's fields, unpacked
            at = get(action)
            if at is not None:
                duration[at] = end - start
    successors: list[list[int]] = [[] for _ in range(count + 1)]  # the last: never done
    for i, deps in enumerate(needs):
        for dep in deps:
            successors[dep].append(i)
    latest: list[float | None] = [None] * count
    # Program order within a rank plus data edges across ranks form a DAG; visit it in
    # reverse topological order with a pointer per rank, like the simulator's forward pass.
    first = program.first
    pointer = [stop - 1 for stop in first[1:]]
    remaining = count
    while remaining:
        progressed = False
        for r in range(len(pointer)):
            while pointer[r] >= first[r]:
                i = pointer[r]
                # The next action of the rank was visited before this one (reverse order).
                finish = horizon if i + 1 == first[r + 1] else cast(float, latest[i + 1])
                blocked = False
                for after in successors[i]:
                    later = latest[after]
                    if later is None:
                        blocked = True
                        break
                    if owner[after] != r:
                        later -= p2p
                    if later < finish:
                        finish = later
                if blocked:
                    break
                latest[i] = finish - duration[i]
                pointer[r] -= 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise AssertionError("latest_starts: the schedule's dependencies form a cycle")
    return dict(zip(actions, cast("list[float]", latest)))  # every one set: no cycle


class LatestStarts(Mapping[Action, float]):
    """``latest_starts(result, horizon)``, worked out on the first lookup: a plan asks only when
    copies out pile up behind a forward, and most never do."""

    def __init__(self, result: SimResult, horizon: float) -> None:
        self.result, self.horizon = result, horizon

    @functools.cached_property
    def _starts(self) -> dict[Action, float]:
        return latest_starts(self.result, self.horizon)

    def __getitem__(self, action: Action) -> float:
        return self._starts[action]

    def __iter__(self) -> Iterator[Action]:
        return iter(self._starts)

    def __len__(self) -> int:
        return len(self._starts)


def copy_out_ends(result: SimResult, items: Iterable[Item]) -> dict[Item, float]:
    """When each item's copy out would end if every one of ``items`` were offloaded and the
    forwards ran as in ``result``: the simulator's streaming rule (starts with its forward,
    ends no earlier) on each host link's device-to-host queue, served in order of forward
    start. An upper bound when fewer items end up offloaded."""
    return Forwards(result).copy_out_ends(items)


class Forwards:
    """The forwards of one simulation in the orders the forecasts read them, each sorted once
    (a planning call forecasts from the plain schedule's simulation for every plan it makes)."""

    def __init__(self, result: SimResult) -> None:
        self.result = result

    @functools.cached_property
    def _timed(self) -> list[tuple[list[Action], list[float], list[float]]]:
        """Each rank's forwards, their starts and their ends (``SimResult.kind_times``)."""
        return [self.result.kind_times(rank, Kind.F)[0]
                for rank in range(self.result.schedule.num_ranks)]

    @functools.cached_property
    def by_start(self) -> list[tuple[float, float, int, Item]]:
        """Every forward as (start, end, rank, item), in that order."""
        return sorted(chain.from_iterable(
            zip(starts, ends, repeat(rank), map(_ITEM, forwards))
            for rank, (forwards, starts, ends) in enumerate(self._timed)))

    @functools.cached_property
    def per_rank(self) -> list[tuple[list[tuple[float, Action]], list[tuple[float, Item]]]]:
        """Each rank's forwards as (start, action) and as (end, item), each list sorted."""
        return [(sorted(zip(starts, forwards)), sorted(zip(ends, map(_ITEM, forwards))))
                for forwards, starts, ends in self._timed]

    def copy_out_ends(self, items: Iterable[Item]) -> dict[Item, float]:
        """``copy_out_ends`` of this simulation."""
        costs = self.result.costs
        wanted = set(items)
        ranks = self.result.schedule.num_ranks
        # Each rank's device-to-host queue, numbered: ranks may share a host link.
        queues: dict[tuple[int, str], int] = {}
        queue = [queues.setdefault(costs.host_link.channel(r, Kind.OFFLOAD), len(queues))
                 for r in range(ranks)]
        free = [0.0] * len(queues)
        copy_time = [costs.transfer_time(s, Kind.OFFLOAD)
                     for s in range(self.result.schedule.num_stages)]
        moved = {item: share[0] for item, share in self.result.schedule.class_shares.items()}
        ends: dict[Item, float] = {}
        for f_start, f_end, rank, item in self.by_start:
            if item in wanted:
                q = queue[rank]
                begin = free[q] if free[q] > f_start else f_start  # max(), without a call
                done = begin + copy_time[item[0]] * (moved[item] if item in moved else 1.0)
                free[q] = ends[item] = f_end if f_end > done else done
        return ends
