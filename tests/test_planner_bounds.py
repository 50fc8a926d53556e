"""The lower bounds the search prunes with hold against full simulations (Note: [makespan lower
bound], planner/bounds.py; Note: [branch and bound], planner/search.py): over random schedules,
shapes and costs, with and without offload and recomputation, the bound never exceeds the
simulated makespan, offloading never makes a schedule faster, and the planner's time and memory
bounds stay below what a full evaluation prices."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeoffload.core import registry
from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.schedule import Placement
from pipeoffload.errors import ConfigError
from pipeoffload.offload.plan import OffloadPolicy, add_offload
from pipeoffload.offload.recompute import add_recompute
from pipeoffload.planner.bounds import (
    _uncovered,
    kept_activation_floor,
    kept_floor,
    makespan_lower_bound,
    resident_counts,
    stage_durations,
)
from pipeoffload.planner.costing import DEFAULT_FRAMEWORK, GIB, Framework, MemoryConfig
from pipeoffload.planner.evaluate import RECOMPUTE_AND_OFFLOAD, Candidate, Evaluator
from pipeoffload.planner.fit_bound import fit_points, fitting_makespan_bound
from pipeoffload.planner.hardware import hardware_preset
from pipeoffload.planner.layer_work import NormKernel
from pipeoffload.planner.optimizer import DP_COPY_BYTES, OptimizerSpec
from pipeoffload.planner.reduced import Extrapolation
from pipeoffload.planner.transformer import MlpKind, Recompute, TransformerSpec
from pipeoffload.sim.costs import CostModel, Duplex, HostLink
from pipeoffload.sim.simulator import simulate

FAMILIES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "v-half", "v-min",
            "grouped-interleaved", "dualpipev")
V_SHAPED = {n for n, f in registry.FAMILIES.items() if f.placement is Placement.V}
CHUNKED = {n for n, f in registry.FAMILIES.items() if "chunks" in f.options}
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


@slow
@given(schedules_and_costs(), st.integers(0, 3), st.data())
def test_kept_floor_from_resident_counts_equals_the_pass_over_the_order(
        case, offloaded: int, data: st.DataObject) -> None:
    """The search's cached form of the kept-activation bound (a few count vectors per rank)
    gives the per-action pass's answer for any stage bytes and any number of chunks offloaded."""
    schedule, _ = case
    counts = resident_counts(schedule)
    for _ in range(2):
        sizes = data.draw(st.lists(st.floats(0.0, 1e9), min_size=schedule.num_stages,
                                   max_size=schedule.num_stages))
        assert kept_floor(counts, sizes, offloaded) == pytest.approx(
            kept_activation_floor(schedule, sizes, offloaded), rel=1e-12, abs=1e-3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules_and_costs(), st.sampled_from(["all", "chunks:1", "fraction:1"]),
       st.sampled_from([OffloadPolicy(), OffloadPolicy(postpone_slack=0.5),
                        OffloadPolicy(max_pending_offloads=None),
                        OffloadPolicy(fetch_on_use=True)]),
       st.floats(1.0, 1.5))
def test_a_plan_that_fits_is_no_faster_than_its_fitting_bound(case, target: str, policy,
                                                              slack: float) -> None:
    """Note: [fitting time]: with each rank's room set to the peak the offload plan reaches
    (times ``slack``: the plan fits), the plan's makespan is at least the bound. Rooms that
    tight make the bound as large as it gets for this plan; the bound must also see that a
    plan without transfers cannot fit in less than its own peak."""
    schedule, costs = case
    planned = add_offload(schedule, costs, target, policy).result
    peaks = planned.peak_bytes
    counts = fit_points(schedule)
    rooms = [peak * slack for peak in peaks]
    bound = fitting_makespan_bound(counts, costs, schedule.stage_to_rank, rooms)
    assert bound <= planned.makespan
    bare = simulate(schedule, costs)
    below = [peak * 0.999 - 1e-9 for peak in bare.peak_bytes]
    without_copies = dataclasses.replace(costs, d2h_bytes_per_s=1e-300, offload_ratio=None)
    if max(bare.peak_bytes) > 0:
        assert fitting_makespan_bound(counts, without_copies, schedule.stage_to_rank,
                                      below) > bare.makespan


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules_and_costs())
def test_stage_durations_are_the_cost_models(case) -> None:
    """The bounds' per-stage durations are ``compute_time``'s, bit for bit."""
    _, costs = case
    stages = len(costs.stage_time_scale)
    durations = stage_durations(costs, stages + 1)
    for kind, times in zip((Kind.F, Kind.I, Kind.W, Kind.B), durations):
        assert times == [costs.compute_time(Action(s, kind, 0)) for s in range(stages + 1)]


