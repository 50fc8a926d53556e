"""One candidate configuration, simulated: step time, MFU and per-device memory.

A ``Candidate`` names everything the planner chooses (layout, schedule, offload, recompute,
microbatching); ``evaluate`` prices it with ``costing``, builds the schedule, plans offload into
it with ``offload.plan.add_offload`` and simulates it.

Note [reduced simulation]: simulating m microbatches costs O(m) and offload planning re-simulates
several times, so for large m we simulate two smaller counts m_a < m_b that keep m's residue
modulo the schedule's period L (p for interleaved 1F1B's groups, lcm(p, g) for grouped
interleaving, p otherwise), with m_a >= ``Extrapolation.min_factor`` * p, and extrapolate:
time(m) = time(m_b) + (m - m_b) * (time(m_b) - time(m_a)) / (m_b - m_a): past the warm-up every
further period adds the same work to the critical path. Peak memory is the larger of the two
peaks: the zoo's schedules (GPipe aside, which the planner does not search) reach their peak
within the first periods. Compute alone repeats exactly; the offload planner's choices need not
(which transfers it keeps, and where they stall, can cycle over several periods), so a plan
whose reduced runs stall for more than ``Extrapolation.stall_tolerance`` of their makespan is
simulated in full instead. tests/test_planner_search.py bounds the error against full runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipeoffload.core import registry
from pipeoffload.core.schedule import Schedule
from pipeoffload.offload.plan import OffloadPlan, add_offload
from pipeoffload.offload.recompute import add_recompute
from pipeoffload.offload.targets import parse_target
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
    stage_costs,
    step_model_flops,
)
from pipeoffload.planner.hardware import Hardware
from pipeoffload.planner.host_memory import host_peak_bytes, node_host_bytes
from pipeoffload.planner.ratio import PieceCost
from pipeoffload.planner.train_command import train_command
from pipeoffload.planner.transformer import Recompute, TransformerSpec
from pipeoffload.sim.costs import CostModel

#: Schedules whose stages sit in V placement (two per rank).
V_SHAPED = frozenset({"zbv", "v-half", "v-min", "dualpipev"})
#: Schedules with a ``chunks`` option (the others run a fixed number of stages per rank).
CHUNKED = frozenset({"interleaved-1f1b", "grouped-interleaved"})
#: Schedules that run W apart from its I (zero bubble and its V and DualPipe kin): the TP
#: reduce-scatter Megatron hides behind W is exposed in I (layer_time.py).
W_DEFERRED = frozenset({"zb-h1", "zb-h2", "zbv", "v-half", "v-min", "dualpipe", "dualpipev"})


RECOMPUTE_AND_OFFLOAD = "recompute-chunks:1+all"
"""A memory option mixing both per chunk: each rank's longest-lived chunk is recomputed
(RECOMPUTE actions, offload/recompute.py), every other activation that hides is offloaded."""


def plan_memory(schedule: Schedule, costs: CostModel, option: str) -> OffloadPlan:
    """Plan an offload target, or RECOMPUTE_AND_OFFLOAD, into ``schedule``."""
    if option == RECOMPUTE_AND_OFFLOAD:
        schedule = add_recompute(schedule, costs, "chunks:1").schedule
        option = "all"
    return add_offload(schedule, costs, parse_target(option))


@dataclass(frozen=True)
class Candidate:
    """Everything the planner chooses. ``schedule`` is a canonical registry name; ``group_size``
    is set for grouped-interleaved only; ``offload`` is an offload target spec."""

    schedule: str
    dp: int
    tp: int
    pp: int
    chunks: int
    micro_batch: int
    microbatches: int
    recompute: Recompute = Recompute.LGD
    offload: str = "none"
    group_size: int | None = None

    @property
    def layout(self) -> Layout:
        """The layout under the planner's default framework (``layout_under``)."""
        return self.layout_under(DEFAULT_FRAMEWORK)

    def layout_under(self, framework: Framework) -> Layout:
        """DP x TP x PP, chunks and the per-GPU run of this candidate under ``framework``."""
        run = framework.run(self.micro_batch, self.tp, self.recompute,
                            w_deferred=self.schedule in W_DEFERRED)
        return Layout(self.dp, self.tp, self.pp, self.chunks, run)

    @property
    def display_name(self) -> str:
        """po-h / po-f for the PipeOffload presets (grouped, v=2, g=ceil(p/2), chunks:1 / all)."""
        if (self.schedule == "grouped-interleaved" and self.chunks == 2
                and self.group_size == math.ceil(self.pp / 2)):
            return {"chunks:1": "po-h", "all": "po-f"}.get(self.offload, self.schedule)
        return self.schedule

    def options(self) -> dict[str, int]:
        """The registry options of this schedule."""
        options: dict[str, int] = {}
        if self.schedule in CHUNKED:
            options["chunks"] = self.chunks
        if self.group_size is not None:
            options["group_size"] = self.group_size
        return options

    def period(self) -> int:
        """Microbatches after which the schedule's pattern repeats (Note [reduced simulation])."""
        if self.group_size is not None:
            return math.lcm(self.pp, self.group_size)
        return self.pp

    def command(self, spec: TransformerSpec | None = None) -> str:
        """The ``pipeoffload train`` command line that runs this plan (with ``spec``, the
        reference model at that shape), or why train cannot (planner/train_command.py)."""
        return str(train_command(self, spec))


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
    host_bytes: float = 0.0
    host_node_bytes: float = 0.0
    host_budget_bytes: float = 0.0

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


