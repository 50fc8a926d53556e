"""Text and CSV forms of a schedule, compatible with torch.distributed.pipelining.

One CSV row per rank, one action per cell (``0F0,0F1,0I0,...``); empty cells are spacing and
are skipped. Files we write load in torch's ``_load_csv`` when they hold none of our own
kinds (``compute_only=True`` strips those). torch's UNSHARD / RESHARD / REDUCE_GRAD tokens are
read as markers and written back as they were (Note: [torch markers], core/actions.py).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path

from pipeoffload.checks import check_instance
from pipeoffload.core.actions import (
    MARKER_KINDS,
    OFFLOAD_KINDS,
    Action,
    Kind,
    parse_cell,
)
from pipeoffload.core.errors import ParseError
from pipeoffload.core.schedule import Schedule, infer_routes, infer_stage_to_rank


def parse_rows(text: str, source: str = "<text>") -> list[list[Action]]:
    """Parse CSV text into per-rank action lists; errors name source:row:column and the token."""
    rows: list[list[Action]] = []
    for row_no, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        actions = []
        for col_no, cell in enumerate(row, start=1):
            if cell.strip():
                actions.extend(parse_cell(cell, where=f"{source}:{row_no}:{col_no}: "))
        rows.append(actions)
    while rows and not rows[-1]:
        rows.pop()
    if not rows:
        raise ParseError(f"{source}: no actions found")
    return rows


def schedule_from_rows(
    rows: Sequence[Sequence[Action]],
    *,
    stage_to_rank: Sequence[int] | None = None,
    microbatches: int | None = None,
    name: str = "custom",
) -> Schedule:
    """A Schedule from per-rank lists; placement and microbatch count are inferred if not given."""
    if microbatches is None:
        microbatches = 1 + max((a.microbatch for acts in rows for a in acts
                                if a.microbatch is not None), default=0)
    placement = tuple(stage_to_rank) if stage_to_rank is not None else infer_stage_to_rank(rows)
    return Schedule(tuple(tuple(r) for r in rows), placement, microbatches, name,
                    routes=infer_routes(rows, microbatches))


def read_csv(path: str | Path, *, microbatches: int | None = None) -> Schedule:
    """Load a schedule from a CSV file (ours or one torch's ``_dump_csv`` wrote)."""
    path = Path(path)
    try:  # utf-8-sig: a spreadsheet's byte-order mark is not part of the first action
        text = path.read_text(encoding="utf-8-sig")
    except OSError as exc:
        raise ParseError(f"cannot read schedule file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ParseError(f"schedule file {path} is not UTF-8 text (byte {exc.start}: "
                         f"{exc.reason}); pass a CSV file") from None
    return schedule_from_rows(parse_rows(text, str(path)), microbatches=microbatches,
                              name=path.stem)


def to_csv_text(schedule: Schedule, *, compute_only: bool = False) -> str:
    """CSV text, one row per rank. ``compute_only`` drops transfer, recompute, comm and marker
    actions (what torch's ``_load_csv`` reads by default)."""
    ours = OFFLOAD_KINDS | MARKER_KINDS | {Kind.RECOMPUTE}
    comms = {Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B}
    dropped = ours | comms if compute_only else set()
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for actions in schedule.ranks:
        writer.writerow([str(a) for a in actions if a.kind not in dropped])
    return out.getvalue()


def write_csv(schedule: Schedule, path: str | Path, *, compute_only: bool = False) -> None:
    """Write ``schedule`` to ``path`` as ``to_csv_text`` gives it."""
    check_instance("write_csv: schedule", schedule, Schedule, "a Schedule")
    Path(path).write_text(to_csv_text(schedule, compute_only=compute_only))
