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
from operator import itemgetter
from typing import TYPE_CHECKING

from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.schedule import Schedule
from pipeoffload.offload.report import OffloadPlan
from pipeoffload.offload.select import Item
from pipeoffload.offload.targets import OffloadTarget
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.memory import streamed_fraction
from pipeoffload.sim.simulator import SimResult, TimedAction

if TYPE_CHECKING:
    from pipeoffload.offload.plan import _Planner

Outcome = tuple[Schedule, SimResult, dict[Item, str]]
_TOLERANCE = 1e-9  # a peak this far above the limit still meets it (float sums)
_WEIGHT, _TAG = itemgetter(3), itemgetter(4)  # of a (time, order, place, weight, tag) change

# The kinds as module names (Note: [hot loops], core/actions.py).
_F, _I, _W, _B = Kind.F, Kind.I, Kind.W, Kind.B
_OFFLOAD, _RELOAD, _FETCH, _RECOMPUTE = Kind.OFFLOAD, Kind.RELOAD, Kind.FETCH, Kind.RECOMPUTE


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
    return _shortest_prefix(weights, tags, lo, len(items), limit)


def _close(peak: float, foreseen: float | None) -> bool:
    return foreseen is not None and abs(peak - foreseen) <= _TOLERANCE * max(1.0, abs(peak))


def _shortest_prefix(weights: Sequence[float], tags: Sequence[int], lo: int, hi: int,
                     limit: float) -> tuple[int, float]:
    """The least k in [lo, hi] whose peak meets ``limit``, else hi, and that peak: the peak of
    the curve of the changes left when those tagged below k (the first k items' not being
    offloaded) are left out. The peak falls as k grows: each tagged group only adds memory.

    Bisection; which changes count at k is kept in a bytearray that each step updates where
    the tags between the old and the new k are, instead of comparing every tag again."""
    at_tag: dict[int, list[int]] = {}  # tag -> where its changes are (tags < hi only)
    for j, tag in enumerate(tags):
        if tag < hi:
            at_tag.setdefault(tag, []).append(j)
    counted = bytearray(b"\x01") * len(tags)  # at k = 0 every change counts
    k = 0
    peaks: dict[int, float] = {}

    def peak_at(mid: int) -> float:
        nonlocal k
        step = 1 if mid > k else 0  # left out (k rising) or counted again (k falling)
        for tag in range(min(k, mid), max(k, mid)):
            for j in at_tag.get(tag, ()):
                counted[j] = 1 - step
        k = mid
        peaks[mid] = max(accumulate(compress(weights, counted), initial=0.0))
        return peaks[mid]

    while lo < hi:
        mid = (lo + hi) // 2
        if peak_at(mid) <= limit:
            hi = mid
        else:
            lo = mid + 1
    return hi, peaks[hi] if hi in peaks else peak_at(hi)


