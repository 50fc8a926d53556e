"""Building and simulating the schedules of planner candidates, with what a search can share.

A search prices one schedule under many cost models (TP degree, microbatch size and recompute
change stage times, not the order) and one configuration under several memory options. So:
- built schedules are kept (building one at p = 32, m = 256 costs about a simulation);
- a plan without transfers is priced without the simulator: its makespan by one pass over the
  schedule's dependency graph (sim/critical.py, exactly the simulator's), its peak activation
  bytes from the order alone (planner/bounds.py, Note [kept activation]: exact without
  transfers). The graph is kept for the next cost model;
- an offload target is planned from one simulation of the bare schedule, kept for the other
  targets of the same configuration.
The last few graphs and bare simulations are kept (each holds 10^5 objects at these sizes).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import NamedTuple, TypeVar

from pipeoffload.core.registry import REGISTRY, Registry
from pipeoffload.core.schedule import Schedule
from pipeoffload.offload.plan import OffloadPlan, add_offload
from pipeoffload.offload.targets import parse_target
from pipeoffload.planner.bounds import ResidentCounts, kept_activation_floor, resident_counts
from pipeoffload.planner.class_offload import ClassTarget, offload_spec, plan_class_offload
from pipeoffload.planner.fit_bound import RankPoints, fit_points
from pipeoffload.planner.host_memory import host_peak_bytes
from pipeoffload.planner.reduced import Extrapolation, extrapolate
from pipeoffload.sim.collector import cyclic_gc_paused
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.critical import ComputeGraph
from pipeoffload.sim.simulator import SimResult, simulate

RECOMPUTE_AND_OFFLOAD = "recompute-chunks:1+all"
"""A memory option mixing both per chunk: each rank's longest-lived chunk is recomputed
(RECOMPUTE actions, offload/recompute.py), every other activation that hides is offloaded
(the offload target kind RECOMPUTE_CHUNKS_THEN_ALL, offload/targets.py)."""

#: How many dependency graphs and bare simulations a Runner keeps.
KEPT = 8

T = TypeVar("T")


def plan_memory(schedule: Schedule, costs: CostModel, option: str,
                bare: SimResult | None = None) -> OffloadPlan:
    """Plan an offload target (RECOMPUTE_AND_OFFLOAD among them) into ``schedule``; ``bare``:
    its simulation without transfers, when the caller has one."""
    return add_offload(schedule, costs, parse_target(option), base=bare)


class Run(NamedTuple):
    """One simulated microbatch count of a candidate."""

    makespan: float
    compute_time: float  # all ranks' F + I + W + B time
    peak_bytes: tuple[float, ...]  # per rank
    stall_time: float
    offloaded_fraction: float
    notes: tuple[str, ...]
    host_bytes: tuple[float, ...]  # per rank, pinned host bytes offload holds (host_memory.py)
    chosen: str | None = None  # a class plan's --offload (planner/class_offload.py)


class Simulated(NamedTuple):
    """A candidate's schedule simulated at its m (or Note [reduced simulation])."""

    counts: tuple[int, ...]
    makespan: float
    bubble_rate: float
    peak_bytes: tuple[float, ...]  # per rank, the largest over the counts
    stall_time: float
    offloaded_fraction: float
    notes: tuple[str, ...]
    host_bytes: tuple[float, ...]  # per rank, the largest over the counts
    chosen: str | None = None  # a class plan's --offload (planner/class_offload.py)


