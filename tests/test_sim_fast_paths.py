"""The simulator's fast paths give what the rules they stand for give, over the zoo (hypothesis):
- core/deps.py numbers dependencies from per-kind lists (``_dense_needs``) where the schedule's
  stages and microbatches are in range, else by asking ``Dependencies.keys_of`` per action:
  both must name the same dependencies, on valid schedules and on broken ones;
- validate checks each (stage, microbatch)'s kinds in a list of masks where pairs are dense,
  else in a dict of the pairs present: both must reject alike; and it first tries C-level
  passes over whole ranks (placement, then one count per kind), which must accept exactly
  what the per-action checks accept;
- the simulator reads memory changes off its own arrays (``rank_changes``) and sums compute
  as it places it: both must equal what ``memory_changes`` and the sorted timeline give, and
  so must the changes a result makes again or keeps (``SimResult.memory_changes``); the
  timeline is made from the run's record only when read, and each action's start, end and
  wait by program position, and the kinds picked out by it (what the offload planner reads
  instead), must be the timeline's.
"""

from __future__ import annotations

import hashlib
import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeoffload.api import build_schedule, plan_schedule, schedule_names
from pipeoffload.core.actions import MARKER_KINDS, Action, Kind
from pipeoffload.core.deps import Dependencies, _dense_needs, number
from pipeoffload.core.schedule import Schedule
from pipeoffload.core.validate import (
    _check_counts,
    _check_dense_counts,
    _check_indices_and_placement,
    _check_progress,
    _check_sparse_counts,
    _placed_plainly,
    validate,
)
from pipeoffload.errors import ScheduleError
from pipeoffload.offload.plan import OffloadPolicy
from pipeoffload.offload.recompute import add_recompute
from pipeoffload.offload.targets import parse_target
from pipeoffload.runtime.lowering import with_comms
from pipeoffload.sim.costs import CostModel, Duplex, HostLink
from pipeoffload.sim.memory import curve, memory_changes, rank_times
from pipeoffload.sim.simulator import activation_units, simulate

NAMES = [name for name, _ in schedule_names()]
slow = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _build(name: str, pp: int, mult: int) -> Schedule:
    pp += pp % 2 if name == "dualpipe" else 0  # half of the microbatches enter at each end
    options = {"chunks": 2} if name in ("interleaved-1f1b", "grouped-interleaved") else {}
    return build_schedule(name, pp, pp * mult, **options)


schedules = st.builds(_build, st.sampled_from(NAMES), st.integers(2, 5), st.integers(2, 3))
costs = st.builds(
    CostModel,
    f_time=st.sampled_from([0.0, 1.0, 1.5]),
    i_time=st.sampled_from([1.0, 2.0]),
    w_time=st.sampled_from([0.0, 1.0]),
    p2p_time=st.sampled_from([0.0, 0.25]),
    offload_ratio=st.sampled_from([0.3, 1.0, 2.5]),
    activation_bytes=st.sampled_from([None, 3e6]),
    host_link=st.builds(HostLink, st.sampled_from(list(Duplex)), st.integers(1, 2)),
    overlap_f_b=st.sampled_from([None, 0.5]),
)


def _keys_of_needs(schedule: Schedule) -> list[list[int]]:
    """Dependencies by the rule itself, one ``keys_of`` per action."""
    actions = list(itertools.chain.from_iterable(schedule.ranks))
    index = {a: i for i, a in enumerate(actions)}
    keys_of = Dependencies(schedule, present=index).keys_of
    return [[index.get(key, len(actions)) for key in keys_of(a)] for a in actions]


def _variants(schedule: Schedule, data: st.DataObject) -> list[Schedule]:
    """The schedule bare, offloaded (RELOAD and FETCH, with waits), recomputed, recomputed
    and offloaded, each with explicit SEND / RECV, and broken: an action dropped, one moved to
    another rank, one renamed out of range. (DualPipe's schedules add routes to each.)"""
    planned = [plan_schedule(schedule.name, schedule.num_ranks, schedule.microbatches, target,
                             costs=CostModel(offload_ratio=0.5),
                             policy=OffloadPolicy(fetch_on_use=fetch),
                             **_options(schedule)).schedule
               for target, fetch in (("all", False), ("all", True),
                                     ("recompute-chunks:1+all", data.draw(st.booleans())))]
    offloaded = planned[data.draw(st.integers(0, 1))]
    recomputed = add_recompute(schedule, target="fraction:0.5").schedule
    out = [schedule, *planned, recomputed]
    out += [with_comms(variant) for variant in out]
    rows = [list(actions) for actions in offloaded.ranks]
    rank = data.draw(st.integers(0, len(rows) - 1))
    position = data.draw(st.integers(0, len(rows[rank]) - 1))
    dropped = [list(r) for r in rows]
    del dropped[rank][position]
    moved = [list(r) for r in rows]
    moved[(rank + 1) % len(rows)].insert(0, moved[rank].pop(position))
    stage, kind, mb = rows[rank][position]
    renamed = [list(r) for r in rows]
    renamed[rank][position] = Action(stage, kind, mb + schedule.microbatches)
    out += [offloaded.with_ranks(r) for r in (dropped, moved, renamed)]
    return out


