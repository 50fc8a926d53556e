"""The ``limit:`` target's search: per rank, the shortest longest-lived-first prefix of items
whose offload brings the rank's peak to the limit.

Every probe is a whole plan (place transfers, simulate, re-place), so the search makes few, and
holds none while it searches (a plan at p = 64, m = 1024, v = 4 is most of a gigabyte): the
answer is usually the last probe, else it is planned once more. A probe's timeline also tells
what a shorter prefix would do: the rank's memory curve with the items it leaves out held on
the device from their F to their last backward, every action where the probe ran it
(``_estimate``). So:
1. plan every item; ranks still above the limit cannot reach it (their notes say why);
2. per rank, probe the shortest prefix the last probe's timeline says meets the limit (so one
   item fewer would miss it); the rank is done when that probe has the peak the timeline
   foresaw, or when its own timeline says one item fewer would miss; else probe again;
3. a rank whose estimate missed the limit in its own plan falls back to bisection.
Ranks are searched in lockstep: a rank's peak depends on its own offloads, not on other
ranks' (except through a shared host link: a rank that misses the limit in the final
combination offloads every item, as in step 1). Where transfers hide, so that compute keeps
its times from one prefix to the next, the estimate is exact and the search costs two plans
instead of log2(items per rank) + 2: the minimality of the last item is read off a timeline
that foresaw the final plan's peak exactly, not planned again.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from itertools import accumulate, compress
from operator import itemgetter
from typing import Protocol

from pipeoffload.core.actions import Kind, items_of
from pipeoffload.core.schedule import Schedule
from pipeoffload.offload.report import OffloadPlan
from pipeoffload.offload.select import Item
from pipeoffload.offload.targets import OffloadTarget
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.memory import Role
from pipeoffload.sim.simulator import SimResult

Outcome = tuple[Schedule, SimResult, dict[Item, str]]
"""A plan: the planned schedule, its simulation, and the items skipped with why."""


class PrefixPlanner(Protocol):
    """What the search asks of the offload planner (offload/plan.py ``add_offload``'s): the
    plain schedule, its costs and simulation, each rank's candidate items longest-lived first,
    plans of chosen items, and the final report."""

    schedule: Schedule
    costs: CostModel
    base: SimResult
    units: tuple[float, ...]
    """Per stage, one microbatch's activation in M_a units."""
    by_lifespan: list[list[Item]]

    def plan(self, chosen: Iterable[Item], keep_changes: bool = False) -> Outcome:
        """The plan that offloads ``chosen``; ``keep_changes``: its simulation keeps its memory
        changes (read by the search's estimate)."""
        ...

    def finish(self, target: OffloadTarget, planned: Schedule, result: SimResult,
               skipped: dict[Item, str], notes: tuple[str, ...]) -> OffloadPlan:
        """The plan and its report."""
        ...

    def floor_reason(self, rank: int) -> str:
        """Why rank ``rank`` cannot go lower."""
        ...

_TOLERANCE = 1e-9  # a peak this far above the limit still meets it (float sums)
_KIND, _ITEM = itemgetter(1), itemgetter(0, 2)  # an action's kind, its (stage, microbatch)

# The kinds as module names (Note: [hot loops], core/actions.py).
_F, _OFFLOAD, _RELOAD, _FETCH = Kind.F, Kind.OFFLOAD, Kind.RELOAD, Kind.FETCH
_LAST_PASS = frozenset({Kind.W, Kind.B})
_START, _COPY_OUT_END, _COPY_BACK, _END = Role.START, Role.COPY_OUT_END, Role.COPY_BACK, Role.END


def plan_limit(planner: PrefixPlanner, target: OffloadTarget) -> OffloadPlan:
    """The plan of the shortest prefixes per rank that meet ``target`` (module docstring)."""
    ranks = range(planner.schedule.num_ranks)
    if target.in_bytes and planner.base.peak_bytes is None:
        note = ("limit in bytes needs activation sizes in the cost model "
                "(activation_bytes); nothing offloaded")
        return planner.finish(target, planner.schedule, planner.base, {}, (note,))
    limit = target.value + _TOLERANCE
    if target.in_bytes:
        sizes: Sequence[float] = [planner.costs.bytes_of(s) or 0.0
                                  for s in range(planner.schedule.num_stages)]
    else:
        sizes = planner.units

    def attempt(prefix: Sequence[int]) -> tuple[Outcome, tuple[float, ...]]:
        chosen = [item for r in ranks for item in planner.by_lifespan[r][: prefix[r]]]
        outcome = planner.plan(chosen, keep_changes=True)  # the estimate reads them
        result = outcome[1]
        peaks = result.peak_bytes if target.in_bytes else result.peak_activation
        assert peaks is not None
        return outcome, peaks

    full = [len(planner.by_lifespan[r]) for r in ranks]
    prefix, lo, hi = list(full), [0] * len(full), list(full)
    outcome, got = attempt(prefix)
    reachable = [got[r] <= limit for r in ranks]
    guided = list(reachable)  # probe the estimate (until one misses in its own plan)
    aim = list(full)
    foreseen: list[float | None] = [None] * len(full)  # the estimate's peak at ``aim``
    best: Outcome | None = None  # the plan of the final ``hi``
    peaks = got
    while True:
        for r in ranks:
            if not reachable[r] or lo[r] >= hi[r]:
                continue
            if got[r] > limit:
                lo[r], guided[r] = prefix[r] + 1, False
                continue
            hi[r] = prefix[r]
            if not guided[r]:
                continue
            if _close(got[r], foreseen[r]):  # the timeline that said one item fewer would
                lo[r] = hi[r]                # miss foresaw this peak exactly: found
                continue
            aim[r], foreseen[r] = _estimate(outcome, r, planner, sizes, lo[r], limit)
            if aim[r] == hi[r]:  # by this plan's own timeline one item fewer would miss
                lo[r] = hi[r]
        searching = any(reachable[r] and lo[r] < hi[r] for r in ranks)
        if prefix == hi and not searching:
            best, peaks = outcome, got
        del outcome  # a plan is large (~1 GB at p = 64, m = 1024, v = 4): one at a time
        if not searching:
            break
        prefix = [hi[r] if not reachable[r] or lo[r] >= hi[r] else
                  aim[r] if guided[r] else (lo[r] + hi[r]) // 2 for r in ranks]
        outcome, got = attempt(prefix)
    # A rank that met the limit in its own probe can miss it next to its neighbours' final
    # prefixes when they share its host link: it then offloads every item, as in the first
    # plan (where it met the limit), until no rank changes.
    while True:
        if best is None:
            best, peaks = attempt(hi)
        missed = [r for r in ranks if reachable[r] and peaks[r] > limit and hi[r] < full[r]]
        if not missed:
            break
        for r in missed:
            hi[r] = full[r]
        best = None
    notes = []
    unit = "bytes" if target.in_bytes else "M_a"
    for r in ranks:
        if peaks[r] > limit:
            notes.append(
                f"rank {r}: limit {target.value:g} {unit} not reachable; lowest found "
                f"{peaks[r]:.4g} {unit}: {planner.floor_reason(r)}"
            )
    return planner.finish(target, *best, tuple(notes))


def _estimate(outcome: Outcome, rank: int, planner: PrefixPlanner, sizes: Sequence[float],
              lo: int, limit: float) -> tuple[int, float]:
    """The shortest prefix of the rank's items, at least ``lo``, that meets ``limit`` by the
    rank's memory in ``outcome`` with the items the prefix leaves out held on the device from
    their F to their last backward, every action where ``outcome`` ran it (at most the
    outcome's own prefix, whose curve that is), and the peak that memory has there."""
    schedule, result, _ = outcome
    items = planner.by_lifespan[rank]
    weights, tags = _tagged_changes(schedule, result, rank, items, sizes)
    return _shortest_prefix(weights, tags, lo, len(items), limit)


def _close(peak: float, foreseen: float | None) -> bool:
    return foreseen is not None and abs(peak - foreseen) <= _TOLERANCE * max(1.0, abs(peak))


def _shortest_prefix(weights: Sequence[float], tags: Sequence[int], lo: int, hi: int,
                     limit: float) -> tuple[int, float]:
    """The least k in [lo, hi] whose peak meets ``limit``, else hi, and that peak: the peak of
    the curve of the changes left when those tagged below k (the first k items' not being
    offloaded) are left out. The peak falls as k grows: each tagged group only adds memory.

    Bisection; which changes count at k is kept in a bytearray that each step updates where
    the tags between the old and the new k are (found by bisection in the changes tagged below
    hi, sorted by tag), instead of comparing every tag again."""
    below = [i for i, tag in enumerate(tags) if tag < hi]
    below.sort(key=tags.__getitem__)  # by tag, then by place
    below_tags = list(map(tags.__getitem__, below))
    # The weights side by side in memory: each step reads them all, and floats scattered
    # over a large heap (a plan at p = 64, m = 1024) cost a cache miss each.
    values = array("d", weights)
    counted = bytearray(b"\x01") * len(tags)  # at k = 0 every change counts
    k = 0
    peaks: dict[int, float] = {}

    def peak_at(mid: int) -> float:
        nonlocal k
        flag = 0 if mid > k else 1  # left out (k rising) or counted again (k falling)
        for j in below[bisect_left(below_tags, min(k, mid)):
                       bisect_left(below_tags, max(k, mid))]:
            counted[j] = flag
        k = mid
        peaks[mid] = max(accumulate(compress(values, counted), initial=0.0))
        return peaks[mid]

    while lo < hi:
        mid = (lo + hi) // 2
        if peak_at(mid) <= limit:
            hi = mid
        else:
            lo = mid + 1
    return hi, peaks[hi] if hi in peaks else peak_at(hi)


def _tagged_changes(schedule: Schedule, result: SimResult, rank: int, items: Sequence[Item],
                    sizes: Sequence[float]) -> tuple[list[float], list[int]]:
    """The rank's memory changes in ``result`` (tagged ``len(items)``: always counted) and, for
    each offloaded item at index i of ``items``, the changes that keep it on the device from its
    F to its last backward instead (tagged i: counted while i is outside the prefix), in order.

    The untagged changes are the simulation's own (``SimResult.memory_changes``: sim/memory.py's
    rule, notes [memory accounting] and [streaming offload]). Each tagged change cancels one of
    the item's (its twin): the share of the F's activation that streams out, from the F's start
    to the copy out's end; the copy back; or, where nothing is copied back (a fetched item,
    which frees nothing when its last pass ends), the free at that end. It has its twin's time
    position and role, and goes right before it when its weight is not larger, else right
    after: the order a sort by (time, position, role, weight, tag) gives, so a cancelled pair
    never shows as a spike (tests/test_offload_limit_exact.py holds the two equal). Changes are
    read back to their actions by position (sim/memory.py ``Change``). Assumes what validate
    checks: each item has one I or one B, and one W or B.
    """
    actions = schedule.ranks[rank]
    kinds = list(map(_KIND, actions))
    offloaded = items_of(actions, kinds, _OFFLOAD)
    tag_of = {item: tag for tag, item in enumerate(items) if item in offloaded}
    reloaded = items_of(actions, kinds, _RELOAD)
    changes = result.memory_changes(rank)
    # Offloaded, fetched: held until its last pass ends while it is not offloaded, but it
    # frees nothing there (no change to cancel): its tagged free comes alone.
    fetched = items_of(actions, kinds, _FETCH)
    held = (fetched & tag_of.keys()) - reloaded
    if held:
        end = result.rank_times(rank)[1]
        alone = [(end[i], i, _END, s, -1.0) for i, (s, kind, m) in enumerate(actions)
                 if kind in _LAST_PASS and (s, m) in held]
        if alone:
            changes = sorted(changes + alone)
    always = len(items)
    weights: list[float] = []
    tags: list[int] = []
    weigh, tag_as = weights.append, tags.append
    for _, i, role, s, factor in changes:  # i: the position of the action that made it
        weight = sizes[s] * factor
        tag = tag_of.get((s, actions[i][2])) if tag_of else None
        if tag is None:
            weigh(weight)
            tag_as(always)
            continue
        size = sizes[s]
        if role is _START:  # its F starts: the share that streams out stays
            if kinds[i] is not _F:  # a RECOMPUTE: nothing to cancel
                weigh(weight)
                tag_as(always)
                continue
            twin = size * (1.0 - factor)
        elif role is _COPY_OUT_END:  # what it freed stays
            twin = size * -factor
        elif role is _COPY_BACK:  # nothing to allocate, it stayed
            twin = -size
        else:  # its last pass ends: the free of what stayed, after the plain one if any
            item = (s, actions[i][2])
            if item in reloaded:
                weigh(weight)
                tag_as(always)
            elif item in fetched:
                weigh(weight)
                tag_as(tag)
            else:
                weights += (weight, weight)
                tags += (always, tag)
            continue
        if twin <= weight:
            weights += (twin, weight)
            tags += (tag, always)
        else:
            weights += (weight, twin)
            tags += (always, tag)
    return weights, tags
