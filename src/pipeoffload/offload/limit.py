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

from collections.abc import Sequence
from itertools import accumulate, compress
from typing import TYPE_CHECKING

from pipeoffload.core.actions import Kind
from pipeoffload.core.schedule import Schedule
from pipeoffload.offload.report import OffloadPlan
from pipeoffload.offload.select import Item
from pipeoffload.offload.targets import OffloadTarget
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.memory import Change, memory_changes, streamed_fraction
from pipeoffload.sim.simulator import SimResult

if TYPE_CHECKING:
    from pipeoffload.offload.plan import _Planner

Outcome = tuple[Schedule, SimResult, dict[Item, str]]
_TOLERANCE = 1e-9  # a peak this far above the limit still meets it (float sums)

# The kinds as module names (Note: [hot loops], core/actions.py).
_F, _I, _W, _B = Kind.F, Kind.I, Kind.W, Kind.B
_OFFLOAD, _RELOAD = Kind.OFFLOAD, Kind.RELOAD


def plan_limit(planner: _Planner, target: OffloadTarget) -> OffloadPlan:
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
        outcome = planner.plan(chosen)
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


def _estimate(outcome: Outcome, rank: int, planner: _Planner, sizes: Sequence[float],
              lo: int, limit: float) -> tuple[int, float]:
    """The shortest prefix of the rank's items, at least ``lo``, that meets ``limit`` by the
    rank's memory in ``outcome`` with the items the prefix leaves out held on the device from
    their F to their last backward, every action where ``outcome`` ran it (at most the
    outcome's own prefix, whose curve that is), and the peak that memory has there."""
    schedule, result, _ = outcome
    items = planner.by_lifespan[rank]
    weights, tags = _tagged_changes(schedule, result, rank, items, sizes, planner.costs)
    k = _shortest_prefix(weights, tags, lo, len(items), limit)
    return k, _peak(weights, tags, k)


def _close(peak: float, foreseen: float | None) -> bool:
    return foreseen is not None and abs(peak - foreseen) <= _TOLERANCE * max(1.0, abs(peak))


def _shortest_prefix(weights: Sequence[float], tags: Sequence[int], lo: int, hi: int,
                     limit: float) -> int:
    """The least k in [lo, hi] whose ``_peak`` meets ``limit``, else hi (the peak falls as k
    grows: each tagged group of changes only adds memory)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if _peak(weights, tags, mid) <= limit:
            hi = mid
        else:
            lo = mid + 1
    return hi


def _peak(weights: Sequence[float], tags: Sequence[int], k: int) -> float:
    """The curve's peak when the changes tagged below ``k`` (those of the first k items' not
    being offloaded) are left out."""
    return max(accumulate(compress(weights, map(k.__le__, tags)), initial=0.0))


def _tagged_changes(schedule: Schedule, result: SimResult, rank: int, items: Sequence[Item],
                    sizes: Sequence[float], costs: CostModel) -> tuple[list[float], list[int]]:
    """The rank's memory changes in ``result`` (tagged ``len(items)``: always counted) and, for
    each offloaded item at index i of ``items``, the changes that keep it on the device from its
    F to its last backward instead (tagged i: counted while i is outside the prefix), ordered as
    sim/memory.py orders them (by time, then program order)."""
    timeline = result.timeline[rank]
    forward, copy_out, copy_back, last_pass = {}, {}, {}, {}
    for t in timeline:
        s, kind, m = t.action
        if kind is _F:
            forward[(s, m)] = t
        elif kind is _OFFLOAD:
            copy_out[(s, m)] = t
        elif kind is _RELOAD:
            copy_back[(s, m)] = t
        elif kind is _W or kind is _B:
            last_pass[(s, m)] = t
    order: dict[Item, int] = {}  # where each F is in the program
    first_backward: dict[Item, int] = {}  # where a copy back allocates
    last_order: dict[Item, int] = {}  # where the last backward pass is
    for i, (s, kind, m) in enumerate(schedule.ranks[rank]):
        if kind is _F:
            order[(s, m)] = 2 * i
        elif kind is _I:
            first_backward[(s, m)] = 2 * i
        elif kind is _B:
            first_backward.setdefault((s, m), 2 * i)
            last_order[(s, m)] = 2 * i
        elif kind is _W:
            last_order[(s, m)] = 2 * i
    # Each tagged change but a fetched item's free has the time and order key of the change it
    # cancels (its twin; sim/memory.py gives each change its own order key), so it is written
    # next to its twin instead of sorting every change again: before it when its weight is not
    # larger (the order a sort by (time, order, weight, tag) gives: a cancelled pair never
    # shows as a spike), else after it. The fetched frees have no twin; they are merged in.
    twins: dict[float, tuple[float, int]] = {}  # a twin's order key -> (weight, tag)
    alone: list[tuple[float, float, float, int]] = []
    for index, item in enumerate(items):
        copy = copy_out.get(item)
        if copy is None:
            continue
        s = item[0]
        f = forward[item]
        at = order[item]
        part = streamed_fraction(f.start, f.end, copy.start, costs.transfer_time(s, _OFFLOAD))
        size = sizes[s]
        twins[at] = (size * (1.0 - part), index)
        twins[at + 0.5] = (size * part, index)
        if item in copy_back:
            twins[first_backward[item] - 0.5] = (-size, index)
        else:  # fetched: on the device until its last backward pass ends
            alone.append((last_pass[item].end, last_order[item] + 1, -size, index))
    alone.sort()
    return _merged(memory_changes(schedule, timeline, costs), sizes, twins, alone, len(items))


def _merged(changes: Sequence[Change], sizes: Sequence[float],
            twins: dict[float, tuple[float, int]],
            alone: Sequence[tuple[float, float, float, int]], always: int
            ) -> tuple[list[float], list[int]]:
    """The weights and tags of the rank's ``changes`` (tagged ``always``), each preceded or
    followed by its tagged twin, and the sorted ``alone`` changes merged in by time and order."""
    weights: list[float] = []
    tags: list[int] = []
    weight_of, tag_of = weights.append, tags.append
    pending = iter(alone)
    next_alone = next(pending, None)
    for time, at, stage, factor in changes:
        while next_alone is not None and (next_alone[0], next_alone[1]) < (time, at):
            weight_of(next_alone[2])
            tag_of(next_alone[3])
            next_alone = next(pending, None)
        weight = sizes[stage] * factor
        twin = twins.get(at)
        if twin is not None and twin[0] <= weight:
            weight_of(twin[0])
            tag_of(twin[1])
            twin = None
        weight_of(weight)
        tag_of(always)
        if twin is not None:
            weight_of(twin[0])
            tag_of(twin[1])
    while next_alone is not None:
        weight_of(next_alone[2])
        tag_of(next_alone[3])
        next_alone = next(pending, None)
    return weights, tags
