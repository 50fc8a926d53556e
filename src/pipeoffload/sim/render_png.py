"""PNG picture of a simulation: per rank, a Gantt strip (compute lane, and D2H / H2D copy lanes
when the schedule offloads) above that rank's resident-activation curve, on one time axis.

matplotlib is an optional dependency (``pip install 'pipeoffload[plot]'``), imported only when
a picture is drawn; the figure is rendered with the Agg canvas directly, never through pyplot,
so no display is needed and no global matplotlib state is touched.
"""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pipeoffload.core.actions import Kind
from pipeoffload.errors import ConfigError
from pipeoffload.sim.render_text import format_bytes, format_number
from pipeoffload.sim.simulator import Lane, SimResult

# Muted, clearly distinct hues (close to seaborn's "deep" palette) that also print well.
KIND_COLORS = {Kind.F: "#4C72B0", Kind.I: "#DD8452", Kind.W: "#55A868", Kind.B: "#C44E52",
               Kind.RECOMPUTE: "#8172B3", Kind.OFFLOAD: "#937860", Kind.RELOAD: "#DA8BC3",
               Kind.FETCH: "#8C8C8C"}
_KIND_NAMES = {Kind.F: "F forward", Kind.I: "I input-grad", Kind.W: "W weight-grad",
               Kind.B: "B backward", Kind.RECOMPUTE: "recompute",
               Kind.OFFLOAD: "offload (D2H)", Kind.RELOAD: "reload (H2D)",
               Kind.FETCH: "fetch reads (H2D)"}
_MEMORY_COLOR = "#2F4858"
_COMPARE_COLOR = "#9A9A9A"
# Layout in inches; fixed so label-fitting can be computed before drawing.
_WIDTH_IN, _LEFT_IN, _RIGHT_IN = 15.0, 1.35, 0.35
_TOP_IN, _BOTTOM_IN = 1.15, 0.6
_COMPUTE_IN, _TRANSFER_IN, _MEMORY_IN, _GAP_IN = 0.42, 0.2, 0.62, 0.24
_DPI = 110
_LABEL_SIZES_PT = (6.5, 5.5)  # box labels: the first that fits
_LIGHTEST_CHUNK = 0.55  # how far towards white the last chunk's colour is mixed
_MEMORY_HEADROOM = 1.22  # y range above the highest peak, room for the per-rank peak note


def render_png(result: SimResult, path: str | Path, *, compare: SimResult | None = None,
               title: str | None = None) -> Path:
    """Draw ``result`` to a PNG file at ``path`` (an SVG file if it ends in .svg) and return
    the path. With ``compare`` (e.g.
    the same schedule without offload), its memory curves are drawn dashed on the same axes."""
    schedule = result.schedule
    pp = schedule.num_ranks
    if compare is not None and compare.schedule.num_ranks != pp:
        raise ConfigError(
            f"render_png: compare ({compare.schedule.name}) has {compare.schedule.num_ranks} "
            f"ranks but {schedule.name} has {pp}; compare schedules with the same ranks"
        )
    mpl = _matplotlib()
    lanes = [Lane.COMPUTE]
    lanes += [lane for lane in (Lane.D2H, Lane.H2D)
              if any(t.lane is lane for row in result.timeline for t in row)]
    gantt_in = _COMPUTE_IN + _TRANSFER_IN * (len(lanes) - 1)
    ratios: list[float] = []
    for rank in range(pp):
        ratios += [gantt_in, _MEMORY_IN] + ([_GAP_IN] if rank < pp - 1 else [])
    text = title or _title(result, compare)
    extra_in = 0.2 * max(text.count("\n") - 1, 0)  # room for title lines beyond two
    top_in = _TOP_IN + extra_in
    height = top_in + _BOTTOM_IN + sum(ratios)
    fig = mpl.Figure(figsize=(_WIDTH_IN, height), dpi=_DPI)
    mpl.FigureCanvasAgg(fig)
    grid = fig.add_gridspec(
        len(ratios), 1, height_ratios=ratios, hspace=0,
        left=_LEFT_IN / _WIDTH_IN, right=1 - _RIGHT_IN / _WIDTH_IN,
        top=1 - top_in / height, bottom=_BOTTOM_IN / height,
    )
    end = max(result.makespan, compare.makespan if compare is not None else 0.0) or 1.0
    px_per_time = (_WIDTH_IN - _LEFT_IN - _RIGHT_IN) * _DPI / end
    mem_top = max([*result.peak_activation, *(compare.peak_activation if compare else ())])
    mem_top = (mem_top or 1.0) * _MEMORY_HEADROOM

    axes: list[Any] = []  # matplotlib Axes (matplotlib is optional and untyped here)
    for rank in range(pp):
        row = rank * 3
        gantt = fig.add_subplot(grid[row, 0], sharex=axes[0] if axes else None)
        memory = fig.add_subplot(grid[row + 1, 0], sharex=gantt)
        axes += [gantt, memory]
        _draw_gantt(gantt, result, rank, lanes, px_per_time)
        _draw_memory(memory, result, compare, rank, end, mem_top)
        top, bottom = gantt.get_position().y1, memory.get_position().y0
        fig.text(0.12 / _WIDTH_IN, (top + bottom) / 2, f"rank {rank}", ha="left", va="center",
                 fontsize=10, fontweight="bold")
    for ax in axes[:-1]:
        ax.tick_params(labelbottom=False)
    axes[0].set_xlim(0, end)
    axes[-1].set_xlabel("time (cost-model units)")

    fig.suptitle(text, x=_LEFT_IN / _WIDTH_IN, ha="left", y=1 - 0.12 / height, va="top",
                 fontsize=11)
    handles = _legend_handles(mpl, result, compare)
    fig.legend(handles=handles, loc="upper left", ncol=len(handles), frameon=False, fontsize=8.5,
               bbox_to_anchor=(_LEFT_IN / _WIDTH_IN - 0.005, 1 - (0.62 + extra_in) / height))
    path = Path(path)
    kind = "svg" if path.suffix.lower() == ".svg" else "png"  # any other name: PNG bytes
    picture = io.BytesIO()  # matplotlib seeks in its file, which a FIFO cannot
    fig.savefig(picture, format=kind, dpi=_DPI, facecolor="white")
    path.write_bytes(picture.getvalue())
    return path


