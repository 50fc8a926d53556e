"""DualPipe and DualPipeV as data: torch's order, the two routes, DeepSeek-V3's Table 2, the
overlapped pair's timing, and offload planned into them (pure core; torch only to compare)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeoffload.core.actions import Action, Kind, parse_cell
from pipeoffload.core.families.dualpipe import twin_stage
from pipeoffload.core.registry import build_schedule
from pipeoffload.core.schedule import Placement, Schedule, v_placement
from pipeoffload.core.text import parse_rows, schedule_from_rows, to_csv_text
from pipeoffload.core.validate import validate
from pipeoffload.errors import ConfigError, ParseError, ScheduleError
from pipeoffload.offload.plan import add_offload
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.render_text import render_grid
from pipeoffload.sim.render_trace import to_chrome_trace
from pipeoffload.sim.simulator import simulate


def torch_dualpipev(pp: int, microbatches: int) -> list[list[Action]]:
    """torch's ScheduleDualPipeV order, read through our CSV cell parser."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = getattr(schedules, "ScheduleDualPipeV", None)
    if cls is None:
        pytest.skip("this torch has no ScheduleDualPipeV")
    order = cls.__new__(cls)
    order.pp_group_size, order._n_microbatches = pp, microbatches
    return [[a for item in order._calculate_single_rank_operations(r)
             for a in parse_cell(str(item))] for r in range(pp)]


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (3, 7), (4, 8), (4, 11), (5, 13), (8, 16)])
def test_dualpipev_is_torchs_order(pp: int, m: int) -> None:
    ours = build_schedule("dualpipev", pp, m)
    assert [list(r) for r in ours.ranks] == torch_dualpipev(pp, m)
    assert ours.placement is Placement.V and not ours.routes


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 10), (6, 12), (8, 32)])
def test_dualpipe_runs_half_the_microbatches_each_way_and_ranks_mirror(pp: int, m: int) -> None:
    sched = build_schedule("dualpipe", pp, m)
    assert sched.stage_to_rank == v_placement(pp)
    assert sched.routes == (tuple(range(pp)), tuple(range(pp, 2 * pp)))
    for mb in range(m):
        stages = {a.stage for _, _, a in sched.actions if a.microbatch == mb and a.kind is Kind.F}
        assert stages == set(range(pp) if mb < m // 2 else range(pp, 2 * pp))
    # Rank p-1-r runs rank r's program with the directions swapped.
    half = m // 2
    for r in range(pp):
        mirrored = [Action(twin_stage(pp, a.stage), a.kind, (a.microbatch + half) % m)
                    for a in sched.ranks[r]]
        assert mirrored == list(sched.ranks[pp - 1 - r])


@pytest.mark.parametrize("pp", [4, 8, 16])
def test_dualpipe_reproduces_deepseek_table2_bubble_and_activation(pp: int) -> None:
    """Table 2: bubble (PP/2-1)(F&B+B-3W), activation PP+1 chunks, with F&B = F+B timed as
    DeepSeek's executor runs a pair (overlap_f_b=0) and F = I = W = 1 (B = I + W = 2)."""
    sched = build_schedule("dualpipe", pp, 4 * pp)
    paired = simulate(sched, CostModel(overlap_f_b=0.0))
    bubble = (pp / 2 - 1) * (1 + 2 + 2 - 3 * 1)
    assert [paired.makespan - busy for busy in paired.compute_time] == [bubble] * pp
    assert paired.peak_activation == ((pp + 1) / 2,) * pp  # PP+1 chunks; 2 chunks per M_a
    # Our runtime runs each pair back to back: the F's output leaves before the B, never later.
    ours = simulate(sched)
    assert ours.makespan <= paired.makespan
    assert ours.peak_activation == paired.peak_activation


@settings(max_examples=25, deadline=None)
@given(half_pp=st.integers(1, 6), per_rank=st.integers(2, 6), extra=st.integers(0, 5))
def test_table2_holds_at_every_even_shape(half_pp: int, per_rank: int, extra: int) -> None:
    pp = 2 * half_pp
    m = pp * per_rank + 2 * extra
    result = simulate(build_schedule("dualpipe", pp, m), CostModel(overlap_f_b=0.0))
    assert {result.makespan - busy for busy in result.compute_time} == {(pp / 2 - 1) * 2}
    assert set(result.peak_activation) == {(pp + 1) / 2}


@settings(max_examples=15, deadline=None)
@given(pp=st.integers(2, 8), extra=st.integers(0, 16))
def test_dualpipev_has_zbvs_makespan_and_half_a_microbatch_more(pp: int, extra: int) -> None:
    m = 2 * pp + extra
    ours, zbv = (simulate(build_schedule(n, pp, m)) for n in ("dualpipev", "zbv"))
    assert ours.makespan == zbv.makespan
    assert set(ours.peak_activation) == {pp + 0.5}


def test_pictures_draw_the_pairs_back_to_back() -> None:
    result = simulate(build_schedule("dualpipe", 4, 8), CostModel(overlap_f_b=0.5))
    grid = render_grid(result, width=120)
    assert grid.count("rank ") >= 4
    events = [e for e in to_chrome_trace(result)["traceEvents"] if e.get("ph") == "X"]
    assert {e["args"]["action"] for e in events} >= {"0F0", "7B5", "3B1"}
    shortened = [t for rank in result.timeline for t in rank
                 if t.action.kind is Kind.F and t.end - t.start < 1]
    assert shortened  # the pairs' forwards, at (1 + 2 - 0.5) / 3 of their time
    for rank in result.timeline:  # a compute lane never runs two things at once
        compute = sorted((t.start, t.end) for t in rank if t.lane.value == "compute")
        assert all(a_end <= b_start + 1e-9 for (_, a_end), (b_start, _) in
                   zip(compute, compute[1:]))


def test_overlap_shortens_pairs_only() -> None:
    dual = build_schedule("dualpipe", 8, 32)
    times = [simulate(dual, CostModel(overlap_f_b=x)).makespan for x in (0.0, 0.5, 1.0)]
    assert times[0] > times[1] > times[2]
    # 1F1B: an F is followed by its own microbatch's B (last rank) or by one whose gradient is
    # still on its way, so nothing pairs; GPipe's last rank pairs its last F with B of mb 0.
    one_f_one_b = build_schedule("1f1b", 4, 8)
    assert simulate(one_f_one_b, CostModel(overlap_f_b=1.0)).timeline == \
        simulate(one_f_one_b).timeline
    gpipe = build_schedule("gpipe", 4, 8)
    assert simulate(gpipe, CostModel(overlap_f_b=1.0)).makespan < simulate(gpipe).makespan
    with pytest.raises(ConfigError, match="overlap_f_b"):
        CostModel(overlap_f_b=1.5)


def test_a_microbatch_off_its_route_is_rejected() -> None:
    sched = build_schedule("dualpipe", 4, 8)
    ranks = [list(r) for r in sched.ranks]
    position = ranks[0].index(Action(0, Kind.F, 0))
    ranks[0][position] = Action(0, Kind.F, 7)  # microbatch 7 enters at rank 3, not rank 0
    with pytest.raises(ScheduleError, match="runs through stages 4..7 only"):
        validate(sched.with_ranks(ranks))


@pytest.mark.parametrize("routes", [((0, 1), (3, 2)), ((0,), (1, 2)), ((1, 0), (2, 3))])
def test_routes_must_split_the_stages_into_runs(routes) -> None:
    rows = build_schedule("dualpipe", 2, 4).ranks
    with pytest.raises(ScheduleError, match="consecutive runs"):
        Schedule(rows, v_placement(2), 4, routes=routes)


def test_cli_simulates_torchs_dualpipev_csv_like_ours(tmp_path, capsys) -> None:
    import json

    from pipeoffload.cli.main import main

    rows = torch_dualpipev(4, 8)  # skips without torch's class
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    order = schedules.ScheduleDualPipeV.__new__(schedules.ScheduleDualPipeV)
    order.pp_group_size, order._n_microbatches = 4, 8
    order.pipeline_order = {r: order._calculate_single_rank_operations(r) for r in range(4)}
    path = tmp_path / "torch_dualpipev.csv"
    order._dump_csv(str(path), format="compute_only")
    assert "OVERLAP_F_B" in path.read_text()
    assert main(["simulate", "--from-csv", str(path), "--json"]) == 0
    loaded = json.loads(capsys.readouterr().out)
    ours = simulate(build_schedule("dualpipev", 4, 8))
    assert rows == [list(r) for r in ours.schedule.ranks]
    assert (loaded["makespan"], loaded["peak_activation"]) == (ours.makespan,
                                                               list(ours.peak_activation))


def test_csv_keeps_the_routes_and_reads_torchs_overlap_cells() -> None:
    sched = build_schedule("dualpipe", 4, 8)
    back = schedule_from_rows(parse_rows(to_csv_text(sched)), name="dualpipe")
    assert back == sched
    # torch writes an overlapped pair as one cell; it reads as the two passes, in order.
    assert parse_cell("(0F7;7B3)OVERLAP_F_B") == [Action(0, Kind.F, 7), Action(7, Kind.B, 3)]
    with pytest.raises(ParseError, match="0X1"):
        parse_rows("(0F7;0X1)OVERLAP_F_B\n")


@pytest.mark.parametrize(("name", "pp", "m", "match"), [
    ("dualpipe", 3, 6, "even pp"), ("dualpipe", 4, 9, "even microbatches"),
    ("dualpipe", 4, 6, r">= 2 \* pp"), ("dualpipev", 4, 7, r"microbatches >= 2 \* pp = 8"),
    ("dualpipe", 4, 8, "exactly 2 stage"),
])
def test_impossible_settings_say_what_to_change(name: str, pp: int, m: int, match: str) -> None:
    options = {"chunks": 3} if match == "exactly 2 stage" else {}
    with pytest.raises(ConfigError, match=match):
        build_schedule(name, pp, m, **options)


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
def test_offload_all_halves_the_peak_at_ratio_quarter_without_slowing(name: str) -> None:
    bare = build_schedule(name, 8, 32)
    plan = add_offload(bare, CostModel(offload_ratio=0.25), "all")
    validate(plan.schedule)
    report = plan.report
    assert max(report.peak_after) <= max(report.peak_before) / 2
    assert report.makespan_after == report.makespan_before
    assert sum(report.stall_time) == 0


def test_the_planner_refuses_dualpipe_and_names_dualpipev() -> None:
    from pipeoffload.planner.search import SearchSpace

    with pytest.raises(ConfigError, match="search dualpipev"):
        SearchSpace(schedules=("zbv", "dualpipe"))
    assert SearchSpace(schedules=("dualpipev",)).schedules == ("dualpipev",)
