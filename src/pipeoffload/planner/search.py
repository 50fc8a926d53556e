"""The planner's search: the fastest configuration of a model on N GPUs that fits in memory.

It enumerates DP x TP x PP = N (TP dividing a node's GPUs and the head count), microbatch size
and count (from the global batch), the zoo's schedules with their chunks and group sizes,
recompute options and offload targets, and simulates what it cannot rule out (``evaluate``).

Note: [branch and bound]
Every candidate gets two lower bounds before anything is built: its step time
(``Evaluator.time_bound``: planner/bounds.py, Note [makespan lower bound]) and its memory
(``Evaluator.state_and_floor``: model state, reserve and one stage's activation, which a
forward holds whatever is offloaded). Over the budget in memory: infeasible, never simulated
(kept aside for the nearest plan when nothing fits). The rest wait in one queue ordered by their
time key, and the search takes the smallest key first:
1. a candidate not yet simulated is simulated, reduced where m is large (planner/reduced.py,
   Note [reduced simulation]). A plan without offload bounds its offloaded siblings (same
   layout, schedule, microbatching and recompute) from below: offload only inserts transfers
   and waits, it never removes or reorders compute, so in the simulator no compute starts
   earlier with it (tests/test_planner_bounds.py). Their key becomes that time.
2. a reduced plan that fits goes back into the queue keyed by its time / (1 + the reduced
   simulation's tolerance), which it cannot beat by more (measured, planner/reduced.py); when
   it comes out again it is simulated in full (a finalist) and takes part with its full time.
   A plan with offload is first planned at the reduced simulation's smallest count only: over
   the budget there by more than ``Extrapolation.memory_tolerance`` (how far that peak may
   exceed the full one, tested), it is taken as not fitting; else it is simulated in full at
   once (its time is its sibling's in most cases: a reduced run would only delay the full
   one). A plan without offload whose time no offloaded sibling needs (the verdict's search
   of plans without offload, planner/verdict.py) is first bounded in memory by its order
   (Note [kept activation]: exact without transfers, at the smallest count), as offloaded
   ``chunks:K`` plans are; one over the budget whose siblings may need its time is simulated
   only when the first of them gets to rule 2b.
2b. an offloaded candidate (no recomputation) is keyed by the earliest step at which it could
   fit (``Evaluator.fitting_time_bound``, planner/fit_bound.py, Note [fitting time]) before
   the offload planner runs: when that is above its key, it goes back into the queue under it.
   A plan that fits is no faster, and one that does not fit is never returned, so the key stays
   a lower bound of what the candidate could contribute.
3. the search stops when the smallest key times (1 + ``SearchConfig.tolerance``) reaches the
   best full-simulated step time found: nothing left can beat it by more than the tolerance.
So the plan returned is one simulated in full, and no other candidate is faster than it by more
than ``tolerance``, provided the bounds hold (tested against the full simulator) and reduced
runs err by less than their tolerance (tested, and measured over a whole search by
benchmarks/planner_search.py). With ``tolerance`` 0 and ``Extrapolation(enabled=False)`` this
is the exhaustive search: the same best plan (up to ties) as simulating every candidate in
full, since what it skips provably cannot win.
Recompute options of equal stage time keep only the one with fewer bytes (lgd before none):
identical timelines, more memory.
The other plans returned are the fastest others the search simulated on the way (reduced
where so marked); the search does not simulate plans only to fill the table.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from pipeoffload.checks import check_number, check_optional
from pipeoffload.errors import ConfigError
from pipeoffload.planner.costing import GIB, MemoryConfig
from pipeoffload.planner.evaluate import (
    CHUNKED,
    RECOMPUTE_AND_OFFLOAD,
    V_SHAPED,
    Candidate,
    Evaluator,
    Plan,
)
from pipeoffload.planner.hardware import Hardware
from pipeoffload.planner.ratio import (
    OffloadRatio,
    PieceCost,
    RunConfig,
    layer_cost,
    offload_ratio,
)
from pipeoffload.planner.reduced import Extrapolation
from pipeoffload.planner.transformer import Recompute, TransformerSpec, as_recompute
from pipeoffload.sim.collector import cyclic_gc_paused

DEFAULT_SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zbv", "v-half", "v-min",
                     "grouped-interleaved")
OFFLOAD_ORDER = ("none", "chunks:1", "all", RECOMPUTE_AND_OFFLOAD)


@dataclass(frozen=True)
class SearchSpace:
    """What the search may choose. ``tp`` / ``pp`` None: every divisor that fits (TP dividing a
    node's GPUs and the heads). ``group_sizes``: "min" (ceil(p/2)), "max" (p) or both."""

    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    chunks: tuple[int, ...] = (2, 4)
    group_sizes: tuple[str, ...] = ("min", "max")
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4)
    recompute: tuple[Recompute, ...] = (Recompute.NONE, Recompute.LGD, Recompute.FULL)
    offload: tuple[str, ...] = OFFLOAD_ORDER
    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", tuple(as_recompute(r) for r in self.recompute))
        unknown = [o for o in self.offload if o not in OFFLOAD_ORDER]
        if unknown:
            raise ConfigError(f"SearchSpace.offload: {unknown} not searchable; "
                              f"use some of {', '.join(OFFLOAD_ORDER)}")
        if "dualpipe" in self.schedules:
            raise ConfigError("SearchSpace: the planner's memory model has no schedule with two "
                              "copies of the weights per rank, so dualpipe is not searched; "
                              "search dualpipev (one copy, V placement) instead")
        if not self.schedules or not self.recompute or not self.micro_batch_sizes:
            raise ConfigError("SearchSpace: schedules, recompute and micro_batch_sizes "
                              "must each list at least one value")
        for name in ("chunks", "micro_batch_sizes", "tp", "pp"):
            for value in getattr(self, name) or ():
                check_number(f"SearchSpace.{name}", value, minimum=1, integer=True)


