"""One candidate configuration, simulated: step time, MFU and per-device memory.

A ``Candidate`` (planner/candidate.py) names everything the planner chooses (layout, schedule,
offload, recompute, microbatching); ``Evaluator.evaluate`` prices it with ``costing``, builds
the schedule from its registry, plans offload into it with ``offload.plan.add_offload`` and
simulates it. What the evaluator needs to know of a schedule family (placement, split backward,
deferred W) it reads from the family's ``FamilySpec``.

Large microbatch counts are simulated in fewer microbatches and extrapolated
(planner/reduced.py, Note [reduced simulation]); ``time_bound`` and ``state_and_floor`` are the
lower bounds the search prunes with (planner/bounds.py, Note [makespan lower bound]).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeoffload.core.families.base import FamilySpec
from pipeoffload.core.registry import REGISTRY, Registry
from pipeoffload.core.schedule import Schedule
from pipeoffload.errors import ConfigError
from pipeoffload.offload.targets import TargetKind, parse_target
from pipeoffload.planner.bounds import kept_floor, makespan_lower_bound
from pipeoffload.planner.candidate import Candidate as Candidate  # re-export
from pipeoffload.planner.class_offload import (
    CLASS_OFFLOAD,
    ClassTarget,
    searchable,
    stage_classes,
)
from pipeoffload.planner.costing import (
    DEFAULT_FRAMEWORK,
    GIB,
    Framework,
    Layout,
    MemoryConfig,
    cost_model,
    dp_seconds,
    optimizer_seconds,
    peak_flops,
    rank_state,
    run_parts,
    stage_costs,
    step_model_flops,
)
from pipeoffload.planner.fit_bound import fitting_makespan_bound
from pipeoffload.planner.hardware import Hardware
from pipeoffload.planner.host_memory import node_host_bytes
from pipeoffload.planner.layer_time import RunConfig
from pipeoffload.planner.optimizer import StateBytes
from pipeoffload.planner.ratio import PieceCost
from pipeoffload.planner.reduced import Extrapolation as Extrapolation  # re-export
from pipeoffload.planner.runs import RECOMPUTE_AND_OFFLOAD as RECOMPUTE_AND_OFFLOAD  # re-export
from pipeoffload.planner.runs import Runner
from pipeoffload.planner.runs import plan_memory as plan_memory  # re-export
from pipeoffload.planner.transformer import TransformerSpec
from pipeoffload.sim.costs import CostModel


@dataclass(frozen=True)
class MemorySplit:
    """Bytes on the fullest device: weights, gradients, optimizer state, peak activations and
    the fixed reserve (MemoryConfig.reserve_bytes)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    reserve: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.reserve

    def largest_part(self) -> tuple[str, float]:
        parts = {"activations": self.activations, "optimizer state": self.optimizer,
                 "gradients": self.grads, "parameters": self.params}
        name = max(parts, key=lambda key: parts[key])
        return name, parts[name]


@dataclass(frozen=True)
class Plan:
    """A simulated candidate. Times in seconds; ``pipeline_time`` is the simulated makespan,
    ``mfu`` model FLOPs utilization counting the full s x s attention square (Megatron's
    convention), ``mfu_causal`` counting the half of it a causal kernel runs;
    ``dp_time`` the exposed data-parallel exchange and ``optimizer_time`` the optimizer step,
    both after it (optimizer.py, Note [step outside the pipeline]). ``host_bytes`` is the pinned
    host memory offload needs on the fullest GPU and ``host_node_bytes`` on the fullest node
    (host_memory.py), checked against ``host_budget_bytes`` per node."""

    candidate: Candidate
    pipeline_time: float
    dp_time: float
    mfu: float
    memory: MemorySplit
    budget_bytes: float
    bubble_rate: float
    stall_time: float
    offloaded_fraction: float
    simulated_microbatches: tuple[int, ...]
    notes: tuple[str, ...] = field(default=())
    optimizer_time: float = 0.0
    mfu_causal: float = 0.0
    host_bytes: float = 0.0
    host_node_bytes: float = 0.0
    host_budget_bytes: float = 0.0
    offload_spec: str | None = None
    """The ``--offload`` that runs this plan when the candidate's option is searched (a class
    plan's classes, planner/class_offload.py); None: the candidate's own."""

    @property
    def step_time(self) -> float:
        return self.pipeline_time + self.dp_time + self.optimizer_time

    @property
    def memory_gib(self) -> float:
        return self.memory.total / GIB

    @property
    def fits_device(self) -> bool:
        return self.memory.total <= self.budget_bytes

    @property
    def fits_host(self) -> bool:
        """Pinned host memory per node within its budget (0: not checked)."""
        return not self.host_budget_bytes or self.host_node_bytes <= self.host_budget_bytes

    @property
    def feasible(self) -> bool:
        return self.fits_device and self.fits_host

    @property
    def extrapolated(self) -> bool:
        return self.simulated_microbatches != (self.candidate.microbatches,)


