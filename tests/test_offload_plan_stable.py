"""The offload planner makes the same plans as when tests/data/offload_golden.json.xz was
recorded: same schedule (CSV text), same report, same simulated timeline and memory curve, over
200 fixed random inputs (po-f / po-h / grouped-interleaved / interleaved-1f1b / zbv / dualpipev,
p = 2..8, every target kind, copy ratios, P2P latency, full and half duplex, shared links,
RELOAD and FETCH, postponing settings), and the simulator alone on every zoo family (with
SEND / RECV, RECOMPUTE, torch's markers, overlapped pairs). It guards work on the planner's and
the simulator's speed: such work must not change a plan or a timeline.
tests/data/offload_golden.py records the file.
"""

from __future__ import annotations

from typing import Any

import pytest
from data_scripts import load_data_script

GOLDEN = load_data_script("offload_golden")
RECORDED = GOLDEN.load()
ENTRIES: list[dict[str, Any]] = RECORDED["plans"]
SIMULATIONS: list[dict[str, Any]] = RECORDED["simulations"]


def test_the_golden_file_covers_the_inputs_it_claims() -> None:
    inputs = [e["input"] for e in ENTRIES]
    assert len(inputs) == GOLDEN.CASES
    assert {c["schedule"] for c in inputs} == set(GOLDEN.SCHEDULES)
    assert {c["pp"] for c in inputs} == set(range(2, 9))
    assert {c["target"].split(":")[0] for c in inputs} == {"all", "chunks", "fraction", "limit",
                                                           "none"}
    assert {c["costs"]["duplex"] for c in inputs} == {"full", "half"}
    assert {c["policy"]["fetch_on_use"] for c in inputs} == {True, False}
    outputs = [e["output"] for e in ENTRIES]
    assert sum("OFFLOAD_WAIT" in o["csv"] for o in outputs) >= 10
    assert sum("FETCH" in o["csv"] for o in outputs) >= 10
    assert sum(any(float(s) > 0 for s in o["stall_time"]) for o in outputs) >= 10


@pytest.mark.parametrize("index", range(len(ENTRIES)))
def test_plan_equals_the_recorded_one(index: int) -> None:
    entry = ENTRIES[index]
    got = GOLDEN.outcome(GOLDEN.plan_case(entry["input"]))
    want = entry["output"]
    assert got["csv"] == want["csv"], entry["input"]
    for key in want:  # one field at a time, so a failure names it
        assert got[key] == want[key], (key, entry["input"])


@pytest.mark.parametrize("index", range(len(SIMULATIONS)))
def test_simulation_equals_the_recorded_one(index: int) -> None:
    entry = SIMULATIONS[index]
    got = GOLDEN.simulate_case(entry["input"])
    for key, want in entry["output"].items():
        assert got[key] == want, (key, entry["input"]["costs"], entry["input"]["ranks"][0][:6])
