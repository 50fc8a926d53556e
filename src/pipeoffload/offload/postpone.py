"""Postponing forwards (OFFLOAD_WAIT) so that copies out do not pile up behind a slow link:
the paper's "postpone warm-up forwards", spending only each forward's slack.

The rule works on each rank's forwards and copies out in time order (``RankCopies``), taken
from a simulated plan (``simulated_copies``) or forecast from the plain schedule before any
plan is simulated (``forecast_copies``).
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeoffload.core.actions import Action, Kind
from pipeoffload.offload.forecast import copy_out_ends
from pipeoffload.offload.select import Item
from pipeoffload.sim.simulator import SimResult

RankCopies = tuple[list[tuple[float, Action]], list[tuple[float, float, Item]]]
"""One rank's forwards as (start, action) and copies out as (forward end, copy end, item), both
in time order (the device-to-host queue serves copies in issue order)."""


def postpone(waits: dict[Action, Item], copies: list[RankCopies], latest: dict[Action, float],
             limit: int, tolerance: float) -> bool:
    """Before each forward that would start while more than ``limit`` copies out of its rank
    are unfinished, wait (add to ``waits``: forward -> item) for enough of them, their memory
    being freed first, or for as many as its slack allows: a wait never holds a forward past
    its ``latest`` start. One wait per copy (an action runs once). Returns whether it added
    any."""
    changed = False
    awaited = set(waits.values())
    for forwards, offloads in copies:
        issued = 0
        for start, forward in forwards:
            while issued < len(offloads) and offloads[issued][0] <= start:
                issued += 1
            if forward in waits:
                continue
            recent = offloads[max(0, issued - 4 * (limit + 1)):issued]
            pending = sorted((end, item) for _, end, item in recent if end > start + tolerance)
            if len(pending) > limit:
                affordable = [item for end, item in pending[:len(pending) - limit]
                              if end <= latest[forward] + tolerance and item not in awaited]
                if affordable:
                    waits[forward] = affordable[-1]
                    awaited.add(affordable[-1])
                    changed = True
    return changed


def late_waits(waits: dict[Action, Item], result: SimResult, latest: dict[Action, float],
               tolerance: float) -> set[Action]:
    """The postponed forwards that started after their latest start in ``result``: the waits
    that cost makespan (postponing within the slack is free, see offload/forecast.py)."""
    return {t.action for rank in result.timeline for t in rank
            if t.action in waits and t.start > latest[t.action] + tolerance}


def simulated_copies(result: SimResult) -> list[RankCopies]:
    """Each rank's forwards and copies out as ``result`` ran them."""
    out: list[RankCopies] = []
    for rank_timeline in result.timeline:
        forwards: list[tuple[float, Action]] = []
        f_end: dict[Item, float] = {}
        copies = []
        for t in rank_timeline:
            _, action, start, end, _, _ = t
            kind = action[1]
            if kind is _F:
                forwards.append((start, action))
                f_end[(action[0], action[2])] = end
            elif kind is _OFFLOAD:
                copies.append(t)
        offloads = sorted((f_end[item], t.end, item) for t in copies
                          for item in ((t.action[0], t.action[2]),))
        out.append((sorted(forwards), offloads))
    return out


def forecast_copies(base: SimResult, offloaded: Iterable[Item],
                    ends: dict[Item, float] | None = None) -> list[RankCopies]:
    """Each rank's forwards as in the plain schedule's ``base`` and copies out of ``offloaded``
    as the host-link queue would serve them there (forecast.copy_out_ends; ``ends``: its
    answer for ``offloaded``, when the caller has it)."""
    if ends is None:
        ends = copy_out_ends(base, offloaded)
    out: list[RankCopies] = []
    for rank_timeline in base.timeline:
        forwards = [(start, action) for _, action, start, _, _, _ in rank_timeline
                    if action[1] is _F]
        offloads = sorted((end, ends[item], item)
                          for _, (stage, kind, microbatch), _, end, _, _ in rank_timeline
                          if kind is _F and (item := (stage, microbatch)) in ends)
        out.append((sorted(forwards), offloads))
    return out


_F, _OFFLOAD = Kind.F, Kind.OFFLOAD  # Note: [hot loops], core/actions.py
