"""Renderers of simulation results: terminal grid and table, PNG, Chrome / Perfetto trace.

Schedules are built by hand here (1F1B, a looped two-chunk GPipe, hand-inserted offload) so the
tests depend only on the core and the simulator; expected numbers come from pipeline theory
(1F1B: rank r starts at r*T_F, makespan (m+p-1)(T_F+T_B), peak p-r), not from the renderers.
"""

from __future__ import annotations

import json
import re
import sys

import pytest

from pipeoffload.core.actions import Action, B, F, I, Kind, W
from pipeoffload.core.schedule import Schedule, loop_placement
from pipeoffload.core.validate import validate
from pipeoffload.errors import ConfigError
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.render_text import render_grid, render_summary_table
from pipeoffload.sim.render_trace import (
    BYTES_COUNTER,
    LANE_TID,
    MEMORY_COUNTER,
    to_chrome_trace,
    write_trace,
)
from pipeoffload.sim.simulator import Lane, SimResult, simulate

OFFLOAD_COSTS = CostModel(offload_ratio=0.25)
ANSI = re.compile(r"\x1b\[[0-9;]*m")
LABEL = re.compile(r"(?:\d+)?([FIWBRfiwbr])(\d+)")
TRANSFER_LABEL = re.compile(r"([or])(\d+)")


def one_f_one_b(pp: int, m: int, split: bool = False) -> Schedule:
    """1F1B: rank r runs pp-1-r warm-up forwards, then alternates F and backward."""
    ranks = []
    for r in range(pp):
        def backward(mb: int, r: int = r) -> list[Action]:
            return [I(r, mb), W(r, mb)] if split else [B(r, mb)]

        acts: list[Action] = [F(r, mb) for mb in range(min(pp - 1 - r, m))]
        f, b = len(acts), 0
        while f < m:
            acts.append(F(r, f))
            f += 1
            acts += backward(b)
            b += 1
        while b < m:
            acts += backward(b)
            b += 1
        ranks.append(acts)
    return validate(Schedule(ranks=ranks, stage_to_rank=tuple(range(pp)), microbatches=m,
                             name="1F1B"))


def looped_gpipe(pp: int, m: int, chunks: int) -> Schedule:
    """All forwards by (stage, microbatch), then all backwards by (-stage, microbatch)."""
    placement = loop_placement(pp, chunks)
    stages = range(len(placement))
    order = [F(s, mb) for s in stages for mb in range(m)]
    order += [B(s, mb) for s in reversed(stages) for mb in range(m)]
    ranks = [[a for a in order if placement[a.stage] == r] for r in range(pp)]
    return validate(Schedule(ranks=ranks, stage_to_rank=placement, microbatches=m,
                             name="looped-gpipe"))


def with_offload(schedule: Schedule) -> Schedule:
    """OFFLOAD(s, m) right after F(s, m) and RELOAD(s, m) right before its backward."""
    ranks = []
    for acts in schedule.ranks:
        new: list[Action] = []
        for a in acts:
            if a.kind.is_backward:
                new.append(Action(a.stage, Kind.RELOAD, a.microbatch))
            new.append(a)
            if a.kind is Kind.F:
                new.append(Action(a.stage, Kind.OFFLOAD, a.microbatch))
        ranks.append(new)
    return validate(schedule.with_ranks(ranks, name=f"{schedule.name}+offload"))


def rank_blocks(grid: str) -> dict[int, list[str]]:
    """Each rank's compute row followed by its transfer rows (lines that start with a space)."""
    blocks: dict[int, list[str]] = {}
    current = None
    for line in grid.splitlines():
        match = re.match(r"rank (\d+) ", line)
        if match:
            current = int(match.group(1))
            blocks[current] = [line]
        elif current is not None and line.startswith(" ") and re.match(r" (xfer|d2h|h2d)", line):
            blocks[current].append(line)
        else:
            current = None
    return blocks


def lane_body(line: str) -> str:
    """A grid row without its label column."""
    return re.sub(r"^(rank \d+|\s+(xfer|d2h|h2d))\s", "", line, count=1)


# ---- terminal grid -------------------------------------------------------------------------


def test_grid_has_one_row_per_rank_with_every_compute_action_in_order() -> None:
    schedule = one_f_one_b(3, 4, split=True)
    grid = render_grid(simulate(schedule))
    blocks = rank_blocks(grid)
    assert sorted(blocks) == [0, 1, 2]
    for rank, acts in enumerate(schedule.ranks):
        expected = [f"{a.kind.value}{a.microbatch}" for a in acts]
        found = ["".join(g) for g in LABEL.findall(lane_body(blocks[rank][0]))]
        assert found == expected, f"rank {rank}"