def _matplotlib() -> SimpleNamespace:
    """Import matplotlib's object-oriented pieces, or say how to install it."""
    try:
        import matplotlib  # noqa: F401 - fails first if matplotlib is missing
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as err:
        raise ImportError(
            "render_png draws with matplotlib, which is not installed; install it with "
            "`pip install 'pipeoffload[plot]'` (or use render_grid / write_trace instead)"
        ) from err
    return SimpleNamespace(Figure=Figure, FigureCanvasAgg=FigureCanvasAgg, Line2D=Line2D,
                           Patch=Patch)


def _shade(color: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """``color`` mixed towards white by chunk: chunk 0 full, the last chunk lightest."""
    rgb = [int(color[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    mix = _LIGHTEST_CHUNK * chunk / (chunks - 1) if chunks > 1 else 0.0
    r, g, b = (c + (1 - c) * mix for c in rgb)
    return r, g, b


def _draw_gantt(ax: Any, result: SimResult, rank: int, lanes: list[Lane],
                px_per_time: float) -> None:
    schedule = result.schedule
    chunks = len(schedule.stages_on_rank(rank))
    rows = {lane: index for index, lane in enumerate(lanes)}
    heights = [1.0] + [0.48] * (len(lanes) - 1)  # transfer lanes are thinner
    bottoms = [sum(heights[:i]) for i in range(len(lanes))]
    bars: dict[tuple[int, tuple[float, float, float]], list[tuple[float, float]]] = {}
    ticks: dict[tuple[int, tuple[float, float, float]], list[float]] = {}
    for item in result.timeline[rank]:
        if item.lane not in rows:
            continue
        lane = rows[item.lane]
        kind = item.action.kind
        color = _shade(KIND_COLORS.get(kind, "#888888"), schedule.chunk_of(item.action.stage),
                       chunks)
        width = max(item.end - item.start, 0.0)
        y = bottoms[lane] + 0.08 * heights[lane]
        h = 0.84 * heights[lane]
        if width == 0 and lane:  # a copy that takes no time: a tick where it happens
            ticks.setdefault((lane, color), []).append(item.start)
            continue
        bars.setdefault((lane, color), []).append((item.start, width))
        label = str(item.action.microbatch)  # the kind is the colour
        size = _label_size(label, width * px_per_time, lane == 0)
        if size is not None:
            ax.text(item.start + width / 2, y + h / 2, label, ha="center", va="center",
                    fontsize=size, color=_ink(color))
    for (lane, color), spans in bars.items():  # one collection per lane and colour: fast
        ax.broken_barh(spans, (bottoms[lane] + 0.08 * heights[lane], 0.84 * heights[lane]),
                       facecolors=[color], edgecolors="white", linewidth=0.4, zorder=1)
    for (lane, color), times in ticks.items():  # likewise one collection of ticks
        y = bottoms[lane] + 0.08 * heights[lane]
        ax.vlines(times, y, y + 0.84 * heights[lane], colors=[color], linewidth=1.6)
    ax.set_ylim(sum(heights), 0)
    ax.set_yticks([b + h / 2 for b, h in zip(bottoms, heights)])
    ax.set_yticklabels([{Lane.COMPUTE: "compute", Lane.D2H: "D2H", Lane.H2D: "H2D"}[lane]
                        for lane in lanes], fontsize=7)
    ax.tick_params(axis="y", length=0)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.grid(axis="x", color="#E6E6E6", linewidth=0.5)
    ax.set_axisbelow(True)


def _label_size(label: str, width_px: float, compute_lane: bool) -> float | None:
    """The largest of our label font sizes at which ``label`` fits in a box ``width_px`` wide
    (a digit is about 0.62 em in the default sans-serif font), or None if none does."""
    sizes = _LABEL_SIZES_PT if compute_lane else _LABEL_SIZES_PT[1:]
    for points in sizes:
        if width_px >= 0.62 * points * _DPI / 72 * len(label) + 2:
            return points
    return None


def _ink(rgb: tuple[float, float, float]) -> str:
    """Black or white text, whichever reads better on ``rgb``."""
    luminance = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]
    return "black" if luminance > 0.6 else "white"


def _step(curve: tuple[tuple[float, float], ...], end: float) -> tuple[list[float], list[float]]:
    """A memory curve as step-plot data, held at its last level until ``end``. Of several
    points at one time only the last is kept: frees come first at a tie, so the dropped ones
    are zero-length dips, never peaks."""
    level_at: dict[float, float] = {}
    for time, units in curve:
        level_at[time] = units
    xs = sorted(level_at)
    ys = [level_at[t] for t in xs]
    return [*xs, end], [*ys, ys[-1] if ys else 0.0]


def _draw_memory(ax: Any, result: SimResult, compare: SimResult | None, rank: int, end: float,
                 top: float) -> None:
    xs, ys = _step(result.memory[rank], end)
    ax.fill_between(xs, ys, step="post", color=_MEMORY_COLOR, alpha=0.18, linewidth=0)
    ax.step(xs, ys, where="post", color=_MEMORY_COLOR, linewidth=1.2)
    note = f"peak {format_number(result.peak_activation[rank])} M_a"
    if compare is not None:
        cx, cy = _step(compare.memory[rank], end)
        ax.step(cx, cy, where="post", color=_COMPARE_COLOR, linewidth=1.2, linestyle="--")
        note += f"  ({compare.schedule.name}: {format_number(compare.peak_activation[rank])})"
    if result.stall_time[rank] > 0:
        note += f"  stall {format_number(result.stall_time[rank])}"
    ax.text(0.995, 0.93, note, transform=ax.transAxes, ha="right", va="top", fontsize=7.5,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1.0})
    ax.set_ylim(0, top)
    ax.set_ylabel("M_a", fontsize=7, rotation=0, ha="right", va="center")
    ax.tick_params(axis="y", labelsize=7)
    ax.locator_params(axis="y", nbins=3)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.grid(axis="x", color="#E6E6E6", linewidth=0.5)


def _title(result: SimResult, compare: SimResult | None) -> str:
    s = result.schedule
    head = (f"{s.name}: pp={s.num_ranks}, chunks={s.chunks}, microbatches={s.microbatches}   "
            f"bubble {result.bubble_rate:.1%}   makespan {format_number(result.makespan)}")
    if result.total_stall_time > 0:
        head += f"   stall {format_number(result.total_stall_time)}"
    peaks = " ".join(format_number(p) for p in result.peak_activation)
    line = f"peak activation per rank (M_a): {peaks}"
    if result.peak_bytes is not None:
        line += f" = {' '.join(format_bytes(b) for b in result.peak_bytes)}"
    if compare is not None:
        other = " ".join(format_number(p) for p in compare.peak_activation)
        line += f"   vs {compare.schedule.name}: {other}"
        if compare.peak_bytes is not None:
            line += f" = {' '.join(format_bytes(b) for b in compare.peak_bytes)}"
    if _free_copies(result):
        line += ("\ncopies take no time in this cost model (as train's on CPU), drawn as ticks: "
                 "an offloaded activation comes back as its backward starts;\ncopies that take "
                 "time (an offload ratio, 0.5 in the README's table) come back earlier, so the "
                 "peaks are higher")
    return f"{head}\n{line}"


def _free_copies(result: SimResult) -> bool:
    """Whether the schedule copies activations and every copy takes no time."""
    stages = {t.action.stage for row in result.timeline for t in row
              if t.action.kind in (Kind.OFFLOAD, Kind.RELOAD, Kind.FETCH)}
    return bool(stages) and all(result.costs.transfer_time(s, kind) == 0 for s in stages
                                for kind in (Kind.OFFLOAD, Kind.RELOAD))


def _legend_handles(mpl: SimpleNamespace, result: SimResult,
                    compare: SimResult | None) -> list[Any]:
    present = {t.action.kind for row in result.timeline for t in row}
    handles = [mpl.Patch(facecolor=KIND_COLORS[k], label=_KIND_NAMES[k])
               for k in _KIND_NAMES if k in present]
    if result.schedule.chunks > 1:
        handles.append(mpl.Patch(facecolor=_shade(KIND_COLORS[Kind.F], 1, 2),
                                 label="lighter = later chunk"))
    handles.append(mpl.Line2D([], [], color=_MEMORY_COLOR, label="resident activation"))
    if compare is not None:
        handles.append(mpl.Line2D([], [], color=_COMPARE_COLOR, linestyle="--",
                                  label=compare.schedule.name))
    return handles