class Runner:
    """Builds (from ``registry``), keeps and simulates schedules (see the module docstring).
    ``simulations`` counts bare simulations, offload plans and graph passes."""

    def __init__(self, extrapolation: Extrapolation, registry: Registry = REGISTRY) -> None:
        self.extrapolation = extrapolation
        self.registry = registry
        self._schedules: dict[tuple, Schedule] = {}
        self._graphs: dict[Hashable, tuple[Schedule, ComputeGraph]] = {}
        self._bare: dict[Hashable, tuple[Schedule, SimResult]] = {}
        self._resident: dict[Hashable, tuple[Schedule, ResidentCounts]] = {}
        self._points: dict[Hashable, tuple[Schedule, list[RankPoints]]] = {}
        self.simulations = 0

    def schedule(self, name: str, pp: int, microbatches: int, options: dict[str, int]
                 ) -> Schedule:
        """The registry's schedule (raises ConfigError when the family rejects the shape)."""
        key = (name, pp, microbatches, tuple(sorted(options.items())))
        if key not in self._schedules:  # building pauses the collector itself (registry.py)
            self._schedules[key] = self.registry.build_schedule(name, pp, microbatches,
                                                                **options)
        return self._schedules[key]

    def resident(self, schedule: Schedule) -> ResidentCounts:
        """``bounds.resident_counts`` of ``schedule``, kept for the next stage bytes."""
        return _kept(self._resident, schedule, None, lambda: resident_counts(schedule))

    def fit_points(self, schedule: Schedule) -> list[RankPoints]:
        """``fit_bound.fit_points`` of ``schedule``, kept for the next costs."""
        return _kept(self._points, schedule, None, lambda: fit_points(schedule))

    def run(self, schedule: Schedule, costs: CostModel, option: str | ClassTarget,
            stage_bytes: list[float]) -> Run:
        """``schedule`` with memory ``option`` planned into it, simulated under ``costs``."""
        self.simulations += 1
        if isinstance(option, ClassTarget):
            return self._run_classes(schedule, costs, option)
        if option == "none":
            with cyclic_gc_paused():
                graph = _kept(self._graphs, schedule, None, lambda: ComputeGraph(schedule))
                makespan, compute = graph.makespan(costs)
            peaks = kept_activation_floor(schedule, stage_bytes, 0)
            return Run(makespan, sum(compute), tuple(peaks), 0.0, 0.0, (),
                       (0.0,) * schedule.num_ranks)
        bare = _kept(self._bare, schedule, costs, lambda: simulate(schedule, costs))
        plan = plan_memory(schedule, costs, option, bare)
        result = plan.result
        return Run(result.makespan, sum(result.compute_time), result.peak_bytes or (),
                   result.total_stall_time, plan.report.offloaded_fraction, plan.report.notes,
                   host_peak_bytes(result))

    def _run_classes(self, schedule: Schedule, costs: CostModel, target: ClassTarget) -> Run:
        """A class plan (planner/class_offload.py); its simulations counted."""
        with cyclic_gc_paused():
            found = plan_class_offload(schedule, costs, target)
        self.simulations += len(found.tried)
        result = found.plan.result
        return Run(result.makespan, sum(result.compute_time), result.peak_bytes or (),
                   result.total_stall_time, found.plan.report.offloaded_fraction,
                   found.plan.report.notes, host_peak_bytes(result), offload_spec(found))

    def simulate(self, build: Callable[[int], Schedule], costs: CostModel,
                 option: str | ClassTarget,
                 stage_bytes: list[float], microbatches: int, counts: tuple[int, ...],
                 busiest_work: float, ranks: int) -> Simulated:
        """Run each count; extrapolate to ``microbatches`` when there are three that pass
        Note [reduced simulation]'s checks, else simulate all of them (one count is taken as
        it is: the caller asked for that count only). A class plan is never extrapolated (its
        choice may differ with the count)."""
        if isinstance(option, ClassTarget) and len(counts) == 3:
            counts = (microbatches,)
        runs = [self.run(build(count), costs, option, stage_bytes) for count in counts]
        makespan = runs[0].makespan if len(runs) != 3 else None
        if len(runs) == 3 and not any(
                run.stall_time > self.extrapolation.stall_tolerance * run.makespan
                for run in runs):
            makespan = extrapolate(tuple(run.makespan for run in runs), counts, microbatches,
                                   busiest_work)
        if makespan is None:
            counts = (microbatches,)
            runs = [self.run(build(microbatches), costs, option, stage_bytes)]
            makespan = runs[0].makespan
        last = runs[-1]
        compute = last.compute_time * microbatches / counts[-1]
        bubble = 1 - compute / (ranks * makespan) if makespan > 0 else 0.0
        peaks = tuple(max(values) for values in zip(*(run.peak_bytes for run in runs)))
        host = tuple(max(values) for values in zip(*(run.host_bytes for run in runs)))
        return Simulated(counts, makespan, bubble, peaks, last.stall_time,
                         last.offloaded_fraction, last.notes, host, last.chosen)


def _kept(cache: dict[Hashable, tuple[Schedule, T]], schedule: Schedule, costs: Hashable,
          make: Callable[[], T]) -> T:
    """What ``make`` makes for (``schedule``, ``costs``), kept; the oldest entry leaves once
    KEPT are held. Keyed by the schedule's identity (hashing 10^5 actions costs as much as a
    small simulation); each entry holds its schedule, so no other can take that identity."""
    key = (id(schedule), costs)
    if key not in cache:
        if len(cache) >= KEPT:
            del cache[next(iter(cache))]
        cache[key] = (schedule, make())
    return cache[key][1]
