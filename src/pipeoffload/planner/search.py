"""The planner's search: the fastest configuration of a model on N GPUs that fits in memory.

It enumerates DP x TP x PP = N (TP dividing a node's GPUs and the head count), microbatch size
and count (from the global batch), the zoo's schedules with their chunks and group sizes,
recompute options and offload targets, and simulates what it cannot rule out (``evaluate``).

Pruning, cheapest first (each count is reported in ``SearchStats``):
1. Time bound: a configuration whose analytic lower bound (``Evaluator.time_bound``) is above
   the k-th best feasible step time found so far is skipped. Configurations are visited in
   order of an estimate (the bound plus an interleaved-1F1B-like bubble) so good ones come
   first and the bound bites early.
2. Memory bound: model state + reserve + one stage's activation over the budget: infeasible
   whatever is offloaded; kept aside as candidates for the nearest configuration.
3. Dominance inside a configuration (same layout, schedule, microbatching): variants are tried
   from the fastest kind to the slowest - recompute by its stage times (LGD before NONE when they
   are equal: same time, fewer bytes; NONE is then skipped), then offload none, chunks:1, all -
   and the walk stops at the first that fits: offload planning only inserts transfers and waits,
   never reorders compute, so a later variant cannot be faster. An infeasible variant's time
   bounds its offloaded siblings from below, so they are skipped when it is above the bound.
4. Microbatch size: bytes scale linearly with b, and times nearly so (larger b only widens
   the matmuls, gemm.py), so b > 1 mostly adds bubble and memory. A larger b is simulated when
   the same configuration with a smaller b could not be built, or when its per-sequence speed-up
   outweighs the bubble it adds (``_larger_b_may_win``).
"""

from __future__ import annotations

import heapq
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
    Extrapolation,
    Plan,
)
from pipeoffload.planner.hardware import Hardware
from pipeoffload.planner.ratio import OffloadRatio, RunConfig, layer_cost, offload_ratio
from pipeoffload.planner.transformer import Recompute, TransformerSpec, as_recompute

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
    host_budget_bytes: float | None = None
    """Pinned host memory per node that offload may use (None: the hardware's
    ``host_bytes_per_node``; 0: not checked)."""

    def __post_init__(self) -> None:
        for name in ("gpus", "global_batch", "top_k"):
            check_number(f"SearchConfig.{name}", getattr(self, name), minimum=1, integer=True)
        check_number("SearchConfig.nearest_tries", self.nearest_tries, minimum=0, integer=True)
        check_optional("SearchConfig.budget_bytes", self.budget_bytes, above=0)
        check_optional("SearchConfig.host_budget_bytes", self.host_budget_bytes, minimum=0)


@dataclass(frozen=True)
class SearchStats:
    configurations: int = 0
    simulated: int = 0
    pruned_by_time: int = 0
    pruned_by_memory: int = 0
    dominated: int = 0
    not_buildable: int = 0
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
                    variants = _variants(spec, hw, base, space)
                    if variants:
                        out.append(variants)
    return out


def _variants(spec: TransformerSpec, hw: Hardware, base: Candidate,
              space: SearchSpace) -> list[Candidate]:
    keyed = []
    for r in space.recompute:
        cost = layer_cost(spec, hw, RunConfig(base.micro_batch, base.tp, r))
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
    return [replace(base, recompute=r, offload=o) for r in kept for o in offloads]


def _larger_b_may_win(spec: TransformerSpec, hw: Hardware, candidate: Candidate) -> bool:
    """Whether microbatch size b > 1 may beat b = 1 on the same configuration: a step of M
    sequences takes about t_b (M / b + (p-1) / v) for t_b per microbatch, so b wins only if
    t_b / b (M + b (p-1) / v) < t_1 (M + (p-1) / v)."""
    b, tp = candidate.micro_batch, candidate.tp
    t_b = layer_cost(spec, hw, RunConfig(b, tp, candidate.recompute)).chunk_s
    t_1 = layer_cost(spec, hw, RunConfig(1, tp, candidate.recompute)).chunk_s
    sequences = candidate.microbatches * b
    fill = (candidate.pp - 1) / candidate.chunks
    return t_b / b * (sequences + b * fill) < t_1 * (sequences + fill)