def _tagged_changes(schedule: Schedule, result: SimResult, rank: int, items: Sequence[Item],
                    sizes: Sequence[float], costs: CostModel) -> tuple[list[float], list[int]]:
    """The rank's memory changes in ``result`` (tagged ``len(items)``: always counted) and, for
    each offloaded item at index i of ``items``, the changes that keep it on the device from its
    F to its last backward instead (tagged i: counted while i is outside the prefix), ordered as
    sim/memory.py orders them (by time, then program order).

    The untagged changes are sim/memory.py's ``memory_changes`` (its notes [memory accounting]
    and [streaming offload]), made here in the one read of the timeline that also finds the
    tagged ones (tests/test_offload_limit_exact.py holds them to ``memory_changes``). Each
    tagged change but a fetched item's free has the time and order key of the change it cancels
    (its twin) and goes right before it when its weight is not larger (the order a sort by
    (time, order, weight, tag) gives: a cancelled pair never shows as a spike), else right
    after: the third key below. Assumes what validate checks: each item has one I or one B.
    Order keys are sim/memory.py's halved (action i's start i, its end i + 0.5, a copy out's
    end i + 0.25, a copy back's start j - 0.25 for its backward j): the same order.
    """
    order = _program_order(schedule, result, rank)
    always = len(items)
    freed = [-size for size in sizes]
    forwards: list[tuple[TimedAction, int]] = []  # (timing, order)
    copies: dict[Item, TimedAction] = {}
    reloads: list[TimedAction] = []
    # (time, order, place, weight, tag): the last backward passes' frees, as made here
    ends: list[tuple[float, float, int, float, int]] = []
    fetched: set[Item] = set()
    recomputes: list[tuple[float, int, int, Item]] = []
    timeline = result.timeline[rank]
    # A TimedAction is (rank, action, start, end, lane, stall); only the fields each kind
    # needs are read (the timeline is large: every object touched costs).
    for t in timeline:
        action = t[1]
        kind = action[1]
        if kind is _F:
            forwards.append((t, order[action]))
        elif kind is _W or kind is _B:
            ends.append((t[3], order[action] + 0.5, 1, freed[action[0]], always))
        elif kind is _OFFLOAD:
            copies[(action[0], action[2])] = t
        elif kind is _RELOAD:
            reloads.append(t)
        elif kind is _FETCH:
            fetched.add((action[0], action[2]))
        elif kind is _RECOMPUTE:
            recomputes.append((t[2], order[action], action[0], (action[0], action[2])))
    tag_of = {item: index for index, item in enumerate(items)}
    recomputed = {item for _, _, _, item in recomputes}
    copy_time = {s: costs.transfer_time(s, _OFFLOAD) for s in {s for s, _ in copies}}
    # The changes in four streams, each already in order (a rank's forwards, its copies out,
    # copies back and last backward passes each run in time and program order), so that the
    # sort below only merges them.
    starts: list[tuple[float, float, int, float, int]] = []
    copied: list[tuple[float, float, int, float, int]] = []
    tagged: dict[Item, int] = {}  # offloaded items of ``items`` -> their tags
    for (_, (s, _, m), start, end, _, _), at in forwards:
        item = (s, m)
        copy = copies.get(item) if copies else None
        if copy is None:
            if item not in recomputed:
                starts.append((start, at, 1, sizes[s], always))
            continue
        size = sizes[s]
        part = streamed_fraction(start, end, copy[2], copy_time[s])
        held, out = size * part, size * -part
        copy_end = copy[3]
        tag = tag_of.get(item)
        if tag is None:
            starts.append((start, at, 1, held, always))
            copied.append((copy_end, at + 0.25, 1, out, always))
            continue
        tagged[item] = tag
        kept = size * (1.0 - part)
        if kept <= held:
            starts += ((start, at, 0, kept, tag), (start, at, 1, held, always))
        else:
            starts += ((start, at, 1, held, always), (start, at, 2, kept, tag))
        if held <= out:
            copied += ((copy_end, at + 0.25, 0, held, tag), (copy_end, at + 0.25, 1, out, always))
        else:
            copied += ((copy_end, at + 0.25, 1, out, always), (copy_end, at + 0.25, 2, held, tag))
    back: list[tuple[float, float, int, float, int]] = []
    for _, action, start, _, _, _ in reloads:
        s, _, m = action
        size = sizes[s]
        # A copy back allocates right before the item's first backward pass.
        at = order.get((s, _I, m))  # type: ignore[call-overload]
        if at is None:
            at = order.get((s, _B, m), order[action])  # type: ignore[call-overload]
        tag = tagged.pop((s, m), None)
        if tag is None:
            back.append((start, at - 0.25, 1, size, always))
        elif -size <= size:
            back += ((start, at - 0.25, 0, -size, tag), (start, at - 0.25, 1, size, always))
        else:
            back += ((start, at - 0.25, 1, size, always), (start, at - 0.25, 2, -size, tag))
    if fetched or tagged:  # offloaded, not copied back: on the device until the last pass ends
        ends = _last_pass_ends(timeline, order, freed, fetched, tagged, always)
    entries = starts + copied + back + ends
    for start, at, s, _ in recomputes:
        entries.append((start, at, 1, sizes[s], always))
    entries.sort()
    return list(map(_WEIGHT, entries)), list(map(_TAG, entries))


def _last_pass_ends(timeline: Sequence[TimedAction], order: dict[Action, int],
                    freed: Sequence[float], fetched: set[Item], tagged: dict[Item, int],
                    always: int) -> list[tuple[float, float, int, float, int]]:
    """The frees at the ends of last backward passes (W, or B) where some items are fetched
    or not copied back: a fetched item frees nothing there (sim/memory.py), and each of
    ``tagged`` (offloaded, not copied back) is held until then while it is not offloaded."""
    ends = []
    for _, action, _, end, _, _ in timeline:
        s, kind, m = action
        if kind is _W or kind is _B:
            at = order[action] + 0.5
            if (s, m) not in fetched:
                ends.append((end, at, 1, freed[s], always))
            if (s, m) in tagged:
                ends.append((end, at, 2, freed[s], tagged[(s, m)]))
    return ends


def _program_order(schedule: Schedule, result: SimResult, rank: int) -> dict[Action, int]:
    """action -> a number increasing along the rank's program: the simulation's own numbering
    when it ran ``schedule`` (no dictionary to build), else the action's place."""
    program = result.program
    if program is not None and program.schedule is schedule:
        return program.index
    return {action: i for i, action in enumerate(schedule.ranks[rank])}