def test_grid_shows_every_transfer_on_its_ranks_rows() -> None:
    result = simulate(with_offload(one_f_one_b(3, 3)), OFFLOAD_COSTS)
    blocks = rank_blocks(render_grid(result))
    assert sorted(blocks) == [0, 1, 2]
    for rank, acts in enumerate(result.schedule.ranks):
        assert len(blocks[rank]) >= 2, "a schedule with transfers gets transfer rows"
        expected = sorted(("o" if a.kind is Kind.OFFLOAD else "r") + str(a.microbatch)
                          for a in acts if a.kind.is_transfer)
        found = sorted("".join(g) for row in blocks[rank][1:]
                       for g in TRANSFER_LABEL.findall(lane_body(row)))
        assert found == expected, f"rank {rank}"


def test_grid_without_transfers_has_no_transfer_rows() -> None:
    grid = render_grid(simulate(one_f_one_b(3, 3)))
    assert all(len(rows) == 1 for rows in rank_blocks(grid).values())
    assert "offload" not in grid


def test_grid_is_time_proportional() -> None:
    # In 1F1B with T_F = 1, rank r's first forward starts at time r, so its leading idle run
    # is r forward-widths long; rank 0's warm-up forwards are back to back.
    grid = render_grid(simulate(one_f_one_b(4, 6)))
    blocks = rank_blocks(grid)
    row0 = lane_body(blocks[0][0])
    f_width = row0.index("F1") - row0.index("F0")
    assert f_width >= 2
    for rank in range(4):
        body = lane_body(blocks[rank][0])
        assert len(body) - len(body.lstrip(".")) == rank * f_width


@pytest.mark.parametrize("width", [40, 57, 80, 120, 200])
@pytest.mark.parametrize("color", [False, True])
def test_grid_respects_width(width: int, color: bool) -> None:
    for schedule, costs in [(with_offload(one_f_one_b(8, 16)), OFFLOAD_COSTS),
                            (looped_gpipe(4, 8, 3), CostModel()),
                            (one_f_one_b(2, 2), CostModel())]:
        grid = render_grid(simulate(schedule, costs), width=width, color=color)
        longest = max(len(ANSI.sub("", line)) for line in grid.splitlines())
        assert longest <= width, f"{schedule.name} at width {width}"


def test_default_width_fits_120_columns_at_p8_m16() -> None:
    result = simulate(with_offload(one_f_one_b(8, 16)), OFFLOAD_COSTS)
    grid = render_grid(result)
    assert max(len(line) for line in grid.splitlines()) <= 120
    assert len(rank_blocks(grid)) == 8


def test_colour_only_adds_escape_codes() -> None:
    result = simulate(with_offload(looped_gpipe(2, 3, 2)), OFFLOAD_COSTS)
    plain = render_grid(result)
    coloured = render_grid(result, color=True)
    assert "\x1b[" in coloured and "\x1b[" not in plain
    assert ANSI.sub("", coloured) == plain


def test_grid_is_deterministic() -> None:
    schedule = with_offload(one_f_one_b(4, 8))
    assert render_grid(simulate(schedule, OFFLOAD_COSTS)) == render_grid(
        simulate(schedule, OFFLOAD_COSTS))


def test_second_chunk_is_lower_case() -> None:
    schedule = looped_gpipe(2, 2, 2)
    blocks = rank_blocks(render_grid(simulate(schedule)))
    for rank in range(2):
        found = ["".join(g) for g in LABEL.findall(lane_body(blocks[rank][0]))]
        expected = [(a.kind.value if schedule.chunk_of(a.stage) == 0 else a.kind.value.lower())
                    + str(a.microbatch) for a in schedule.ranks[rank]]
        assert found == expected


def test_narrow_grid_says_what_it_could_not_show() -> None:
    result = simulate(one_f_one_b(8, 16))  # makespan 69 in 40 columns
    grid = render_grid(result, width=40)
    assert "note:" in grid and "larger width" in grid
    for line in grid.splitlines():
        if line.startswith("rank ") and "peak" not in line:
            assert set(lane_body(line)) <= set("FB.-0123456789")


def test_grid_summary_lists_peaks_stall_and_bytes() -> None:
    costs = CostModel(offload_ratio=0.25, activation_bytes=3 * 2**20)
    result = simulate(with_offload(one_f_one_b(3, 4)), costs)
    lines = render_grid(result).splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["rank", "peak", "M_a"])
    assert "peak bytes" in lines[header] and "stall" in lines[header]
    rows = [line.split() for line in lines[header + 1:header + 4]]
    assert [int(r[0]) for r in rows] == [0, 1, 2]
    assert [float(r[1]) for r in rows] == list(result.peak_activation)
    assert all(r[3] == "MiB" for r in rows)


def test_too_narrow_width_is_rejected() -> None:
    with pytest.raises(ConfigError, match="width"):
        render_grid(simulate(one_f_one_b(2, 2)), width=10)