def _estimate(evaluator: Evaluator, variants: list[Candidate]) -> float:
    first = variants[0]
    bubble = (first.pp - 1) / (first.chunks * first.microbatches)
    return evaluator.time_bound(first) * (1 + bubble)


def search(spec: TransformerSpec, hw: Hardware, config: SearchConfig,
           space: SearchSpace = SearchSpace(),
           progress: Callable[[str], None] | None = None) -> SearchResult:
    """Search (see the module docstring); ``progress`` gets a status line about once a second."""
    started = time.monotonic()
    budget = config.budget_bytes if config.budget_bytes is not None else hw.hbm_bytes
    host_budget = (config.host_budget_bytes if config.host_budget_bytes is not None
                   else hw.host_bytes_per_node)
    evaluator = Evaluator(spec, hw, config.memory, budget, config.extrapolation,
                          host_budget_bytes=host_budget)
    groups = configurations(spec, hw, config, space)
    stats = dict.fromkeys(("pruned_by_time", "pruned_by_memory", "dominated", "not_buildable"), 0)
    ordered = sorted(groups, key=lambda g: _estimate(evaluator, g))
    feasible: list[Plan] = []
    infeasible: list[Plan] = []
    too_big: list[tuple[float, Candidate]] = []
    fastest: list[float] = []  # max-heap (negated) of the k best feasible step times
    built_b: set[tuple] = set()
    last_report = started

    def bound() -> float:
        return -fastest[0] if len(fastest) >= config.top_k else math.inf

    for done, variants in enumerate(ordered):
        now = time.monotonic()
        if progress is not None and now - last_report >= 1.0:
            last_report = now
            best = f", best {-max(fastest):.3f} s" if fastest else ""
            progress(f"plan: {done}/{len(ordered)} configurations, "
                     f"{evaluator.simulations} simulations{best}")
        first = variants[0]
        shape = (first.schedule, first.dp, first.tp, first.pp, first.chunks, first.group_size)
        if first.micro_batch > 1 and shape in built_b and not _larger_b_may_win(spec, hw, first):
            stats["dominated"] += len(variants)
            continue
        lower = evaluator.time_bound(first)
        if lower > bound():
            stats["pruned_by_time"] += len(variants)
            continue
        found = None
        simulated_time: dict[Recompute, float] = {}
        for index, candidate in enumerate(variants):
            if max(evaluator.time_bound(candidate),
                   simulated_time.get(candidate.recompute, 0.0)) > bound():
                stats["pruned_by_time"] += 1
                continue
            floor = evaluator.state_and_floor(candidate)
            if floor > budget:
                stats["pruned_by_memory"] += 1
                too_big.append((floor, candidate))
                continue
            try:
                plan = evaluator.evaluate(candidate)
            except ConfigError:
                stats["not_buildable"] += len(variants) - index
                break
            built_b.add(shape)
            if plan.feasible:
                found = plan
                stats["dominated"] += len(variants) - index - 1
                break
            infeasible.append(plan)
            # Offloaded siblings with this recompute cannot be faster than this plan.
            simulated_time.setdefault(candidate.recompute, plan.step_time)
        if found is not None:
            feasible.append(found)
            heapq.heappush(fastest, -found.step_time)
            if len(fastest) > config.top_k:
                heapq.heappop(fastest)
    notes: list[str] = []
    if not feasible:
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
    feasible.sort(key=lambda p: (p.step_time, p.memory.total))
    infeasible.sort(key=lambda p: (p.memory.total, p.step_time))
    ranked = tuple(feasible[: config.top_k] or infeasible[: config.top_k])
    k = offload_ratio(spec, hw, RunConfig(1, 1, space.recompute[0] if len(space.recompute) == 1
                                          else Recompute.LGD))
    return SearchResult(
        k=k,
        budget_bytes=budget,
        candidates=ranked,
        stats=SearchStats(configurations=sum(len(g) for g in groups),
                          simulated=evaluator.simulations,
                          seconds=time.monotonic() - started, **stats),
        notes=tuple(notes),
        spec=spec,
    )
