"""The compute-only pass (sim/critical.py) returns the simulator's makespan and compute time
exactly, and the order-based activation peak (planner/bounds.py) the simulator's byte peak, for
every zoo family under random costs: the planner prices plans without transfers with them."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeoffload.core import registry
from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.schedule import Schedule
from pipeoffload.errors import ConfigError, ScheduleError
from pipeoffload.offload.plan import add_offload
from pipeoffload.planner.bounds import kept_activation_floor
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.critical import ComputeGraph
from pipeoffload.sim.simulator import simulate

FAMILIES = sorted(registry.FAMILIES)


@st.composite
def zoo(draw: st.DrawFn) -> Schedule:
    name = draw(st.sampled_from(FAMILIES))
    pp = draw(st.integers(1, 6)) if name in ("1f1b", "gpipe") else draw(st.integers(2, 6))
    if name == "dualpipe":
        pp += pp % 2
    options = {}
    if name in ("interleaved-1f1b", "grouped-interleaved"):
        options["chunks"] = draw(st.integers(2, 3))
    if name == "grouped-interleaved":
        options["group_size"] = draw(st.sampled_from([math.ceil(pp / 2), pp]))
    microbatches = draw(st.integers(1, 5 * pp))
    try:
        return registry.build_schedule(name, pp, microbatches, **options)
    except ConfigError:
        return registry.build_schedule(name, pp, 2 * pp, **options)


@st.composite
def costs_for(draw: st.DrawFn, stages: int) -> CostModel:
    time = st.floats(0.0, 3.0)
    return CostModel(f_time=draw(time), i_time=draw(time), w_time=draw(time),
                     p2p_time=draw(st.sampled_from([0.0, 0.1, 1.7])),
                     stage_time_scale=tuple(draw(st.lists(st.floats(0.2, 2.5), min_size=stages,
                                                          max_size=stages))),
                     stage_activation_bytes=tuple(draw(st.lists(
                         st.floats(1.0, 1e9), min_size=stages, max_size=stages))))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(zoo(), st.data())
def test_compute_graph_equals_the_simulator(schedule: Schedule, data: st.DataObject) -> None:
    costs = data.draw(costs_for(schedule.num_stages))
    result = simulate(schedule, costs)
    graph = ComputeGraph(schedule)
    assert graph.makespan(costs) == (result.makespan, result.compute_time)
    # One graph serves other costs too (the planner prices one schedule many times).
    other = data.draw(costs_for(schedule.num_stages))
    assert graph.makespan(other) == (simulate(schedule, other).makespan,
                                     simulate(schedule, other).compute_time)
    peaks = kept_activation_floor(schedule, costs.stage_activation_bytes, 0)
    assert peaks == pytest.approx(result.peak_bytes, rel=1e-12, abs=1e-3)


def test_compute_graph_refuses_transfers_and_deadlocks() -> None:
    planned = add_offload(registry.build_schedule("zbv", 2, 4),
                          CostModel(offload_ratio=0.1), "all").schedule
    assert planned.has_kind(Kind.OFFLOAD)
    with pytest.raises(ScheduleError, match="simulate it instead"):
        ComputeGraph(planned)
    stuck = Schedule([[Action(0, Kind.B, 0), Action(0, Kind.F, 0)]], (0,), 1)
    with pytest.raises(ScheduleError, match="deadlocks"):
        ComputeGraph(stuck)
    with pytest.raises(ValueError, match="overlapped"):
        ComputeGraph(registry.build_schedule("1f1b", 2, 2)).makespan(CostModel(overlap_f_b=0.5))
