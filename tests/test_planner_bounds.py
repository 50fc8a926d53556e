"""The lower bounds the search prunes with hold against full simulations (Note: [makespan lower
bound], planner/bounds.py; Note: [branch and bound], planner/search.py): over random schedules,
shapes and costs, with and without offload and recomputation, the bound never exceeds the
simulated makespan, offloading never makes a schedule faster, and the planner's time and memory
bounds stay below what a full evaluation prices."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeoffload.core import registry
from pipeoffload.core.actions import Kind
from pipeoffload.errors import ConfigError
from pipeoffload.offload.plan import add_offload
from pipeoffload.offload.recompute import add_recompute
from pipeoffload.planner.bounds import makespan_lower_bound
from pipeoffload.planner.costing import GIB, MemoryConfig
from pipeoffload.planner.evaluate import (
    CHUNKED,
    RECOMPUTE_AND_OFFLOAD,
    V_SHAPED,
    WHOLE_BACKWARD,
    Candidate,
    Evaluator,
)
from pipeoffload.planner.hardware import hardware_preset
from pipeoffload.planner.reduced import Extrapolation
from pipeoffload.planner.transformer import MlpKind, Recompute, TransformerSpec
from pipeoffload.sim.costs import CostModel, Duplex, HostLink
from pipeoffload.sim.simulator import simulate

FAMILIES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "v-half", "v-min",
            "grouped-interleaved", "dualpipev")
slow = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _options(name: str, pp: int, chunks: int, group: str) -> dict[str, int]:
    options = {}
    if name in CHUNKED:
        options["chunks"] = chunks
    if name == "grouped-interleaved":
        options["group_size"] = math.ceil(pp / 2) if group == "min" else pp
    return options


@st.composite
def schedules_and_costs(draw: st.DrawFn):
    name = draw(st.sampled_from(FAMILIES))
    pp = draw(st.integers(2, 6))
    options = _options(name, pp, draw(st.integers(2, 3)), draw(st.sampled_from(["min", "max"])))
    microbatches = draw(st.integers(1, 4 * pp))
    if name == "interleaved-1f1b":
        microbatches = pp * draw(st.integers(1, 4))
    try:
        schedule = registry.build_schedule(name, pp, microbatches, **options)
    except ConfigError:
        schedule = registry.build_schedule(name, pp, 2 * pp, **options)
    stages = schedule.num_stages
    times = st.floats(0.05, 3.0)
    costs = CostModel(
        f_time=draw(times), i_time=draw(times), w_time=draw(st.floats(0.0, 3.0)),
        p2p_time=draw(st.sampled_from([0.0, 0.05, 0.7, 3.0])),
        stage_time_scale=tuple(draw(st.lists(st.floats(0.2, 2.5), min_size=stages,
                                             max_size=stages))),
        offload_ratio=draw(st.sampled_from([None, 0.3, 1.5])),
        activation_bytes=1.0,
        d2h_bytes_per_s=draw(st.sampled_from([0.5, 4.0])), h2d_bytes_per_s=2.0,
        host_link=HostLink(draw(st.sampled_from(list(Duplex))), draw(st.integers(1, 2))))
    return schedule, costs


@slow
@given(schedules_and_costs(), st.sampled_from(["none", "all", "chunks:1", "fraction:1",
                                               "recompute"]))
def test_makespan_bound_holds_for_any_schedule_costs_and_offload(case, memory: str) -> None:
    schedule, costs = case
    bare = simulate(schedule, costs).makespan
    if memory == "recompute":
        planned = simulate(add_recompute(schedule, costs, "chunks:1").schedule, costs)
    else:
        planned = add_offload(schedule, costs, memory).result
    split = schedule.has_kind(Kind.W)
    bound = makespan_lower_bound(costs, schedule.stage_to_rank, schedule.microbatches, split)
    assert bound <= bare * (1 + 1e-9)
    if memory == "recompute":
        again = makespan_lower_bound(costs, schedule.stage_to_rank, schedule.microbatches,
                                     split, recomputed_chunk=True)
        assert bound <= again <= planned.makespan * (1 + 1e-9)
    # What the search relies on besides the bound: planning memory never speeds compute up.
    assert planned.makespan >= bare * (1 - 1e-9)


def test_whole_backward_families_are_the_ones_without_w() -> None:
    """The bound's tail assumes a split backward except for WHOLE_BACKWARD's families."""
    for name in registry.FAMILIES:
        has_w = registry.build_schedule(name, 4, 8).has_kind(Kind.W)
        assert (name in WHOLE_BACKWARD) == (not has_w), name


def test_bound_is_exact_for_1f1b_with_equal_stages() -> None:
    """With equal stages and free P2P, 1F1B's makespan is (m + p - 1)(F + B): the bound's
    tail term reaches it, so it prunes with the bubble, not only the work."""
    costs = CostModel(f_time=1.0, i_time=1.0, w_time=1.0)
    schedule = registry.build_schedule("1f1b", 8, 32)
    bound = makespan_lower_bound(costs, schedule.stage_to_rank, 32, split_backward=False)
    assert bound == simulate(schedule, costs).makespan == (32 + 7) * 3


SPEC = TransformerSpec(num_layers=12, hidden=2048, heads=16, kv_heads=16, ffn_hidden=8192,
                       vocab=32000, seq_len=4096, mlp=MlpKind.GELU, name="small")
PLANNED = ("1f1b", "interleaved-1f1b", "zb-h1", "zbv", "v-half", "v-min",
           "grouped-interleaved")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PLANNED), st.sampled_from([(1, 2, 2), (2, 2, 1), (1, 4, 1), (1, 3, 2)]),
       st.integers(1, 3), st.sampled_from(list(Recompute)),
       st.sampled_from(["none", "chunks:1", "all", RECOMPUTE_AND_OFFLOAD]),
       st.sampled_from(["a100-80gb", "h100-80gb"]))
def test_planner_bounds_stay_below_a_full_evaluation(name: str, layout: tuple[int, int, int],
                                                     groups: int, recompute: Recompute,
                                                     offload: str, hardware: str) -> None:
    dp, tp, pp = layout
    chunks = 2 if name in V_SHAPED or name in CHUNKED else 1
    microbatches = pp * groups * 4
    group = pp if name == "grouped-interleaved" else None
    if chunks < 2 and offload in ("chunks:1", RECOMPUTE_AND_OFFLOAD):
        offload = "all"
    candidate = Candidate(name, dp, tp, pp, chunks, 1, microbatches, recompute, offload, group)
    evaluator = Evaluator(SPEC, hardware_preset(hardware), MemoryConfig(), 80 * GIB,
                          Extrapolation(enabled=False))
    plan = evaluator.evaluate(candidate)
    assert evaluator.time_bound(candidate) <= plan.step_time * (1 + 1e-9)
    assert evaluator.state_and_floor(candidate) <= plan.memory.total * (1 + 1e-9)
    assert evaluator.memory_bound(candidate) <= plan.memory.total
    if offload == "none":  # the order fixes the peak of a plan without transfers
        assert evaluator.memory_bound(candidate) == pytest.approx(plan.memory.total, rel=2e-9)
    # The search bounds reduced evaluations by the smallest count's order.
    reduced = Evaluator(SPEC, hardware_preset(hardware), MemoryConfig(), 80 * GIB,
                        Extrapolation(min_factor=1))
    assert reduced.memory_bound(candidate) <= reduced.evaluate(candidate).memory.total