@dataclass(frozen=True)
class Extrapolation:
    """Note [reduced simulation]: simulate fewer microbatches when m is large.
    ``min_factor``: the smaller simulated count is at least this many times p (and one period);
    ``enabled=False`` always simulates all m. ``stall_tolerance``: the share of the makespan
    that reduced runs may stall before the full count is simulated instead."""

    min_factor: float = 2.0
    enabled: bool = True
    stall_tolerance: float = 0.001

    def counts(self, candidate: Candidate) -> tuple[int, ...]:
        m, period = candidate.microbatches, candidate.period()
        low = max(math.ceil(self.min_factor * candidate.pp), period)
        m_a = m - ((m - low) // period) * period if m > low else m
        if not self.enabled or m_a + period >= m:
            return (m,)
        return (m_a, m_a + period)


class Evaluator:
    """Prices and simulates candidates of one model on one GPU; caches stage costs and built
    schedules (they do not depend on each other's costs), so a search reuses them."""

    def __init__(self, spec: TransformerSpec, hw: Hardware, memory: MemoryConfig,
                 budget_bytes: float, extrapolation: Extrapolation = Extrapolation(),
                 framework: Framework = DEFAULT_FRAMEWORK, host_budget_bytes: float = 0.0) -> None:
        self.spec, self.hw, self.memory = spec, hw, memory
        self.budget_bytes = budget_bytes
        self.host_budget_bytes = host_budget_bytes
        self.extrapolation = extrapolation
        self.framework = framework
        self._pieces: dict[Layout, tuple[PieceCost, ...]] = {}
        self._schedules: dict[tuple, Schedule] = {}
        self.simulations = 0

    def layout(self, candidate: Candidate) -> Layout:
        return candidate.layout_under(self.framework)

    def pieces(self, candidate: Candidate) -> tuple[PieceCost, ...]:
        layout = self.layout(candidate)
        if layout not in self._pieces:
            self._pieces[layout] = stage_costs(self.spec, self.hw, layout)
        return self._pieces[layout]

    def schedule(self, candidate: Candidate, microbatches: int) -> Schedule:
        """The compute schedule (raises ConfigError when the family rejects the shape)."""
        key = (candidate.schedule, candidate.pp, microbatches,
               tuple(sorted(candidate.options().items())))
        if key not in self._schedules:
            self._schedules[key] = registry.build_schedule(
                candidate.schedule, candidate.pp, microbatches, **candidate.options())
        return self._schedules[key]

    def stage_to_rank(self, candidate: Candidate) -> tuple[int, ...]:
        p, v = candidate.pp, candidate.chunks
        if candidate.schedule in V_SHAPED:
            return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
        return tuple(s % p for s in range(p * v))

    def state_and_floor(self, candidate: Candidate) -> float:
        """A lower bound of the device memory: model state, the reserve, and the largest stage
        activation of one microbatch (a forward holds it whatever is offloaded)."""
        pieces = self.pieces(candidate)
        placement = self.stage_to_rank(candidate)
        states = rank_state(self.spec, pieces, placement, self.layout(candidate), self.memory)
        floor = [0.0] * candidate.pp
        for stage, piece in enumerate(pieces):
            rank = placement[stage]
            floor[rank] = max(floor[rank], piece.activation_bytes)
        return max(s.total + f for s, f in zip(states, floor)) + self.memory.reserve_bytes

    def time_bound(self, candidate: Candidate) -> float:
        """A lower bound of the step time: rank r cannot start before the forwards of the stages
        in front of its first stage, then runs m times its stages' F + I + W; plus the exposed DP
        exchange and the optimizer step."""
        pieces = self.pieces(candidate)
        placement = self.stage_to_rank(candidate)
        layout = self.layout(candidate)
        costs = cost_model(pieces, self.spec, self.hw, layout)
        work = [0.0] * candidate.pp
        for stage, piece in enumerate(pieces):
            work[placement[stage]] += piece.chunk_s
        bound, lead = 0.0, 0.0
        for rank in range(candidate.pp):
            bound = max(bound, lead + candidate.microbatches * work[rank])
            lead += pieces[rank].f_s + costs.p2p_time
        return bound + dp_seconds(self.spec, self.hw, pieces, placement, layout, self.memory) \
            + optimizer_seconds(self.hw, pieces, placement, layout, self.memory)

    def evaluate(self, candidate: Candidate) -> Plan:
        """Simulate ``candidate`` (Note [reduced simulation]) and price its memory."""
        pieces = self.pieces(candidate)
        layout = self.layout(candidate)
        costs = cost_model(pieces, self.spec, self.hw, layout)
        counts = self.extrapolation.counts(candidate)
        runs = []
        for m in counts:
            runs.append(plan_memory(self.schedule(candidate, m), costs, candidate.offload))
            self.simulations += 1
        if len(runs) == 2 and any(
                run.result.total_stall_time > self.extrapolation.stall_tolerance
                * run.result.makespan for run in runs):
            counts = (candidate.microbatches,)
            runs = [plan_memory(self.schedule(candidate, counts[0]), costs, candidate.offload)]
            self.simulations += 1
        last = runs[-1]
        makespan = last.result.makespan
        bubble = last.result.bubble_rate
        if len(runs) == 2:
            slope = (makespan - runs[0].result.makespan) / (counts[1] - counts[0])
            makespan += slope * (candidate.microbatches - counts[1])
            compute = sum(last.result.compute_time) * candidate.microbatches / counts[1]
            bubble = 1 - compute / (candidate.pp * makespan)
        peaks = [max(values) for values in zip(*(run.result.peak_bytes or () for run in runs))]
        placement = last.schedule.stage_to_rank
        states = rank_state(self.spec, pieces, placement, layout, self.memory)
        worst = max(range(candidate.pp), key=lambda r: states[r].total + peaks[r])
        memory = MemorySplit(states[worst].params, states[worst].grads, states[worst].optimizer,
                             peaks[worst], self.memory.reserve_bytes)
        dp_time = dp_seconds(self.spec, self.hw, pieces, placement, layout, self.memory)
        optimizer_time = optimizer_seconds(self.hw, pieces, placement, layout, self.memory)
        sequences = candidate.dp * candidate.micro_batch * candidate.microbatches
        peak, _ = peak_flops(self.hw)
        step = makespan + dp_time + optimizer_time
        mfu = step_model_flops(self.spec, sequences) / (step * layout.gpus * peak)
        host = [0.0] * candidate.pp
        if candidate.offload != "none":
            for run in runs:
                host = [max(a, b) for a, b in zip(host, host_peak_bytes(run.result))]
        return Plan(
            candidate=candidate,
            pipeline_time=makespan,
            dp_time=dp_time,
            mfu=mfu,
            memory=memory,
            budget_bytes=self.budget_bytes,
            bubble_rate=bubble,
            stall_time=last.result.total_stall_time,
            offloaded_fraction=last.report.offloaded_fraction,
            simulated_microbatches=counts,
            notes=last.report.notes,
            optimizer_time=optimizer_time,
            host_bytes=max(host),
            host_node_bytes=node_host_bytes(host, candidate.tp, candidate.pp,
                                            self.hw.gpus_per_node),
            host_budget_bytes=self.host_budget_bytes,
        )
