"""Terminal pictures of a simulation: a time-proportional grid with one row per rank, and a
summary table, both plain text (ANSI colour optional) so they work over ssh and in CI logs.

Time runs left to right, quantised to columns; the scale is chosen so the whole makespan fits
in ``width`` columns and, when possible, the shortest compute action spans a whole number of
half columns, so equal actions look equal. An action is labelled with its kind letter and
microbatch ("F3") where that fits and with its letter alone where it does not.
SEND / RECV actions take no time in the simulator and are not drawn.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from pipeoffload.core.actions import Kind
from pipeoffload.errors import ConfigError
from pipeoffload.sim.simulator import Lane, SimResult, TimedAction, activation_units

DEFAULT_WIDTH = 120
MIN_WIDTH = 40
IDLE = "."
BUSY_FILL = "-"
TRANSFER_FILL = "~"
# Columns per shortest compute action we are willing to use; wider boxes add nothing readable.
_MAX_COLUMNS_PER_ACTION = 6.0
_COLUMNS_PER_ACTION_STEPS = (6.0, 5.0, 4.0, 3.0, 2.5, 2.0, 1.5, 1.25, 1.0)

_LETTER = {Kind.F: "F", Kind.I: "I", Kind.W: "W", Kind.B: "B", Kind.RECOMPUTE: "R",
           Kind.OFFLOAD: "o", Kind.RELOAD: "r", Kind.FETCH: "f", Kind.OFFLOAD_WAIT: "="}
_KIND_WORDS = {Kind.F: "forward", Kind.I: "input-grad", Kind.W: "weight-grad",
               Kind.B: "backward", Kind.RECOMPUTE: "recompute"}
# ANSI SGR codes: a background per kind; odd chunks use the bright variant of the same hue.
_ANSI_BACKGROUND = {Kind.F: 44, Kind.I: 46, Kind.W: 42, Kind.B: 43, Kind.RECOMPUTE: 45}
_ANSI_TRANSFER = {Kind.OFFLOAD: 35, Kind.RELOAD: 33, Kind.FETCH: 36}
_ANSI_RESET = "\x1b[0m"


def render_grid(result: SimResult, width: int | None = None, color: bool = False) -> str:
    """Draw ``result`` as text: a header, a time ruler, one row per rank (plus transfer rows when
    the schedule offloads), a legend and a per-rank summary. Every line fits in ``width``
    visible columns (120 by default); the output depends only on its arguments."""
    width = DEFAULT_WIDTH if width is None else width
    if width < MIN_WIDTH:
        raise ConfigError(f"render_grid width must be >= {MIN_WIDTH} columns, got {width}")
    schedule = result.schedule
    pp = schedule.num_ranks
    has_transfers = any(t.lane in (Lane.D2H, Lane.H2D) for row in result.timeline for t in row)
    prefix = max(len(f"rank {pp - 1}"), len(" d2h")) + 1
    columns_per_time, shortest = _choose_scale(result, width - prefix)
    ncols = max(1, math.ceil(result.makespan * columns_per_time - 1e-9))

    rows: list[str] = []
    hidden = 0
    split_transfers = has_transfers and _transfers_overlap(result, columns_per_time)
    for rank in range(pp):
        timeline = result.timeline[rank]
        compute = [t for t in timeline if t.lane is Lane.COMPUTE]
        cells, lost = _paint(compute, ncols, columns_per_time, result, color, IDLE, BUSY_FILL)
        hidden += lost
        rows.append(f"rank {rank}".ljust(prefix) + cells)
        if not has_transfers:
            continue
        lanes = ([(" d2h", (Lane.D2H,)), (" h2d", (Lane.H2D,))] if split_transfers
                 else [(" xfer", (Lane.D2H, Lane.H2D))])
        for label, wanted in lanes:
            items = [t for t in timeline if t.lane in wanted]
            cells, lost = _paint(items, ncols, columns_per_time, result, color, " ",
                                 TRANSFER_FILL)
            hidden += lost
            rows.append(label.ljust(prefix) + cells)

    header = _pack([
        f"{schedule.name}:", f"pp={pp}", f"chunks={schedule.chunks}",
        f"microbatches={schedule.microbatches}", f"makespan {format_number(result.makespan)}",
        f"bubble {result.bubble_rate:.1%}",
        f"1 column = {format_number(1 / columns_per_time)} time units",
    ], width)
    lines = [*header, " " * prefix + _ruler(ncols, columns_per_time, width - prefix), *rows]
    lines += _pack(_legend(result, has_transfers), width)
    if shortest * columns_per_time < 1 or hidden:
        lines += _pack([
            (f"note: the shortest action spans {format_number(shortest * columns_per_time)} "
             f"columns; {hidden} actions did not get a column of their own and are not shown;"),
            "pass a larger width to see them (--width N or $COLUMNS)",
        ], width)
    lines.append("")
    lines += _rank_summary(result)
    return "\n".join(lines)


def render_summary_table(results: SimResult | Iterable[SimResult]) -> str:
    """One aligned row per result: schedule, pp, chunks, microbatches, makespan, bubble rate,
    offloaded share of the activations, peak activation per rank (M_a units, rank 0 first) and
    total stall time."""
    items = [results] if isinstance(results, SimResult) else list(results)
    header = ["schedule", "pp", "chunks", "microbatches", "makespan", "bubble", "offloaded",
              "peak M_a per rank", "stall"]
    body = []
    for r in items:
        s = r.schedule
        body.append([
            s.name, str(s.num_ranks), str(s.chunks), str(s.microbatches),
            format_number(r.makespan), f"{r.bubble_rate:.1%}", f"{offloaded_fraction(r):.0%}",
            " ".join(format_number(p) for p in r.peak_activation),
            format_number(r.total_stall_time),
        ])
    return _table(header, body, right=(1, 2, 3, 4, 5, 6, 8))


def offloaded_fraction(result: SimResult) -> float:
    """Share of all activations (weighted by size, as in the memory accounting) that the
    schedule offloads; 0 when it has no OFFLOAD actions."""
    units = activation_units(result.schedule, result.costs)
    total = offloaded = 0.0
    for _, _, action in result.schedule.actions:
        if action.kind is Kind.F:
            total += units[action.stage]
        elif action.kind is Kind.OFFLOAD:
            offloaded += units[action.stage]
    return offloaded / total if total > 0 else 0.0


def format_number(value: float) -> str:
    """A short, stable number: integers without a fraction, others with up to 3 decimals."""
    if math.isclose(value, round(value), abs_tol=1e-9):
        return str(round(value))
    if abs(value) >= 1000 or abs(value) < 0.001:
        return f"{value:.3g}"
    return f"{value:.3f}".rstrip("0").rstrip(".")


def format_bytes(value: float) -> str:
    """Bytes with a binary unit (KiB, MiB, GiB, TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _choose_scale(result: SimResult, available: int) -> tuple[float, float]:
    """(columns per time unit, shortest compute duration). Prefer a whole number of half
    columns per shortest action, at most _MAX_COLUMNS_PER_ACTION, else fill the width."""
    durations = [t.end - t.start for row in result.timeline for t in row
                 if t.lane is Lane.COMPUTE and t.end > t.start]
    makespan = result.makespan
    if makespan <= 0:
        return 1.0, 0.0
    shortest = min(durations, default=makespan)
    fit = available * shortest / makespan  # columns the shortest action could get
    for step in _COLUMNS_PER_ACTION_STEPS:
        if step <= min(fit, _MAX_COLUMNS_PER_ACTION):
            return step / shortest, shortest
    return available / makespan, shortest


def _columns(item: TimedAction, columns_per_time: float) -> tuple[int, int]:
    return round(item.start * columns_per_time), round(item.end * columns_per_time)


def _transfers_overlap(result: SimResult, columns_per_time: float) -> bool:
    """Whether any rank has a D2H and an H2D copy sharing a column (then they get two rows)."""
    for row in result.timeline:
        used: dict[Lane, set[int]] = {Lane.D2H: set(), Lane.H2D: set()}
        for t in row:
            if t.lane in used:
                c0, c1 = _columns(t, columns_per_time)
                used[t.lane].update(range(c0, max(c1, c0 + 1)))
        if used[Lane.D2H] & used[Lane.H2D]:
            return True
    return False


def _labels(item: TimedAction, result: SimResult) -> list[str]:
    """Label candidates, longest first. Upper case for a rank's even chunks (0, 2, ...), lower
    case for odd ones; with more than two chunks, the action's text form (stage, kind,
    microbatch) where it fits."""
    schedule = result.schedule
    stage, kind, microbatch = item.action
    letter = _LETTER.get(kind, "?")
    chunks = len(schedule.stages_on_rank(item.rank))
    if kind.is_transfer:
        return [f"{letter}{microbatch}", letter]
    if schedule.chunk_of(stage) % 2 == 1:
        letter = letter.lower()
    labels = [f"{letter}{microbatch}", letter]
    if chunks > 2:
        # Trailing fill keeps "0F0" from running into the next label's digits.
        labels.insert(0, f"{stage}{letter}{microbatch}{BUSY_FILL}")
    return labels


def _paint(items: Sequence[TimedAction], ncols: int, columns_per_time: float, result: SimResult,
           color: bool, idle: str, fill: str) -> tuple[str, int]:
    """One lane as text; returns it and how many actions got no column. An action shorter
    than a column takes the column where it starts if nothing else has."""
    cells = [idle] * ncols
    styles: list[str | None] = [None] * ncols
    owned = [False] * ncols
    hidden = 0
    for item in sorted(items, key=lambda t: (t.start, t.end)):
        c0, c1 = _columns(item, columns_per_time)
        c1 = min(c1, ncols)
        if c1 <= c0:
            if c0 >= ncols or owned[c0]:
                hidden += 1
                continue
            c1 = c0 + 1
        c0 = next((c for c in range(c0, c1) if not owned[c]), c1)
        if c0 == c1:
            hidden += 1
            continue
        span = c1 - c0
        label = next((text for text in _labels(item, result) if len(text) <= span), "")
        text = label + fill * (span - len(label))
        style = _ansi(item, result) if color else None
        for offset, char in enumerate(text):
            cells[c0 + offset] = char
            styles[c0 + offset] = style
            owned[c0 + offset] = True
    if not color:
        return "".join(cells), hidden
    out, current = [], None
    for char, style in zip(cells, styles):
        if style != current:
            out.append(_ANSI_RESET if style is None else style)
            current = style
        out.append(char)
    if current is not None:
        out.append(_ANSI_RESET)
    return "".join(out), hidden


def _ansi(item: TimedAction, result: SimResult) -> str:
    kind = item.action.kind
    if kind.is_transfer:
        return f"\x1b[1;{_ANSI_TRANSFER[kind]}m"
    code = _ANSI_BACKGROUND.get(kind, 47)
    if result.schedule.chunk_of(item.action.stage) % 2 == 1:
        code += 60  # bright variant: same hue, lighter shade
    return f"\x1b[30;{code}m"


def _ruler(ncols: int, columns_per_time: float, available: int) -> str:
    """Tick labels at round times, spaced at least 8 columns apart."""
    target = 8 / columns_per_time
    magnitude = 10 ** math.floor(math.log10(target))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= target)
    cells = [" "] * min(available, ncols + 8)
    tick = 0
    while True:
        time = tick * step
        col = round(time * columns_per_time)
        if col > ncols:
            break
        text = "|" + format_number(time)
        if col + len(text) <= len(cells):
            cells[col:col + len(text)] = text
        tick += 1
    return "".join(cells).rstrip()