class Evaluator:
    """Prices and simulates candidates of one model on one GPU; caches stage costs, cost
    models, bounds and built schedules (none depends on another candidate's costs), so a search
    reuses them. ``registry``: where candidates' schedules are built from and declared."""

    def __init__(self, spec: TransformerSpec, hw: Hardware, memory: MemoryConfig,
                 budget_bytes: float, extrapolation: Extrapolation | None = None,
                 framework: Framework = DEFAULT_FRAMEWORK, host_budget_bytes: float = 0.0,
                 registry: Registry = REGISTRY) -> None:
        self.spec, self.hw, self.memory = spec, hw, memory
        self.registry = registry
        self.budget_bytes = budget_bytes
        self.host_budget_bytes = host_budget_bytes
        self.extrapolation = extrapolation or Extrapolation()
        self.framework = framework
        # By _layout_key, which hashes faster than a Layout.
        self._layouts: dict[tuple[object, ...], Layout] = {}
        self._pieces: dict[tuple[object, ...], tuple[PieceCost, ...]] = {}
        self._costs: dict[tuple[object, ...], CostModel] = {}
        self._parts: dict[RunConfig, tuple[PieceCost, PieceCost, PieceCost]] = {}
        self._bounds: dict[tuple[object, ...], float] = {}
        # Plans by (candidate, counts simulated): the verdict's second search asks again.
        self._plans: dict[tuple[Candidate, tuple[int, ...]], Plan] = {}
        self.runner = Runner(self.extrapolation, registry)

    @property
    def simulations(self) -> int:
        """Simulator runs so far (bare, offload plans, compute-only passes)."""
        return self.runner.simulations

    def family(self, candidate: Candidate) -> FamilySpec:
        """The declaration of the candidate's schedule family (ConfigError if unknown)."""
        return self.registry.family(candidate.schedule)

    def _layout_key(self, candidate: Candidate) -> tuple[object, ...]:
        """What ``Candidate.layout_under`` reads of a candidate (one framework per Evaluator);
        hashes faster than a Layout."""
        return (candidate.dp, candidate.tp, candidate.pp, candidate.chunks,
                candidate.micro_batch, candidate.recompute, self.family(candidate).w_deferred,
                candidate.cp)

    def layout(self, candidate: Candidate) -> Layout:
        key = self._layout_key(candidate)
        if key not in self._layouts:
            self._layouts[key] = candidate.layout_under(self.framework, self.family(candidate))
        return self._layouts[key]

    def pieces(self, candidate: Candidate) -> tuple[PieceCost, ...]:
        key = self._layout_key(candidate)
        if key not in self._pieces:
            layout = self.layout(candidate)
            if layout.run not in self._parts:
                self._parts[layout.run] = run_parts(self.spec, self.hw, layout.run)
            self._pieces[key] = stage_costs(self.spec, self.hw, layout, self._parts[layout.run])
        return self._pieces[key]

    def costs(self, candidate: Candidate) -> CostModel:
        """The simulator's cost model of the candidate's layout."""
        key = self._layout_key(candidate)
        if key not in self._costs:
            self._costs[key] = cost_model(self.pieces(candidate), self.spec, self.hw,
                                          self.layout(candidate))
        return self._costs[key]

    def schedule(self, candidate: Candidate, microbatches: int) -> Schedule:
        """The compute schedule (raises ConfigError when the family rejects the shape)."""
        return self.runner.schedule(candidate.schedule, candidate.pp, microbatches,
                                    candidate.options())

    def stage_to_rank(self, candidate: Candidate) -> tuple[int, ...]:
        """Where the candidate's stages sit, from its family's placement (nothing built)."""
        return self.family(candidate).stage_to_rank(candidate.pp, candidate.chunks)

    def state_and_floor(self, candidate: Candidate) -> float:
        """A lower bound of the device memory: model state, the reserve, and the largest stage
        activation of one microbatch (a forward holds it whatever is offloaded)."""
        key = ("memory", self._layout_key(candidate), self.family(candidate).placement)
        if key not in self._bounds:
            pieces = self.pieces(candidate)
            placement = self.stage_to_rank(candidate)
            states = rank_state(self.spec, pieces, placement, self.layout(candidate),
                                self.memory)
            floor = [0.0] * candidate.pp
            for stage, piece in enumerate(pieces):
                rank = placement[stage]
                floor[rank] = max(floor[rank], piece.activation_bytes)
            self._bounds[key] = (max(s.total + f for s, f in zip(states, floor))
                                 + self.memory.reserve_bytes)
        return self._bounds[key]

    def memory_bound(self, candidate: Candidate) -> float:
        """A lower bound of the memory ``evaluate`` prices, from the order of the schedule at
        the reduced simulation's smallest count (``Extrapolation.first_count``; past the
        warm-up more microbatches add no resident activation, tested against full
        evaluations) (planner/bounds.py, Note [kept activation]): exact for offload none, the
        best choice of stages for chunks:K; the state floor for other targets."""
        if candidate.offload == CLASS_OFFLOAD:
            return self.state_and_floor(candidate)
        target = parse_target(candidate.offload)
        if target.kind not in (TargetKind.NONE, TargetKind.CHUNKS):
            return self.state_and_floor(candidate)
        offloaded = int(target.value) if target.kind is TargetKind.CHUNKS else 0
        count = self.extrapolation.first_count(candidate.microbatches, candidate.pp,
                                               candidate.period()) or candidate.microbatches
        schedule = self.schedule(candidate, count)
        floors = kept_floor(self.runner.resident(schedule),
                            [piece.activation_bytes for piece in self.pieces(candidate)],
                            offloaded)
        states = rank_state(self.spec, self.pieces(candidate), schedule.stage_to_rank,
                            self.layout(candidate), self.memory)
        # The bound adds bytes in another order than the simulator: allow for rounding.
        return (max(s.total + f for s, f in zip(states, floors)) + self.memory.reserve_bytes) \
            * (1 - 1e-9)

    def time_bound(self, candidate: Candidate) -> float:
        """A lower bound of the step time whatever is offloaded or recomputed: the makespan's
        (planner/bounds.py, Note [makespan lower bound]) plus the exposed DP exchange and the
        optimizer step, as ``evaluate`` adds them."""
        recomputed = candidate.offload == RECOMPUTE_AND_OFFLOAD
        key = ("time", self._layout_key(candidate), candidate.schedule, candidate.microbatches,
               recomputed)
        if key not in self._bounds:
            layout = self.layout(candidate)
            pieces = self.pieces(candidate)
            placement = self.stage_to_rank(candidate)
            makespan = makespan_lower_bound(self.costs(candidate), placement,
                                            candidate.microbatches,
                                            self.family(candidate).split_backward,
                                            recomputed)
            self._bounds[key] = (
                makespan + dp_seconds(self.spec, self.hw, pieces, placement, layout, self.memory)
                + optimizer_seconds(self.hw, pieces, placement, layout, self.memory))
        return self._bounds[key]

    def fitting_time_bound(self, candidate: Candidate) -> float:
        """A lower bound of the step time of ``candidate`` if it fits in the device budget
        (planner/fit_bound.py, Note [fitting time]: its copies must drain the activations
        over the budget): its order at all m microbatches, its costs and the room each rank
        leaves activations, plus the DP exchange and the optimizer step as ``evaluate`` adds
        them. 0.0 for recompute-and-offload, which the bound does not cover."""
        if candidate.offload == RECOMPUTE_AND_OFFLOAD:
            return 0.0
        key = ("fit", self._layout_key(candidate), candidate.schedule_shape)
        if key not in self._bounds:
            schedule = self.schedule(candidate, candidate.microbatches)
            pieces, layout = self.pieces(candidate), self.layout(candidate)
            states = rank_state(self.spec, pieces, schedule.stage_to_rank, layout, self.memory)
            rooms = [self.budget_bytes - state.total - self.memory.reserve_bytes
                     for state in states]
            makespan = fitting_makespan_bound(self.runner.fit_points(schedule),
                                              self.costs(candidate), schedule.stage_to_rank,
                                              rooms)
            placement = self.stage_to_rank(candidate)
            self._bounds[key] = (
                makespan + dp_seconds(self.spec, self.hw, pieces, placement, layout, self.memory)
                + optimizer_seconds(self.hw, pieces, placement, layout, self.memory))
        return self._bounds[key]

    def busiest_work(self, candidate: Candidate) -> float:
        """F + I + W of one microbatch on the rank with the most work (seconds)."""
        costs = self.costs(candidate)
        work: dict[int, float] = {}
        for stage, rank in enumerate(self.stage_to_rank(candidate)):
            work[rank] = work.get(rank, 0.0) + costs.chunk_time(stage)
        return max(work.values())

    def first_count_memory(self, candidate: Candidate) -> float | None:
        """The memory of ``candidate`` simulated at the smallest count of its reduced
        simulation alone, or None when it has none (a quick look at whether a plan can fit:
        the offload planner's choices differ a little with m, ``memory_tolerance``). Only
        where the reduced simulation itself would run: at fewer microbatches relative to m
        (m = 4p looked at at 2p) its peak overshot the full one by up to 27% (measured by
        benchmarks/planner_search.py --reduced-error)."""
        counts = self.extrapolation.counts(candidate.microbatches, candidate.pp,
                                           candidate.period())
        if len(counts) == 1:
            return None
        return self.evaluate(candidate, counts=counts[:1]).memory.total

    def evaluate(self, candidate: Candidate, full: bool = False,
                 counts: tuple[int, ...] | None = None) -> Plan:
        """Simulate ``candidate`` (all m microbatches with ``full``, else Note [reduced
        simulation], or just ``counts``) and price its memory. Each plan is kept: the same
        question again costs nothing."""
        m = candidate.microbatches
        if counts is None:
            counts = (m,) if full else self.extrapolation.counts(m, candidate.pp,
                                                                 candidate.period())
        if (candidate, counts) not in self._plans:
            plan = self._evaluate(candidate, m, counts)
            self._plans[(candidate, counts)] = plan
            self._plans.setdefault((candidate, plan.simulated_microbatches), plan)
        return self._plans[(candidate, counts)]

    def _option(self, candidate: Candidate, states: list[StateBytes]) -> str | ClassTarget:
        """What the runner plans into the candidate's schedule: its offload target, or for
        ``CLASS_OFFLOAD`` the classes and each rank's room (Note: [class plans in the
        search], planner/class_offload.py)."""
        if candidate.offload != CLASS_OFFLOAD:
            return candidate.offload
        layout = self.layout(candidate)
        if not searchable(self.spec, layout.run.recompute, candidate.pp, candidate.tp,
                          candidate.cp):
            raise ConfigError(f"offload {CLASS_OFFLOAD} plans tensor classes of layers without "
                              "recompute, with flash attention, pp > 1, tp 1 and cp 1")
        rooms = tuple(self.budget_bytes - state.total - self.memory.reserve_bytes
                      for state in states)
        return ClassTarget(stage_classes(self.spec, layout.run, self.pieces(candidate)), rooms)

    def _evaluate(self, candidate: Candidate, m: int, counts: tuple[int, ...]) -> Plan:
        pieces = self.pieces(candidate)
        layout = self.layout(candidate)
        placement = self.stage_to_rank(candidate)
        states = rank_state(self.spec, pieces, placement, layout, self.memory)
        run = self.runner.simulate(
            lambda count: self.schedule(candidate, count), self.costs(candidate),
            self._option(candidate, states), [piece.activation_bytes for piece in pieces], m,
            counts, self.busiest_work(candidate), candidate.pp)
        makespan, peaks = run.makespan, run.peak_bytes
        worst = max(range(candidate.pp), key=lambda r: states[r].total + peaks[r])
        memory = MemorySplit(states[worst].params, states[worst].grads, states[worst].optimizer,
                             peaks[worst], self.memory.reserve_bytes)
        dp_time = dp_seconds(self.spec, self.hw, pieces, placement, layout, self.memory)
        optimizer_time = optimizer_seconds(self.hw, pieces, placement, layout, self.memory)
        sequences = candidate.dp * candidate.micro_batch * candidate.microbatches
        peak, _ = peak_flops(self.hw)
        step = makespan + dp_time + optimizer_time
        mfu, mfu_causal = (step_model_flops(self.spec, sequences, causal=causal)
                           / (step * layout.gpus * peak) for causal in (False, True))
        return Plan(
            candidate=candidate,
            pipeline_time=makespan,
            dp_time=dp_time,
            mfu=mfu,
            memory=memory,
            budget_bytes=self.budget_bytes,
            bubble_rate=run.bubble_rate,
            stall_time=run.stall_time,
            offloaded_fraction=run.offloaded_fraction,
            simulated_microbatches=run.counts,
            notes=run.notes,
            optimizer_time=optimizer_time,
            mfu_causal=mfu_causal,
            host_bytes=max(run.host_bytes),
            host_node_bytes=node_host_bytes(run.host_bytes, candidate.tp * candidate.cp,
                                            candidate.pp, self.hw.gpus_per_node),
            host_budget_bytes=self.host_budget_bytes,
            offload_spec=run.chosen,
        )
