"""Chrome / Perfetto trace JSON of a simulation, to browse a schedule in ui.perfetto.dev or
chrome://tracing next to traces of real runs.

Layout: one process (pid) per rank, one thread (tid) per lane: compute, d2h (OFFLOAD copies),
h2d (RELOAD copies, FETCH reads), comm (SEND / RECV, zero-length in the simulator). Every timed
action is one complete ("X") event named like "F s2 mb3"; each rank's resident activation is a
counter ("C") series in M_a units, plus one in bytes when the cost model knows activation sizes.

Time: trace timestamps are microseconds. The simulator's clock has whatever unit the cost model
was written in; by default one simulator unit is mapped to one second (``time_scale_us =
1e6``), which is right when costs come from bytes and bytes-per-second bandwidths, and shows the
papers' unit slots (T_F = 1) as one second each. Pass ``time_scale_us`` to map it otherwise,
e.g. 1000 when the cost model's times are milliseconds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pipeoffload.errors import ConfigError
from pipeoffload.sim.memory import memory_events
from pipeoffload.sim.simulator import Lane, SimResult

DEFAULT_TIME_SCALE_US = 1e6
MEMORY_COUNTER = "activation (M_a)"
BYTES_COUNTER = "activation (bytes)"
LANE_TID = {Lane.COMPUTE: 0, Lane.D2H: 1, Lane.H2D: 2, Lane.COMM: 3}


def to_chrome_trace(result: SimResult, time_scale_us: float = DEFAULT_TIME_SCALE_US
                    ) -> dict[str, Any]:
    """The trace as a JSON-ready dict: ``{"traceEvents": [...], "displayTimeUnit": "ms",
    "otherData": {...}}``; ``ts`` and ``dur`` are simulator times times ``time_scale_us``."""
    if not (time_scale_us > 0 and math.isfinite(time_scale_us)):
        raise ConfigError(
            f"time_scale_us must be a positive number of microseconds per simulator time unit, "
            f"got {time_scale_us}"
        )
    schedule = result.schedule
    events: list[dict[str, Any]] = []
    for rank in range(schedule.num_ranks):
        lanes = {t.lane for t in result.timeline[rank]}
        events += _metadata(rank, sorted(lanes, key=LANE_TID.__getitem__))
    for rank, row in enumerate(result.timeline):
        for item in row:
            stage, kind, microbatch = item.action
            events.append({
                "name": f"{kind.value} s{stage} mb{microbatch}",
                "cat": item.lane.value,
                "ph": "X",
                "ts": item.start * time_scale_us,
                "dur": (item.end - item.start) * time_scale_us,
                "pid": rank,
                "tid": LANE_TID[item.lane],
                "args": {
                    "action": str(item.action),
                    "stage": stage,
                    "chunk": schedule.chunk_of(stage),
                    "microbatch": microbatch,
                    "kind": kind.value,
                },
            })
    for rank, curve in enumerate(result.memory):
        for time, units in curve:
            events.append(_counter(rank, MEMORY_COUNTER, time * time_scale_us, "resident", units))
    if result.peak_bytes is not None:
        sizes = tuple(float(result.costs.bytes_of(s) or 0.0) for s in range(schedule.num_stages))
        for rank, row in enumerate(result.timeline):
            level = 0.0
            events.append(_counter(rank, BYTES_COUNTER, 0.0, "bytes", level))
            for time, delta in memory_events(schedule, row, sizes, result.costs):
                level += delta
                events.append(_counter(rank, BYTES_COUNTER, time * time_scale_us, "bytes", level))
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": schedule.name,
            "pp": schedule.num_ranks,
            "chunks": schedule.chunks,
            "microbatches": schedule.microbatches,
            "makespan": result.makespan,
            "bubble_rate": result.bubble_rate,
            "peak_activation": list(result.peak_activation),
            "stall_time": list(result.stall_time),
            "time_scale_us": time_scale_us,
        },
    }


def write_trace(result: SimResult, path: str | Path,
                time_scale_us: float = DEFAULT_TIME_SCALE_US) -> Path:
    """Write ``to_chrome_trace(result)`` to ``path`` as JSON and return the path."""
    path = Path(path)
    trace = to_chrome_trace(result, time_scale_us)
    path.write_text(json.dumps(trace, indent=None, separators=(",", ":")), encoding="utf-8")
    return path


def _metadata(rank: int, lanes: list[Lane]) -> list[dict[str, Any]]:
    """Names and sort order so Perfetto lists ranks and lanes in order."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
        {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}},
    ]
    for lane in lanes:
        tid = LANE_TID[lane]
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                       "args": {"name": lane.value}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid,
                       "args": {"sort_index": tid}})
    return events


def _counter(rank: int, name: str, ts: float, series: str, value: float) -> dict[str, Any]:
    return {"name": name, "ph": "C", "ts": ts, "pid": rank, "args": {series: value}}