def _options(schedule: Schedule) -> dict[str, int]:
    if schedule.name in ("interleaved-1f1b", "grouped-interleaved"):
        return {"chunks": schedule.num_stages // schedule.num_ranks}
    return {}


@slow
@given(schedules, st.data())
def test_dense_numbering_names_the_dependencies_keys_of_names(schedule, data):
    for variant in _variants(schedule, data):
        numbered = number(variant)
        if numbered.repeated:
            continue
        assert numbered.needs == _keys_of_needs(variant), variant.name
        actions = list(itertools.chain.from_iterable(variant.ranks))
        dense = _dense_needs(variant, actions)
        assert dense is None or dense == numbered.needs


def test_dense_numbering_steps_aside_where_it_does_not_apply():
    base = build_schedule("1f1b", 2, 2)
    far = Action(0, Kind.F, 7)  # microbatch out of range: the per-kind lists would not hold it
    broken = base.with_ranks([[*base.ranks[0], far], list(base.ranks[1])])
    assert _dense_needs(broken, list(itertools.chain.from_iterable(broken.ranks))) is None
    assert number(broken).needs == _keys_of_needs(broken)


@slow
@given(schedules, costs, st.sampled_from(["all", "limit:1", "fraction:0.5"]), st.booleans())
def test_simulated_memory_and_compute_equal_the_timeline_accounting(schedule, cost, target,
                                                                   fetch):
    plan = plan_schedule(schedule.name, schedule.num_ranks, schedule.microbatches, target,
                         costs=cost, policy=OffloadPolicy(fetch_on_use=fetch),
                         **_options(schedule))
    for planned in (plan.schedule, add_recompute(schedule, cost, "fraction:0.5").schedule):
        result = simulate(planned, cost)
        kept = simulate(planned, cost, keep_changes=True)
        units = activation_units(planned, cost)
        for rank, timeline in enumerate(result.timeline):
            changes = memory_changes(planned, timeline, cost)
            # The result's own changes, made again from its arrays or kept, are these.
            assert result.memory_changes(rank) == kept.memory_changes(rank) == changes
            # As the timeline has them (a FETCH marker's position holds one of its reads there,
            # its own times in the run: no reader looks at it).
            read = [k is not Kind.FETCH for _, k, _ in planned.ranks[rank]]
            for run_times, timeline_times in zip(result.rank_times(rank),
                                                 rank_times(planned.ranks[rank], timeline)):
                assert list(itertools.compress(run_times, read)) == \
                    list(itertools.compress(timeline_times, read))
            # So are the kinds the offload passes pick out by position (SimResult.kind_times).
            timed = {t.action: t for t in timeline if t.action.kind is not Kind.FETCH}
            for kind, (picked, starts, ends) in zip(
                    (Kind.F, Kind.OFFLOAD, Kind.W, Kind.B),
                    result.kind_times(rank, Kind.F, Kind.OFFLOAD, Kind.W, Kind.B)):
                assert picked == [a for a in planned.ranks[rank] if a.kind is kind]
                assert starts == [timed[a].start for a in picked]
                assert ends == [timed[a].end for a in picked]
            # So are the waits the planner reads by position (offload/placement.py Timing).
            stalls = {t.action: t.stall for t in timeline if t.action.kind is not Kind.FETCH}
            assert list(itertools.compress(result.rank_waits(rank), read)) == \
                [stalls[action] for action in itertools.compress(planned.ranks[rank], read)]
            points, top = curve(changes, units)
            assert result.memory[rank] == points
            assert result.peak_activation[rank] == top
            compute = sum([t.end - t.start for t in timeline
                           if t.action.kind in (Kind.F, Kind.I, Kind.W, Kind.B)])
            assert result.compute_time[rank] == compute


def test_dense_numbering_never_allocates_for_declared_but_absent_microbatches():
    base = build_schedule("1f1b", 2, 2)
    huge = Schedule(base.ranks, base.stage_to_rank, 10**13)  # a CSV may declare this many
    assert _dense_needs(huge, list(itertools.chain.from_iterable(huge.ranks))) is None
    assert number(huge).needs == _keys_of_needs(huge)


@slow
@given(schedules, st.data())
def test_dense_and_sparse_count_checks_reject_alike(schedule, data):
    """validate's per-pair checks by a list of masks and by a dict of the pairs present
    accept and reject the same schedules with the same message."""
    for variant in _variants(schedule, data) + _count_breakers(schedule, data):
        try:
            _check_indices_and_placement(variant)  # what validate checks before the counts
        except ScheduleError:
            continue
        assert _outcome(_check_dense_counts, variant) == _outcome(
            lambda s: _check_sparse_counts(s, sum(map(len, s.ranks))), variant)


@slow
@given(schedules, st.data())
def test_validate_accepts_and_rejects_as_its_per_action_checks_do(schedule, data):
    """validate's whole-rank passes (``_placed_plainly``, ``_counted_plainly``) only let it skip
    the per-action checks: same verdict, same message, on valid and broken schedules."""
    for variant in _variants(schedule, data) + _count_breakers(schedule, data):
        assert _outcome(validate, variant) == _outcome(_checked_action_by_action, variant)


def _outcome(check, schedule: Schedule) -> str | None:
    """The message ``check(schedule)`` raises, or None if it passes."""
    try:
        check(schedule)
    except ScheduleError as error:
        return str(error)
    return None


def test_validate_whole_rank_pass_leaves_numbers_that_are_no_integers_to_the_checks():
    """A microbatch 1.5 is in range but names no pair: one count per kind would miss that."""
    base = build_schedule("1f1b", 2, 4)
    rows = [list(actions) for actions in base.ranks]
    stage, kind, _ = rows[0][0]
    rows[0][0] = Action(stage, kind, 1.5)
    assert _placed_plainly(base) and not _placed_plainly(base.with_ranks(rows))


def _checked_action_by_action(schedule: Schedule) -> None:
    _check_indices_and_placement(schedule)
    work = schedule.without(*MARKER_KINDS)
    _check_counts(work)
    _check_progress(work)


def _count_breakers(schedule: Schedule, data: st.DataObject) -> list[Schedule]:
    """An action repeated, one turned into another kind, and a whole microbatch dropped."""
    rows = [list(actions) for actions in schedule.ranks]
    rank = data.draw(st.integers(0, len(rows) - 1))
    position = data.draw(st.integers(0, len(rows[rank]) - 1))
    stage, _, mb = rows[rank][position]
    repeated = [list(r) for r in rows]
    repeated[rank].append(rows[rank][position])
    kind = data.draw(st.sampled_from([Kind.F, Kind.I, Kind.W, Kind.B, Kind.OFFLOAD,
                                      Kind.RELOAD, Kind.FETCH, Kind.RECOMPUTE]))
    retyped = [list(r) for r in rows]
    retyped[rank][position] = Action(stage, kind, mb)
    dropped = [[a for a in r if a.microbatch != mb] for r in rows]
    return [schedule.with_ranks(r) for r in (repeated, retyped, dropped)]


def test_dense_numbering_steps_aside_for_numbers_that_are_no_integers():
    base = build_schedule("1f1b", 2, 2)
    rows = [list(actions) for actions in base.ranks]
    rows[1] = [Action(s, kind, float(m)) for s, kind, m in rows[1]]  # 1.0 == 1 as a key
    floats = base.with_ranks(rows)
    assert _dense_needs(floats, list(itertools.chain.from_iterable(floats.ranks))) is None
    assert number(floats).needs == _keys_of_needs(floats) == number(base).needs


# The timelines and memory curves of 80 planned simulations (five families, RELOAD and FETCH,
# stalls, overlapped pairs, P2P latency), hashed by the code that made them as the run went
# (2671ad2), before the run recorded indices and the timeline was made when read: the same
# entries, times, waits and order (248 FETCH reads and 10 stalled passes among them).
TIMELINE_DIGEST = "9ba16ddb5b6d5803b11163597059aa2a60e7b28556d05c91d2a968c706fc849d"


def test_timelines_made_when_read_are_the_ones_made_as_the_run_went():
    digest = hashlib.sha256()
    reads = stalled = 0
    for name, pp, m, options in [("po-h", 4, 16, {}), ("zbv", 4, 12, {}),
                                 ("dualpipev", 4, 16, {}),
                                 ("grouped-interleaved", 4, 16, {"chunks": 2}),
                                 ("1f1b", 3, 9, {})]:
        for target in ("all", "limit:1"):
            for fetch in (False, True):
                for ratio, overlap in ((0.5, None), (2.5, 0.4)):
                    cost = CostModel(offload_ratio=ratio, overlap_f_b=overlap, p2p_time=0.25)
                    result = plan_schedule(name, pp, m, parse_target(target, allow_stall=True),
                                           costs=cost, policy=OffloadPolicy(fetch_on_use=fetch),
                                           **options).result
                    rows = [(t.rank, t.action.stage, t.action.kind.value, t.action.microbatch,
                             t.start, t.end, t.lane.value, t.stall)
                            for timeline in result.timeline for t in timeline]
                    reads += sum(row[2] == "FETCH" for row in rows)
                    stalled += sum(row[7] > 0 for row in rows)
                    digest.update(repr((rows, result.memory)).encode())
    assert (reads, stalled) == (248, 10)
    assert digest.hexdigest() == TIMELINE_DIGEST
