"""The registry of schedule names, and our orders against torch.distributed.pipelining's."""

from __future__ import annotations

import pytest

from pipeoffload.core import registry
from pipeoffload.core.registry import FAMILIES, build_schedule, canonical_name, schedule_names
from pipeoffload.core.text import parse_rows, schedule_from_rows
from pipeoffload.core.validate import validate
from pipeoffload.errors import ConfigError, ScheduleError
from pipeoffload.sim.simulator import simulate

CANONICAL = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "v-half", "v-min",
             "grouped-interleaved", "dualpipe", "dualpipev", "interleaved-zb", "looped-bfs",
             "torch-zbv"]


def test_schedule_names_lists_every_family_with_a_description() -> None:
    names = schedule_names()
    assert [n for n, _ in names] == CANONICAL
    assert all(isinstance(d, str) and d and "\n" not in d for _, d in names)


def test_registry_is_a_read_only_mapping() -> None:
    with pytest.raises(TypeError):
        FAMILIES["mine"] = FAMILIES["1f1b"]  # type: ignore[index]


@pytest.mark.parametrize(
    ("spelling", "canonical"),
    [
        ("1F1B", "1f1b"), ("Schedule1F1B", "1f1b"), ("GPipe", "gpipe"), ("ScheduleGPipe", "gpipe"),
        ("Interleaved1F1B", "interleaved-1f1b"), ("interleaved_1f1b", "interleaved-1f1b"),
        ("ScheduleInterleaved1F1B", "interleaved-1f1b"), ("ZBVZeroBubble", "zbv"),
        ("ScheduleZBVZeroBubble", "zbv"), ("ZB-V", "zbv"), ("zb_v", "zbv"), ("zbh1", "zb-h1"),
        ("ZB_H2", "zb-h2"), ("vhalf", "v-half"), ("V_Min", "v-min"), ("  v-MIN ", "v-min"),
        ("GroupedInterleaved", "grouped-interleaved"),
        ("grouped_interleaved", "grouped-interleaved"),
        ("group-interleaved-1f1b", "grouped-interleaved"),
        ("InterleavedZeroBubble", "interleaved-zb"), ("ScheduleLoopedBFS", "looped-bfs"),
        ("zb1p", "interleaved-zb"), ("torch_zbv", "torch-zbv"),
    ],
)
def test_name_normalisation(spelling: str, canonical: str) -> None:
    assert canonical_name(spelling) == canonical
    assert build_schedule(spelling, 4, 8).name == canonical


@pytest.mark.parametrize(("typo", "suggestion"),
                         [("zbvv", "zbv"), ("1f2b", "1f1b"), ("vmid", "v-min"),
                          ("interleved", "interleaved-1f1b")])
def test_unknown_names_suggest_the_closest_and_list_all(typo: str, suggestion: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_schedule(typo, 4, 8)
    message = str(info.value)
    assert typo in message and f"did you mean {suggestion!r}" in message
    assert all(name in message for name in CANONICAL)


def test_nonsense_name_lists_known_names_without_a_guess() -> None:
    expected = "unknown schedule 'qqqqqqqq'; known schedules: gpipe, 1f1b"
    with pytest.raises(ConfigError, match=expected):
        build_schedule("qqqqqqqq", 4, 8)
    with pytest.raises(ConfigError, match="must be a string"):
        build_schedule(3, 4, 8)  # type: ignore[arg-type]


def test_options_use_cli_names() -> None:
    schedule = build_schedule("grouped-interleaved", 4, 8, chunks=3, group_size=3)
    assert schedule.chunks == 3 and schedule.num_stages == 12
    assert build_schedule("interleaved-1f1b", 4, 8, chunks=4).num_stages == 16


def test_every_alias_is_unique_and_resolves_to_its_family() -> None:
    for name, spec in FAMILIES.items():
        for alias in (name, *spec.aliases):
            assert canonical_name(alias) == name
    assert registry.normalise("Zb_H-1 ") == "zbh1"


# --- torch.distributed.pipelining's own orders, for comparison -----------------------------

TORCH_CASES = [
    pytest.param("1F1B", "1f1b", {}, marks=pytest.mark.xfail(
        raises=ScheduleError, strict=True,
        reason="torch's drawing-only 1F1B list (pipeline_order) is not a runnable schedule: "
               "rank 1 starts at microbatch 1 and runs a microbatch m; torch runs 1F1B from "
               "loops in step(), which nothing can export")),
    ("Interleaved1F1B", "interleaved-1f1b", {"chunks": 2}),
    ("ZBVZeroBubble", "zbv", {}),
]
# torch ends single-stage schedules with REDUCE_GRAD, which is not a compute action.
_NOT_COMPUTE = ("REDUCE_GRAD",)


def torch_schedule(torch_name: str, pp: int, microbatches: int):
    visualizer = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")
    ops = visualizer.get_schedule_ops(torch_name, pp, microbatches)
    text = "\n".join(",".join(str(a) for a in rank if a is not None
                              and not any(k in str(a) for k in _NOT_COMPUTE)) for rank in ops)
    rows = parse_rows(text, source=f"torch {torch_name}")
    return schedule_from_rows(rows, microbatches=microbatches, name=torch_name)


@pytest.mark.torch
@pytest.mark.parametrize(("torch_name", "ours", "options"), TORCH_CASES)
@pytest.mark.parametrize(("pp", "microbatches"), [(2, 4), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_no_worse_than_torch(torch_name: str, ours: str, options: dict[str, int], pp: int,
                             microbatches: int) -> None:
    theirs = validate(torch_schedule(torch_name, pp, microbatches))
    mine = build_schedule(ours, pp, microbatches, **options)
    assert theirs.stage_to_rank == mine.stage_to_rank
    theirs_sim, mine_sim = simulate(theirs), simulate(mine)
    assert mine_sim.bubble_rate <= theirs_sim.bubble_rate + 1e-9
    assert max(mine_sim.peak_activation) <= max(theirs_sim.peak_activation) + 1e-9
    assert mine_sim.peak_activation[0] <= theirs_sim.peak_activation[0] + 1e-9