@dataclass(frozen=True)
class SearchConfig:
    """How to search: the memory budget per GPU (None: the GPU's memory), the global batch in
    sequences, how many plans to keep, memory accounting and the reduced simulation."""

    gpus: int
    global_batch: int
    budget_bytes: float | None = None
    top_k: int = 10
    memory: MemoryConfig = MemoryConfig()
    extrapolation: Extrapolation = Extrapolation()
    nearest_tries: int = 4
    """When nothing fits: how many of the memory-pruned configurations to simulate for the
    nearest one."""
    tolerance: float = 0.005
    """The returned plan may be slower than the best by this share (Note: [branch and bound]);
    0 returns the best (and simulates every near tie to find it)."""
    host_budget_bytes: float | None = None
    """Pinned host memory per node that offload may use (None: the hardware's
    ``host_bytes_per_node``; 0: not checked)."""

    def __post_init__(self) -> None:
        for name in ("gpus", "global_batch", "top_k"):
            check_number(f"SearchConfig.{name}", getattr(self, name), minimum=1, integer=True)
        check_number("SearchConfig.nearest_tries", self.nearest_tries, minimum=0, integer=True)
        check_number("SearchConfig.tolerance", self.tolerance, minimum=0, maximum=1)
        check_optional("SearchConfig.budget_bytes", self.budget_bytes, above=0)
        check_optional("SearchConfig.host_budget_bytes", self.host_budget_bytes, minimum=0)