def test_split_backward_families_are_the_ones_with_w() -> None:
    """The bound's tail assumes a split backward for the families that declare one."""
    for name, family in registry.FAMILIES.items():
        has_w = registry.build_schedule(name, 4, 8).has_kind(Kind.W)
        assert family.split_backward == has_w, name


def test_bound_is_exact_for_1f1b_with_equal_stages() -> None:
    """With equal stages and free P2P, 1F1B's makespan is (m + p - 1)(F + B): the bound's
    tail term reaches it, so it prunes with the bubble, not only the work."""
    costs = CostModel(f_time=1.0, i_time=1.0, w_time=1.0)
    schedule = registry.build_schedule("1f1b", 8, 32)
    bound = makespan_lower_bound(costs, schedule.stage_to_rank, 32, split_backward=False)
    assert bound == simulate(schedule, costs).makespan == (32 + 7) * 3


PLANNED = ("1f1b", "interleaved-1f1b", "zb-h1", "zbv", "v-half", "v-min",
           "grouped-interleaved")
#: The frameworks the planner prices: its default, Narayanan et al. 2021's Megatron (no SP, no
#: TP overlap, blocking P2P) and Korthikanti et al. 2022's (blocking P2P) (planner/published.py).
FRAMEWORKS = (DEFAULT_FRAMEWORK,
              Framework(sequence_parallel=False, tp_overlap=False, p2p_blocking=True,
                        norm_kernel=NormKernel.APEX),
              Framework(p2p_blocking=True))
OPTIMIZERS = (OptimizerSpec(), OptimizerSpec(grad_bytes=2, overlap_grad_reduce=True,
                                             dp_copy_bytes=DP_COPY_BYTES["torch-ddp-fp16"]),
              OptimizerSpec(sharded=True, overlap_grad_reduce=True),
              OptimizerSpec(dp_copy_bytes=DP_COPY_BYTES["megatron-local-2022"]))


