"""Postponing forwards (OFFLOAD_WAIT) so that copies out do not pile up behind a slow link:
the paper's "postpone warm-up forwards", spending only each forward's slack.

The rule works on each rank's forwards and copies out in time order (``RankCopies``), taken
from a simulated plan (``simulated_copies``) or forecast from the plain schedule before any
plan is simulated (``forecast_copies``).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import islice
from operator import itemgetter, le

from pipeoffload.core.actions import Action, Kind
from pipeoffload.offload.forecast import Forwards
from pipeoffload.offload.select import Item
from pipeoffload.sim.simulator import SimResult

RankCopies = tuple[Sequence[float], Sequence[Action], Sequence[float], Sequence[float],
                   Sequence[Item]]
"""One rank's forwards as (starts, actions) in time order and its copies out as (forward ends,
copy ends, items) in order of (forward end, copy end, item) (the device-to-host queue serves
copies in issue order): parallel sequences, so that ``postpone`` can search and slice them."""


def postpone(waits: dict[Action, Item], copies: list[RankCopies], latest: Mapping[Action, float],
             limit: int, tolerance: float,
             runs_before: Callable[[Item, Action], bool] = lambda item, forward: True) -> bool:
    """Before each forward that would start while more than ``limit`` copies out of its rank
    are unfinished, wait (add to ``waits``: forward -> item) for enough of them, their memory
    being freed first, or for as many as its slack allows: a wait never holds a forward past
    its ``latest`` start. One wait per copy (an action runs once). Returns whether it added
    any. Only the last ``4 * (limit + 1)`` copies issued are looked at, and only copies whose
    forward ``runs_before`` this one in the rank's program: with zero-length forwards, a
    later forward ends when this one starts, and waiting for its copy would never end."""
    changed = False
    awaited = set(waits.values())
    window = 4 * (limit + 1)
    for starts, forwards, f_ends, copy_ends, items in copies:
        # A device-to-host queue serves copies in order, so their ends do not fall; then the
        # (limit + 1)-th latest end of the recent copies is simply where it is (checked, as
        # the shortcut needs it).
        ordered = all(map(le, copy_ends, islice(copy_ends, 1, None)))
        issued = 0
        for start, forward in zip(starts, forwards):
            issued = bisect_right(f_ends, start, issued)  # copies issued by ``start``
            if issued <= limit or forward in waits:
                continue
            first = issued - window if issued > window else 0
            after = start + tolerance
            # Most forwards find at most ``limit`` recent copies pending: the (limit + 1)-th
            # latest end among them tells, without pairing ends with items.
            if ordered:
                if copy_ends[issued - limit - 1] <= after:
                    continue
            elif sorted(copy_ends[first:issued])[-limit - 1] <= after:
                continue
            pending = sorted((end, item) for end, item in zip(copy_ends[first:issued],
                                                               items[first:issued])
                             if end > after)
            affordable = [item for end, item in pending[:len(pending) - limit]
                          if end <= latest[forward] + tolerance and item not in awaited
                          and runs_before(item, forward)]
            if affordable:
                waits[forward] = affordable[-1]
                awaited.add(affordable[-1])
                changed = True
    return changed


def late_waits(waits: dict[Action, Item], result: SimResult, latest: Mapping[Action, float],
               tolerance: float) -> set[Action]:
    """The postponed forwards that started after their latest start in ``result``: the waits
    that cost makespan (postponing within the slack is free, see offload/forecast.py)."""
    return {t.action for rank in result.timeline for t in rank
            if t.action in waits and t.start > latest[t.action] + tolerance}


def simulated_copies(result: SimResult) -> list[RankCopies]:
    """Each rank's forwards and copies out as ``result`` ran them."""
    out: list[RankCopies] = []
    for rank in range(result.schedule.num_ranks):
        # Read by position in the rank's program, not off the timeline (SimResult.kind_times).
        (forwards, f_starts, f_ends), (copies, _, copy_ends) = result.kind_times(rank, _F,
                                                                                _OFFLOAD)
        f_end = dict(zip(map(_ITEM, forwards), f_ends))
        items = list(map(_ITEM, copies))
        offloads = sorted(zip(map(f_end.__getitem__, items), copy_ends, items))
        out.append(_rank_copies(sorted(zip(f_starts, forwards)), offloads))
    return out


def forecast_copies(forwards: Forwards, offloaded: Iterable[Item],
                    ends: dict[Item, float] | None = None) -> list[RankCopies]:
    """Each rank's forwards as in the plain schedule's simulation (``forwards``) and copies out
    of ``offloaded`` as the host-link queue would serve them there (forecast.copy_out_ends;
    ``ends``: its answer for ``offloaded``, when the caller has it)."""
    if ends is None:
        ends = forwards.copy_out_ends(offloaded)
    out: list[RankCopies] = []
    for starts, by_end in forwards.per_rank:
        # Sorted by (forward end, item) already: the sort only settles equal forward ends.
        offloads = [(end, ends[item], item) for end, item in by_end if item in ends]
        offloads.sort()
        out.append(_rank_copies(starts, offloads))
    return out


def _rank_copies(forwards: list[tuple[float, Action]],
                 offloads: list[tuple[float, float, Item]]) -> RankCopies:
    starts, actions = zip(*forwards) if forwards else ((), ())
    f_ends, copy_ends, items = zip(*offloads) if offloads else ((), (), ())
    return starts, actions, f_ends, copy_ends, items


_F, _OFFLOAD = Kind.F, Kind.OFFLOAD  # Note: [hot loops], core/actions.py
_ITEM = itemgetter(0, 2)  # of an Action: its (stage, microbatch)