@dataclass(frozen=True)
class SearchStats:
    """Candidates (variants) searched and what became of them: ``simulated`` counts simulator
    runs (a reduced plan is three), ``finalists`` the reduced plans re-simulated in full,
    ``dominated`` the offloaded variants pruned by their offload-free sibling's time."""

    configurations: int = 0
    simulated: int = 0
    pruned_by_time: int = 0
    pruned_by_memory: int = 0
    dominated: int = 0
    pruned_by_copies: int = 0
    """Offloaded variants that could fit only by a step slower than the best (Note:
    [fitting time], planner/fit_bound.py)."""
    not_buildable: int = 0
    finalists: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class SearchResult:
    """Ranked plans (feasible by step time, then the rest by memory) and how they were found.
    ``best`` is the fastest feasible plan or, when nothing fits, the nearest one."""

    k: OffloadRatio
    budget_bytes: float
    candidates: tuple[Plan, ...]
    stats: SearchStats
    notes: tuple[str, ...] = field(default=())
    spec: TransformerSpec | None = None  # the model searched for (its shape goes in commands)
    evaluator: Evaluator | None = field(default=None, compare=False, repr=False)
    """What priced the plans, with its built schedules and plans: a further search of the
    same model, hardware and config passes it on (``search(..., evaluator=)``)."""

    @property
    def best(self) -> Plan | None:
        return self.candidates[0] if self.candidates else None

    def shortfall(self, subject: str = "the nearest plan") -> str | None:
        """What the nearest plan (``subject``) would need, when nothing fits; None otherwise."""
        best = self.best
        if best is None or best.feasible:
            return None
        if best.fits_device:
            over = best.host_node_bytes - best.host_budget_bytes
            return (f"nothing fits in {best.host_budget_bytes / GIB:.1f} GiB of pinned host "
                    f"memory per node; {subject} needs {best.host_node_bytes / GIB:.1f} "
                    f"GiB per node, {over / GIB:.1f} GiB over: offload less, add nodes, or "
                    f"raise --host-memory")
        over = best.memory.total - self.budget_bytes
        part, size = best.memory.largest_part()
        fixes = {"activations": "offload more, recompute (--recompute full) or shorten the "
                                "sequence",
                 "optimizer state": "shard the optimizer (--sharded-optimizer) over more DP "
                                    "ranks or add GPUs",
                 "gradients": "add GPUs (more PP / TP)",
                 "parameters": "add GPUs (more PP / TP)"}
        return (f"nothing fits in {self.budget_bytes / GIB:.1f} GiB; {subject} needs "
                f"{best.memory_gib:.1f} GiB per device, {over / GIB:.1f} GiB over the budget; "
                f"the largest part is {part} ({size / GIB:.1f} GiB): {fixes[part]}, "
                f"or raise --memory")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layouts(spec: TransformerSpec, hw: Hardware, config: SearchConfig,
             space: SearchSpace) -> Iterator[tuple[int, int, int]]:
    for tp in _divisors(config.gpus):
        # TP inside one node: a group that straddles nodes would run at the network's rate
        if hw.gpus_per_node % tp or spec.heads % tp or (space.tp and tp not in space.tp):
            continue
        for pp in _divisors(config.gpus // tp):
            if pp > spec.num_layers or (space.pp and pp not in space.pp):
                continue
            dp = config.gpus // (tp * pp)
            if config.global_batch % dp == 0:
                yield dp, tp, pp


def _shapes(schedule: str, pp: int, space: SearchSpace) -> Iterator[tuple[int, int | None]]:
    """(chunks, group size) pairs a schedule is tried with."""
    if schedule in V_SHAPED:
        yield 2, None
    elif schedule == "grouped-interleaved":
        groups = sorted({math.ceil(pp / 2) if g == "min" else pp for g in space.group_sizes})
        for v in space.chunks:
            for g in groups:
                yield v, g
    elif schedule in CHUNKED:
        for v in space.chunks:
            yield v, None
    else:
        yield 1, None


def configurations(spec: TransformerSpec, hw: Hardware, config: SearchConfig,
                   space: SearchSpace) -> list[list[Candidate]]:
    """Every configuration as its list of variants (recompute x offload), in dominance order
    (fastest kind first), before any pruning. b > 1 variants follow b = 1's."""
    out = []
    layer_costs: dict[RunConfig, PieceCost] = {}

    def priced(run: RunConfig) -> PieceCost:
        if run not in layer_costs:
            layer_costs[run] = layer_cost(spec, hw, run)
        return layer_costs[run]

    for dp, tp, pp in _layouts(spec, hw, config, space):
        per_replica = config.global_batch // dp
        for schedule in space.schedules:
            if pp == 1 and schedule != "1f1b":
                continue
            for chunks, group in _shapes(schedule, pp, space):
                if pp * chunks > spec.num_layers:
                    continue
                for b in space.micro_batch_sizes:
                    if per_replica % b:
                        continue
                    m = per_replica // b
                    if schedule == "interleaved-1f1b" and m % pp:
                        continue  # Megatron's rule: groups of p microbatches
                    if schedule == "zb-h2" and m < 2 * pp - 1:
                        continue
                    base = Candidate(schedule, dp, tp, pp, chunks, b, m, group_size=group)
                    variants = _variants(priced, base, space)
                    if variants:
                        out.append(variants)
    return out


def _variants(priced: Callable[[RunConfig], PieceCost], base: Candidate,
              space: SearchSpace) -> list[Candidate]:
    keyed = []
    for r in space.recompute:
        cost = priced(RunConfig(base.micro_batch, base.tp, r))
        keyed.append(((cost.chunk_s, cost.activation_bytes), r))
    keyed.sort(key=lambda item: item[0])
    kept: list[Recompute] = []
    for (time_s, _), r in keyed:
        # Same time as an earlier (smaller) option: dominated.
        if not any(math.isclose(time_s, k[0][0]) for k in keyed if k[1] in kept):
            kept.append(r)
    offloads = [o for o in space.offload if base.pp > 1 or o == "none"]
    if base.chunks < 2:
        offloads = [o for o in offloads if o not in ("chunks:1", RECOMPUTE_AND_OFFLOAD)]
    return [Candidate(base.schedule, base.dp, base.tp, base.pp, base.chunks, base.micro_batch,
                      base.microbatches, r, o, base.group_size)
            for r in kept for o in offloads]


@dataclass
class _Queue:
    """The candidates the search may still simulate, smallest time key first (Note: [branch
    and bound]). Entries: (key, order, kind, candidate, reduced plan or None)."""

    entries: list[tuple[float, bool, int, str, Candidate, Plan | None]] = field(
        default_factory=list)
    order: Iterator[int] = field(default_factory=itertools.count)

    def push(self, key: float, kind: str, candidate: Candidate, plan: Plan | None = None) -> None:
        # At equal keys a finalist goes first: its full time may end the search.
        heapq.heappush(self.entries, (key, plan is None, next(self.order), kind, candidate, plan))

    def pop(self) -> tuple[float, str, Candidate, Plan | None]:
        key, _, _, kind, candidate, plan = heapq.heappop(self.entries)
        return key, kind, candidate, plan


def search(spec: TransformerSpec, hw: Hardware, config: SearchConfig,
           space: SearchSpace = SearchSpace(),
           progress: Callable[[str], None] | None = None,
           evaluator: Evaluator | None = None) -> SearchResult:
    """Search (Note: [branch and bound]); ``progress`` gets a status line about once a second.
    ``evaluator``: an earlier search's (``SearchResult.evaluator``) for the same model,
    hardware and config (``top_k`` and the space may differ): what it priced is reused."""
    with cyclic_gc_paused():
        return _search(spec, hw, config, space, progress, evaluator)


def _search(spec: TransformerSpec, hw: Hardware, config: SearchConfig, space: SearchSpace,
            progress: Callable[[str], None] | None, evaluator: Evaluator | None
            ) -> SearchResult:
    started = time.monotonic()
    budget = config.budget_bytes if config.budget_bytes is not None else hw.hbm_bytes
    host_budget = (config.host_budget_bytes if config.host_budget_bytes is not None
                   else hw.host_bytes_per_node)
    if evaluator is None:
        evaluator = Evaluator(spec, hw, config.memory, budget, config.extrapolation,
                              host_budget_bytes=host_budget)
    elif (evaluator.spec, evaluator.hw, evaluator.memory, evaluator.budget_bytes,
          evaluator.extrapolation, evaluator.host_budget_bytes) != (
              spec, hw, config.memory, budget, config.extrapolation, host_budget):
        raise ValueError("search: the evaluator passed in prices another model, hardware or "
                         "config")
    simulations_before = evaluator.simulations
    reduced_error = 1 + config.extrapolation.tolerance
    groups = configurations(spec, hw, config, space)
    stats = dict.fromkeys(("pruned_by_time", "pruned_by_memory", "dominated",
                           "pruned_by_copies", "not_buildable", "finalists"), 0)
    pruned_as = {"sibling": "dominated", "unfit": "pruned_by_copies"}
    queue = _Queue()
    too_big: list[tuple[float, Candidate]] = []
    # Plans without offload whose time bounds an offloaded sibling's (rule 1 of the Note).
    free_of: dict[Candidate, Candidate] = {}  # each variant's sibling without offload
    for variants in groups:
        without = {c.recompute: c for c in variants if c.offload == "none"}
        for c in variants:
            free_of[c] = without.get(c.recompute) or replace(c, offload="none")
    floors_siblings = {free_of[c] for c in free_of if c.offload != "none"}
    for variants in groups:
        for candidate in variants:
            floor = evaluator.state_and_floor(candidate)
            if floor > budget:
                stats["pruned_by_memory"] += 1
                too_big.append((floor, candidate))
            else:
                queue.push(evaluator.time_bound(candidate), "bound", candidate)
    feasible: dict[Candidate, Plan] = {}  # full or reduced, the latest of each candidate
    infeasible: list[Plan] = []
    sibling_floor: dict[Candidate, float] = {}  # the offload-free variant's time, from below
    unpriced: set[Candidate] = set()  # offload-free variants over the budget, not yet simulated
    unbuildable: set[tuple] = set()
    best = math.inf  # the best full-simulated feasible step time
    last_report = started
    while queue.entries:
        key, kind, candidate, plan = queue.pop()
        if key * (1 + config.tolerance) >= best:
            stats[pruned_as.get(kind, "pruned_by_time")] += 1
            for _, _, _, rest, _, _ in queue.entries:
                stats[pruned_as.get(rest, "pruned_by_time")] += 1
            break
        now = time.monotonic()
        if progress is not None and now - last_report >= 1.0:
            last_report = now
            shown = f", best {best:.3f} s" if best < math.inf else ""
            progress(f"plan: {len(queue.entries)} candidates left, "
                     f"{evaluator.simulations} simulations{shown}")
        if plan is not None:  # a reduced plan that fits: a finalist, simulated in full
            stats["finalists"] += 1
            plan = evaluator.evaluate(candidate, full=True)
        else:
            free = free_of[candidate]
            if sibling_floor.get(free, 0.0) > key:
                queue.push(sibling_floor[free], "sibling", candidate)
                continue
            if candidate.schedule_shape in unbuildable:
                stats["not_buildable"] += 1
                continue
            try:
                offloaded = candidate.offload != "none"
                if evaluator.memory_bound(candidate) > budget:
                    stats["pruned_by_memory"] += 1
                    if not offloaded:
                        too_big.append((evaluator.memory_bound(candidate), candidate))
                        if candidate in floors_siblings:  # priced if a sibling needs its time
                            unpriced.add(candidate)
                    continue
                fit = evaluator.fitting_time_bound(candidate) if offloaded else 0.0
                if fit > key:  # fitting takes longer than the key says (rule 2b of the Note)
                    queue.push(fit, "unfit", candidate)
                    continue
                if free in unpriced:  # the sibling without offload, priced for its time now
                    unpriced.discard(free)
                    free_plan = evaluator.evaluate(free)
                    infeasible.append(free_plan)
                    sibling_floor[free] = (free_plan.step_time / reduced_error
                                           if free_plan.extrapolated else free_plan.step_time)
                    if sibling_floor[free] > key:
                        queue.push(sibling_floor[free], "sibling", candidate)
                        continue
                memory = evaluator.first_count_memory(candidate) if offloaded else None
                if memory is not None and memory > budget * (
                        1 + config.extrapolation.memory_tolerance):
                    stats["pruned_by_memory"] += 1
                    too_big.append((memory, candidate))
                    continue
                stats["finalists"] += memory is not None
                plan = evaluator.evaluate(candidate, full=offloaded)
            except ConfigError:
                unbuildable.add(candidate.schedule_shape)
                stats["not_buildable"] += 1
                continue
            if candidate.offload == "none":
                sibling_floor[free] = (plan.step_time / reduced_error if plan.extrapolated
                                       else plan.step_time)
        if not plan.feasible:
            infeasible.append(plan)
            feasible.pop(candidate, None)
            continue
        feasible[candidate] = plan
        if plan.extrapolated:
            queue.push(plan.step_time / reduced_error, "reduced", candidate, plan)
        else:
            best = min(best, plan.step_time)
    notes: list[str] = []
    if not any(not plan.extrapolated for plan in feasible.values()):
        feasible.clear()
        tried = {plan.candidate for plan in infeasible}
        too_big.sort(key=lambda item: item[0])
        for _, candidate in too_big[: config.nearest_tries]:
            if candidate in tried:
                continue
            try:
                infeasible.append(evaluator.evaluate(candidate))
            except ConfigError:
                continue
    if not groups:
        notes.append(f"no layout of {config.gpus} GPUs fits this model and batch: "
                     f"DP must divide the global batch ({config.global_batch}), TP the heads "
                     f"({spec.heads}) and {hw.gpus_per_node} (GPUs per node), PP x chunks <= "
                     f"layers ({spec.num_layers})")
    ranked_feasible = sorted(feasible.values(), key=lambda p: (p.step_time, p.memory.total))
    infeasible.sort(key=lambda p: (p.memory.total, p.step_time))
    ranked = tuple(ranked_feasible[: config.top_k] or infeasible[: config.top_k])
    k = offload_ratio(spec, hw, RunConfig(1, 1, space.recompute[0] if len(space.recompute) == 1
                                          else Recompute.LGD))
    return SearchResult(
        k=k,
        budget_bytes=budget,
        candidates=ranked,
        stats=SearchStats(configurations=sum(len(g) for g in groups),
                          simulated=evaluator.simulations - simulations_before,
                          seconds=time.monotonic() - started, **stats),
        notes=tuple(notes),
        spec=spec,
        evaluator=evaluator,
    )
