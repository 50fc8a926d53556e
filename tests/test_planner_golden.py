"""`pipeoffload plan` chooses the plans recorded in tests/data/planner_golden.json: the same
best plan (every dimension), step time and memory, for each of its searches. It guards work on
the search's speed, which must not change an answer; a change to the cost model rewrites the
file (python tests/data/planner_golden.py, see its docstring)."""

from __future__ import annotations

import pytest
from data_scripts import load_data_script

GOLDEN = load_data_script("planner_golden")
RECORDED = GOLDEN.load()


def test_the_golden_file_has_every_search() -> None:
    assert set(RECORDED) == set(GOLDEN.CASES)
    bests = [entry["best"] for entry in RECORDED.values()]
    assert any(not best["feasible"] for best in bests)  # the nearest-plan path
    assert {best["offload"] for best in bests} >= {"none", "chunks:1", "all"}


@pytest.mark.parametrize("name", sorted(GOLDEN.CASES))
def test_search_chooses_the_recorded_plan(name: str) -> None:
    assert GOLDEN.outcome(name) == RECORDED[name], name
