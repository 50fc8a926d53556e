"""Validator and CSV round trip, as properties over the whole zoo (hypothesis)."""

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeoffload.api import build_schedule, plan_schedule, schedule_names
from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.text import parse_rows, schedule_from_rows, to_csv_text
from pipeoffload.core.validate import validate
from pipeoffload.errors import ScheduleError
from pipeoffload.offload.plan import OffloadPolicy

NAMES = [name for name, _ in schedule_names()]
V_SHAPED = {"zbv", "v-half", "v-min"}


def _schedule(name: str, pp: int, mult: int, offload_ratio: float):
    if name == "dualpipe":  # needs an even pp (half of the microbatches enter at each end)
        pp += pp % 2
    microbatches = pp * mult
    options = {}
    if name == "interleaved-1f1b" or name == "grouped-interleaved":
        options["chunks"] = 2
    return build_schedule(name, pp, microbatches, offload_ratio=offload_ratio, **options)


schedules = st.builds(
    _schedule,
    st.sampled_from(NAMES),
    st.integers(2, 5),
    st.integers(1, 3).map(lambda k: k + 1),
    st.sampled_from([0.0, 0.25]),
)
slow = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@slow
@given(schedules)
def test_zoo_is_valid_and_survives_csv_round_trip(sched):
    validate(sched)
    back = schedule_from_rows(parse_rows(to_csv_text(sched)), microbatches=sched.microbatches,
                              name=sched.name)
    assert back == sched


@slow
@given(schedules, st.data())
def test_dropped_action_is_rejected(sched, data):
    rank = data.draw(st.integers(0, sched.num_ranks - 1))
    pos = data.draw(st.integers(0, len(sched.ranks[rank]) - 1))
    ranks = [list(r) for r in sched.ranks]
    del ranks[rank][pos]
    with pytest.raises(ScheduleError):
        validate(sched.with_ranks(ranks))


@slow
@given(schedules, st.data())
def test_duplicated_action_is_rejected(sched, data):
    rank = data.draw(st.integers(0, sched.num_ranks - 1))
    src = data.draw(st.integers(0, len(sched.ranks[rank]) - 1))
    dst = data.draw(st.integers(0, len(sched.ranks[rank])))
    ranks = [list(r) for r in sched.ranks]
    ranks[rank].insert(dst, sched.ranks[rank][src])
    with pytest.raises(ScheduleError, match="appears twice"):
        validate(sched.with_ranks(ranks))


@slow
@given(schedules, st.data())
def test_action_swapped_with_its_backward_deadlocks(sched, data):
    rank = data.draw(st.integers(0, sched.num_ranks - 1))
    forwards = [i for i, a in enumerate(sched.ranks[rank]) if a.kind is Kind.F]
    i = data.draw(st.sampled_from(forwards))
    f = sched.ranks[rank][i]
    j = next(k for k, a in enumerate(sched.ranks[rank])
             if a.kind in (Kind.B, Kind.I) and (a.stage, a.microbatch) == (f.stage, f.microbatch))
    ranks = [list(r) for r in sched.ranks]
    ranks[rank][i], ranks[rank][j] = ranks[rank][j], ranks[rank][i]
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(sched.with_ranks(ranks))


@slow
@given(schedules, st.data())
def test_actions_swapped_across_ranks_are_misplaced(sched, data):
    r1, r2 = data.draw(st.lists(st.integers(0, sched.num_ranks - 1), min_size=2, max_size=2,
                                unique=True))
    i = data.draw(st.integers(0, len(sched.ranks[r1]) - 1))
    j = data.draw(st.integers(0, len(sched.ranks[r2]) - 1))
    ranks = [list(r) for r in sched.ranks]
    ranks[r1][i], ranks[r2][j] = ranks[r2][j], ranks[r1][i]
    with pytest.raises(ScheduleError, match="lives on rank"):
        validate(sched.with_ranks(ranks))


def test_error_shows_the_grid_with_the_position_marked():
    sched = build_schedule("1f1b", 2, 2)
    ranks = [list(r) for r in sched.ranks]
    ranks[1].append(ranks[1][0])
    with pytest.raises(ScheduleError) as info:
        validate(sched.with_ranks(ranks))
    err = info.value
    assert (err.rank, err.position) == (1, len(ranks[1]) - 1)
    assert "<-- ERROR HERE" in str(err)
    assert f">{ranks[1][0]}<" in str(err)


def test_missing_reload_is_named():
    sched = build_schedule("1f1b", 2, 4, offload="all")
    assert sched.has_kind(Kind.RELOAD), "1f1b rank 0 has long-lived activations to offload"
    ranks = [[a for a in r if a.kind is not Kind.RELOAD] for r in sched.ranks]
    with pytest.raises(ScheduleError, match="has no matching RELOAD"):
        validate(sched.with_ranks(ranks))


def test_every_name_builds_at_a_common_size():
    for name in NAMES:
        pp = 4
        sched = _schedule(name, pp, 2, 0.0)
        assert sched.num_ranks == pp
        assert math.isclose(len(sched.stage_to_rank) / pp, sched.chunks)


def test_fetch_comes_back_instead_of_reload_and_is_checked_like_it():
    sched = plan_schedule("zbv", 2, 4, "all", policy=OffloadPolicy(fetch_on_use=True)).schedule
    assert sched.has_kind(Kind.FETCH)
    validate(sched)
    again = schedule_from_rows(parse_rows(to_csv_text(sched), "fetch.csv"))
    assert again.ranks == sched.ranks
    fetch = next(a for r in sched.ranks for a in r if a.kind is Kind.FETCH)
    rank = sched.rank_of(fetch.stage)
    without_offload = [[a for a in r if a != Action(fetch.stage, Kind.OFFLOAD, fetch.microbatch)]
                       for r in sched.ranks]
    with pytest.raises(ScheduleError, match="has no matching OFFLOAD"):
        validate(sched.with_ranks(without_offload))
    with_both = [list(r) for r in sched.ranks]
    with_both[rank].insert(with_both[rank].index(fetch),
                           Action(fetch.stage, Kind.RELOAD, fetch.microbatch))
    with pytest.raises(ScheduleError, match="RELOAD or by FETCH, not both"):
        validate(sched.with_ranks(with_both))
    # A FETCH after the backward it serves: the backward waits for it forever.
    late = [list(r) for r in sched.ranks]
    late[rank].remove(fetch)
    late[rank].append(fetch)
    with pytest.raises(ScheduleError, match=f"waits for {fetch}"):
        validate(sched.with_ranks(late))