@st.composite
def planner_cases(draw: st.DrawFn):
    """A model, a layout, a schedule and the planner's options, drawn broadly."""
    head_dim = draw(st.sampled_from([64, 128]))
    heads = draw(st.sampled_from([8, 16, 32, 64]))
    hidden = heads * head_dim
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if heads % t == 0]))
    pp = draw(st.integers(2, 5))
    name = draw(st.sampled_from(PLANNED))
    chunks = 2 if name in V_SHAPED else draw(st.integers(2, 4)) if name in CHUNKED else 1
    spec = TransformerSpec(
        num_layers=pp * chunks * draw(st.integers(1, 3)) + draw(st.integers(0, 2)),
        hidden=hidden, heads=heads, kv_heads=draw(st.sampled_from([heads, heads // 8])),
        ffn_hidden=draw(st.sampled_from([4 * hidden, 3 * hidden + hidden // 2])),
        vocab=draw(st.sampled_from([32000, 50257, 128256])),
        seq_len=draw(st.sampled_from([512, 2048, 8192])), mlp=draw(st.sampled_from(MlpKind)),
        flash_attention=draw(st.booleans()), dropout=draw(st.booleans()),
        bias=draw(st.booleans()), tied_embeddings=draw(st.booleans()))
    microbatches = pp * draw(st.integers(1, 9)) + (0 if name == "interleaved-1f1b"
                                                   else draw(st.integers(0, pp - 1)))
    group = None
    if name == "grouped-interleaved":
        group = draw(st.sampled_from([math.ceil(pp / 2), pp]))
    offload = draw(st.sampled_from(["none", "chunks:1", "all", RECOMPUTE_AND_OFFLOAD]))
    if chunks < 2 and offload in ("chunks:1", RECOMPUTE_AND_OFFLOAD):
        offload = "all"
    candidate = Candidate(name, draw(st.sampled_from([1, 2, 8, 64])), tp, pp, chunks,
                          draw(st.sampled_from([1, 2, 4])), microbatches,
                          draw(st.sampled_from(Recompute)), offload, group)
    return (spec, hardware_preset(draw(st.sampled_from(["a100-80gb", "h100-80gb", "h200"]))),
            MemoryConfig(optimizer=draw(st.sampled_from(OPTIMIZERS))),
            draw(st.sampled_from(FRAMEWORKS)), candidate)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planner_cases())
def test_planner_bounds_stay_below_a_full_evaluation(case) -> None:
    """Over models, hardware, frameworks, optimizers, layouts, schedules, recompute and offload:
    the search's time and memory bounds never exceed a full evaluation under the step-time model
    (issue 21's terms included), and an offloaded plan is never faster than its sibling without
    offload (what the search's sibling keys rely on)."""
    spec, hw, memory, framework, candidate = case

    def evaluator(extrapolation: Extrapolation) -> Evaluator:
        return Evaluator(spec, hw, memory, 80 * GIB, extrapolation, framework=framework)

    full = evaluator(Extrapolation(enabled=False))
    try:
        plan = full.evaluate(candidate)
    except ConfigError:  # a shape the family rejects
        return
    assert full.time_bound(candidate) <= plan.step_time * (1 + 1e-9)
    assert full.state_and_floor(candidate) <= plan.memory.total * (1 + 1e-9)
    assert full.memory_bound(candidate) <= plan.memory.total
    # Note: [fitting time]: with the plan's own memory as the budget it fits, so its step time
    # is at least the fitting bound.
    tight = Evaluator(spec, hw, memory, plan.memory.total, Extrapolation(enabled=False),
                      framework=framework)
    assert tight.fitting_time_bound(candidate) <= plan.step_time
    if candidate.offload == "none":  # the order fixes the peak of a plan without transfers
        assert full.memory_bound(candidate) == pytest.approx(plan.memory.total, rel=2e-9)
    else:
        free = full.evaluate(dataclasses.replace(candidate, offload="none"))
        assert plan.step_time >= free.step_time * (1 - 1e-9)
    # The search bounds reduced and full evaluations by the smallest count's order.
    reduced = evaluator(Extrapolation(min_factor=1))
    assert reduced.memory_bound(candidate) <= reduced.evaluate(candidate).memory.total
    assert reduced.memory_bound(candidate) <= plan.memory.total


@given(schedules_and_costs(), st.data())
def test_kept_floor_without_offload_is_the_running_totals_peak(case, data: st.DataObject
                                                                ) -> None:
    """With nothing offloaded the bound is the peak of the bytes resident after each forward,
    added at each F and taken away at each W / B in program order, bit for bit (the search
    prices offload-free plans with it)."""
    schedule, _ = case
    sizes = data.draw(st.lists(st.floats(0.0, 1e9), min_size=schedule.num_stages,
                               max_size=schedule.num_stages))
    expected = []
    for actions in schedule.ranks:
        total = peak = 0.0
        for stage, kind, _ in actions:
            if kind is Kind.F:
                total += sizes[stage]
                peak = max(peak, total)
            elif kind in (Kind.W, Kind.B):
                total -= sizes[stage]
        expected.append(peak)
    assert kept_activation_floor(schedule, sizes, 0) == expected


@given(st.sets(st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(0, 6)), min_size=1,
               max_size=40),
       st.lists(st.floats(0.0, 1e9), min_size=3, max_size=3), st.integers(0, 2))
def test_uncovered_vectors_hold_the_largest_dot_product_bit_for_bit(vectors, sizes, offloaded
                                                                   ) -> None:
    """resident_counts keeps only vectors no other covers; kept_floor over them equals
    kept_floor over every vector exactly, for any sizes >= 0 and chunks offloaded."""
    stages = (0, 1, 2)
    everything = kept_floor([(stages, tuple(vectors))], sizes, offloaded)
    assert kept_floor([(stages, _uncovered(vectors))], sizes, offloaded) == everything
    assert set(_uncovered(vectors)) <= vectors