def _legend(result: SimResult, has_transfers: bool) -> list[str]:
    present = {t.action.kind for row in result.timeline for t in row}
    parts = ["legend:"]
    parts += [f"{_LETTER[k]} {_KIND_WORDS[k]}" for k in _KIND_WORDS if k in present]
    chunks = result.schedule.chunks
    if chunks == 2:
        parts.append("lower case = a rank's 2nd chunk")
    elif chunks > 2:
        parts += ["lower case = odd chunk", "'5F3' = stage 5, F, microbatch 3"]
    parts += [f"{BUSY_FILL} busy", f"{IDLE} idle"]
    if Kind.OFFLOAD_WAIT in present:
        parts.append(f"{_LETTER[Kind.OFFLOAD_WAIT]}3 forward held until mb 3's copy out ends "
                     "(OFFLOAD_WAIT)")
    if has_transfers:
        parts += ["o3 offload mb 3 (device to host)", "r3 reload mb 3 (host to device)"]
        if Kind.FETCH in present:
            parts.append("f3 mb 3 read back by its backward pass")
        parts.append(f"{TRANSFER_FILL} copy in progress")
    return parts


def _rank_summary(result: SimResult) -> list[str]:
    header = ["rank", "peak M_a"]
    if result.peak_bytes is not None:
        header.append("peak bytes")
    header += ["stall", "busy"]
    body = []
    for rank in range(result.schedule.num_ranks):
        row = [str(rank), format_number(result.peak_activation[rank])]
        if result.peak_bytes is not None:
            row.append(format_bytes(result.peak_bytes[rank]))
        busy = result.compute_time[rank] / result.makespan if result.makespan > 0 else 0.0
        row += [format_number(result.stall_time[rank]), f"{busy:.1%}"]
        body.append(row)
    return _table(header, body, right=tuple(range(len(header)))).split("\n")


def _table(header: list[str], body: list[list[str]], right: tuple[int, ...]) -> str:
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        cells = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    return "\n".join(line(row) for row in [header, *body])


def _pack(parts: list[str], width: int, sep: str = "  ") -> list[str]:
    """Join ``parts`` into as few lines of at most ``width`` columns as possible (a part
    longer than a line is broken between words, a word longer than a line is cut)."""
    lines: list[str] = []
    current = ""
    pieces = []
    for part in parts:
        pieces += [part] if len(part) <= width else _wrap(part, width)
    for part in pieces:
        part = part[:width]
        candidate = f"{current}{sep}{part}" if current else part
        if len(candidate) <= width:
            current = candidate
        else:
            lines.append(current)
            current = part
    if current:
        lines.append(current)
    return lines


def _wrap(text: str, width: int) -> list[str]:
    """``text`` as lines of at most ``width`` columns, broken between words."""
    lines = [""]
    for word in text.split():
        if lines[-1] and len(lines[-1]) + 1 + len(word) > width:
            lines.append("")
        lines[-1] = f"{lines[-1]} {word}" if lines[-1] else word
    return lines