def test_summary_table_matches_1f1b_theory() -> None:
    pp, m = 4, 8
    table = render_summary_table([simulate(one_f_one_b(pp, m)),
                                  simulate(with_offload(one_f_one_b(pp, m)), OFFLOAD_COSTS)])
    lines = table.splitlines()
    assert len(lines) == 3
    assert lines[0].split()[:3] == ["schedule", "pp", "chunks"]
    cells = lines[1].split()
    assert cells[:5] == ["1F1B", "4", "1", "8", str((m + pp - 1) * 3)]
    assert cells[5] == f"{(pp - 1) / (m + pp - 1):.1%}"
    assert cells[6] == "0%"
    assert cells[7:11] == ["4", "3", "2", "1"]
    assert lines[2].startswith("1F1B+offload")
    assert lines[2].split()[6] == "100%"  # with_offload offloads every activation
    # aligned: every row puts its bubble percentage at the same column
    ends = {line.index("%") for line in lines[1:]}
    assert len(ends) == 1


def test_summary_table_accepts_one_result() -> None:
    assert len(render_summary_table(simulate(one_f_one_b(2, 2))).splitlines()) == 2


# ---- Chrome / Perfetto trace ---------------------------------------------------------------


@pytest.fixture(scope="module")
def offloaded() -> SimResult:
    costs = CostModel(offload_ratio=0.25, activation_bytes=1000.0)
    return simulate(with_offload(one_f_one_b(3, 4, split=True)), costs)


@pytest.mark.parametrize("scale", [1e6, 1000.0, 1.0])
def test_trace_has_one_complete_event_per_timed_action(offloaded: SimResult,
                                                       scale: float) -> None:
    trace = json.loads(json.dumps(to_chrome_trace(offloaded, time_scale_us=scale)))
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    timed = [t for row in offloaded.timeline for t in row]
    assert len(complete) == len(timed)
    by_key = {(e["pid"], e["args"]["action"]): e for e in complete}
    assert len(by_key) == len(timed)
    for t in timed:
        event = by_key[(t.rank, str(t.action))]
        assert event["ts"] == pytest.approx(t.start * scale)
        assert event["dur"] == pytest.approx((t.end - t.start) * scale)
        assert event["tid"] == LANE_TID[t.lane]
        stage, kind, mb = t.action
        assert event["name"] == f"{kind.value} s{stage} mb{mb}"
        assert event["args"]["stage"] == stage and event["args"]["microbatch"] == mb
        assert event["args"]["kind"] == kind.value
    lanes = {e["tid"] for e in complete}
    assert {LANE_TID[Lane.COMPUTE], LANE_TID[Lane.D2H], LANE_TID[Lane.H2D]} <= lanes


def test_trace_counters_follow_memory_curves(offloaded: SimResult) -> None:
    scale = 1000.0
    trace = to_chrome_trace(offloaded, time_scale_us=scale)
    for rank, curve in enumerate(offloaded.memory):
        series = [(e["ts"] / scale, e["args"]["resident"]) for e in trace["traceEvents"]
                  if e["ph"] == "C" and e["name"] == MEMORY_COUNTER and e["pid"] == rank]
        assert len(series) == len(curve)
        for (time, value), (want_time, want_value) in zip(series, curve):
            assert (time, value) == (pytest.approx(want_time), pytest.approx(want_value))
        assert max(v for _, v in series) == pytest.approx(offloaded.peak_activation[rank])
        in_bytes = [e["args"]["bytes"] for e in trace["traceEvents"]
                    if e["ph"] == "C" and e["name"] == BYTES_COUNTER and e["pid"] == rank]
        assert offloaded.peak_bytes is not None
        assert max(in_bytes) == pytest.approx(offloaded.peak_bytes[rank])


def test_trace_counter_peaks_match_1f1b_theory() -> None:
    trace = to_chrome_trace(simulate(one_f_one_b(3, 5)))
    for rank in range(3):
        values = [e["args"]["resident"] for e in trace["traceEvents"]
                  if e["ph"] == "C" and e["pid"] == rank]
        assert max(values) == 3 - rank
        assert values[-1] == 0
    assert not any(e.get("name") == BYTES_COUNTER for e in trace["traceEvents"])


def test_trace_names_ranks_and_lanes(offloaded: SimResult) -> None:
    events = to_chrome_trace(offloaded)["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    assert names == {(r, f"rank {r}") for r in range(3)}
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {"compute", "d2h", "h2d"} <= threads


def test_write_trace_round_trips(tmp_path, offloaded: SimResult) -> None:
    path = write_trace(offloaded, tmp_path / "trace.json", time_scale_us=10.0)
    assert path == tmp_path / "trace.json"
    assert json.loads(path.read_text()) == json.loads(json.dumps(
        to_chrome_trace(offloaded, time_scale_us=10.0)))


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_trace_rejects_bad_time_scale(offloaded: SimResult, scale: float) -> None:
    with pytest.raises(ConfigError, match="time_scale_us"):
        to_chrome_trace(offloaded, time_scale_us=scale)


# ---- PNG -----------------------------------------------------------------------------------

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _pixels_near(image, rgb: tuple[float, float, float], tol: float = 0.02) -> int:
    import numpy as np

    diff = np.abs(image[..., :3] - np.asarray(rgb)[None, None, :])
    return int((diff.max(axis=-1) < tol).sum())


def _hex(color: str) -> tuple[float, float, float]:
    return tuple(int(color[i:i + 2], 16) / 255 for i in (1, 3, 5))  # type: ignore[return-value]


def test_png_is_written_and_readable(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from pipeoffload.sim.render_png import KIND_COLORS, render_png

    schedule = with_offload(one_f_one_b(3, 4, split=True))
    path = render_png(simulate(schedule, OFFLOAD_COSTS), tmp_path / "offload.png",
                      compare=simulate(one_f_one_b(3, 4, split=True)), title=None)
    assert path == tmp_path / "offload.png"
    assert path.read_bytes()[:8] == PNG_MAGIC
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 1000
    for kind in (Kind.F, Kind.I, Kind.W, Kind.OFFLOAD, Kind.RELOAD):
        assert _pixels_near(image, _hex(KIND_COLORS[kind])) > 50, kind
    for kind in (Kind.B, Kind.RECOMPUTE):
        assert _pixels_near(image, _hex(KIND_COLORS[kind])) == 0, kind


def test_png_transfer_lanes_make_the_figure_taller(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from pipeoffload.sim.render_png import render_png

    plain = imread(render_png(simulate(one_f_one_b(2, 3)), tmp_path / "plain.png"))
    offl = imread(render_png(simulate(with_offload(one_f_one_b(2, 3)), OFFLOAD_COSTS),
                             tmp_path / "offload.png", title="custom title"))
    assert offl.shape[0] > plain.shape[0]
    assert offl.shape[1] == plain.shape[1]


def test_png_rejects_compare_with_other_pp(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from pipeoffload.sim.render_png import render_png

    with pytest.raises(ConfigError, match="ranks"):
        render_png(simulate(one_f_one_b(2, 2)), tmp_path / "x.png",
                   compare=simulate(one_f_one_b(3, 2)))
    assert not (tmp_path / "x.png").exists()


def test_png_without_matplotlib_says_how_to_install(tmp_path, monkeypatch) -> None:
    from pipeoffload.sim.render_png import render_png

    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=re.escape("pipeoffload[plot]")):
        render_png(simulate(one_f_one_b(2, 2)), tmp_path / "x.png")


def test_grid_keeps_actions_shorter_than_a_column() -> None:
    # Without an offload ratio or bandwidths, copies take no time; each still gets a column.
    result = simulate(with_offload(one_f_one_b(3, 3)), CostModel())
    blocks = rank_blocks(render_grid(result))
    for rank, acts in enumerate(result.schedule.ranks):
        for letter, kind in (("o", Kind.OFFLOAD), ("r", Kind.RELOAD)):
            shown = sum(lane_body(row).count(letter) for row in blocks[rank][1:])
            assert shown == sum(a.kind is kind for a in acts), f"rank {rank} {kind}"


def test_png_memory_step_data_drops_zero_length_dips() -> None:
    pytest.importorskip("matplotlib")
    from pipeoffload.sim.render_png import _step

    curve = ((0.0, 0.0), (1.0, 1.0), (3.0, 0.5), (3.0, 1.5), (4.0, 1.0))
    assert _step(curve, 6.0) == ([0.0, 1.0, 3.0, 4.0, 6.0], [0.0, 1.0, 1.5, 1.0, 1.0])


def test_offload_wait_has_a_letter_and_a_legend_entry() -> None:
    from pipeoffload.api import plan_schedule
    from pipeoffload.sim.render_text import render_grid

    plan = plan_schedule("po-f", 6, 12, offload_ratio=0.5)
    assert plan.schedule.has_kind(Kind.OFFLOAD_WAIT)
    text = render_grid(plan.result, width=160)
    assert "?" not in text
    rank_0 = next(line for line in text.splitlines() if line.startswith("rank 0"))
    assert "(OFFLOAD_WAIT)" in text and "=" in rank_0


def test_long_notes_wrap_between_words_at_any_width() -> None:
    from pipeoffload.sim.render_text import MIN_WIDTH, render_grid

    text = render_grid(simulate(one_f_one_b(8, 64)), width=MIN_WIDTH)
    assert all(len(line) <= MIN_WIDTH for line in text.splitlines())
    assert "(--width N or $COLUMNS)" in text.replace("\n", " ")
