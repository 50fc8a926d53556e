"""What the planner's search may choose (``SearchSpace``), how it searches (``SearchConfig``),
and every configuration of a model on N GPUs within a space (``configurations``).

The schedule families come from the space's registry; how each one is tried (its chunks, group
sizes, the microbatch counts it takes, whether it runs at pp = 1) is read from its
``FamilySpec`` (core/families/base.py), so a new family needs nothing here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pipeoffload.checks import check_number, check_optional
from pipeoffload.core.families.base import FamilySpec, GroupSize
from pipeoffload.core.registry import REGISTRY, Registry
from pipeoffload.errors import ConfigError
from pipeoffload.planner.candidate import Candidate
from pipeoffload.planner.class_offload import CLASS_OFFLOAD, searchable
from pipeoffload.planner.costing import DEFAULT_FRAMEWORK, Framework, MemoryConfig
from pipeoffload.planner.hardware import Hardware
from pipeoffload.planner.layer_time import RunConfig
from pipeoffload.planner.ratio import PieceCost, layer_cost
from pipeoffload.planner.reduced import Extrapolation
from pipeoffload.planner.runs import RECOMPUTE_AND_OFFLOAD
from pipeoffload.planner.transformer import Recompute, TransformerSpec, as_recompute

#: The families searched when none are named: those that declare it, in registry order.
DEFAULT_SCHEDULES = tuple(name for name, family in REGISTRY.families.items()
                          if family.planner.by_default)
OFFLOAD_ORDER = ("none", "chunks:1", "all", RECOMPUTE_AND_OFFLOAD, CLASS_OFFLOAD)


@dataclass(frozen=True)
class SearchSpace:
    """What the search may choose. ``schedules``: names in ``registry`` (any accepted spelling;
    kept as canonical names). ``tp`` / ``pp`` None: every divisor that fits (TP dividing a
    node's GPUs and the heads). ``group_sizes``: for families with a group size, "min"
    (ceil(p/2)), "max" (p) or both. ``cp`` None: the context-parallel degrees the search
    tries by itself (``context_degrees``), else only these (each must cut the sequence into
    2 cp chunks); ``min_cp_tokens``: the fewest tokens per CP rank it tries by itself, the
    published runs' smallest share (dgxc's Llama 3 at CP2 and 8192 tokens: 4096 per rank;
    Llama 3's long-context stage, Dubey et al. 2024, section 3.3.2: CP16 at 131072, 8192)."""

    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    chunks: tuple[int, ...] = (2, 4)
    group_sizes: tuple[GroupSize, ...] = (GroupSize.MIN, GroupSize.MAX)
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4)
    recompute: tuple[Recompute, ...] = (Recompute.NONE, Recompute.LGD, Recompute.FULL)
    offload: tuple[str, ...] = OFFLOAD_ORDER
    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    registry: Registry = REGISTRY
    cp: tuple[int, ...] | None = None
    min_cp_tokens: int = 4096

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", tuple(as_recompute(r) for r in self.recompute))
        unknown = [o for o in self.offload if o not in OFFLOAD_ORDER]
        if unknown:
            raise ConfigError(f"SearchSpace.offload: {unknown} not searchable; "
                              f"use some of {', '.join(OFFLOAD_ORDER)}")
        if not self.schedules or not self.recompute or not self.micro_batch_sizes:
            raise ConfigError("SearchSpace: schedules, recompute and micro_batch_sizes "
                              "must each list at least one value")
        names = tuple(dict.fromkeys(self.registry.canonical_name(n) for n in self.schedules))
        object.__setattr__(self, "schedules", names)
        for name in names:
            _check_searchable(self.registry.family(name))
        sizes = [g for g in self.group_sizes if g not in tuple(GroupSize)]
        if sizes or not self.group_sizes:
            raise ConfigError(f"SearchSpace.group_sizes: {sizes or 'none'}; give some of "
                              f"{', '.join(g.value for g in GroupSize)}")
        object.__setattr__(self, "group_sizes", tuple(GroupSize(g) for g in self.group_sizes))
        for name in ("chunks", "micro_batch_sizes", "tp", "pp", "cp"):
            for value in getattr(self, name) or ():
                check_number(f"SearchSpace.{name}", value, minimum=1, integer=True)


def _check_searchable(family: FamilySpec) -> None:
    """ConfigError for a family the planner's memory model cannot price."""
    if family.weight_copies == 1:
        return
    instead = (f"; search {family.one_copy_variant} (one copy) instead"
               if family.one_copy_variant else "")
    raise ConfigError(f"SearchSpace: the planner's memory model holds one copy of the "
                      f"weights per rank, and {family.name} keeps {family.weight_copies}, so it "
                      f"is not searched{instead}")


@dataclass(frozen=True)
class SearchConfig:
    """How to search: the memory budget per GPU (None: the GPU's memory), the global batch in
    sequences, how many plans to keep, memory accounting, the reduced simulation and the
    framework whose behaviour prices each layout (planner/frameworks.py)."""

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
    """The returned plan may be slower than the best by this share (Note: [branch and bound],
    planner/search.py); 0 returns the best (and simulates every near tie to find it)."""
    host_budget_bytes: float | None = None
    """Pinned host memory per node that offload may use (None: the hardware's
    ``host_bytes_per_node``; 0: not checked)."""
    framework: Framework = DEFAULT_FRAMEWORK
    class_items: int = 4096
    """The most (stage, microbatch) items a configuration may have for the search to plan its
    tensor classes (planner/class_offload.py): a class search plans about ten offload plans,
    and at 1T scale (128 stages x 128 microbatches) one took 25 s of CPU, three times the rest
    of that search (benchmarks/planner_search.py)."""

    def __post_init__(self) -> None:
        for name in ("gpus", "global_batch", "top_k", "class_items"):
            check_number(f"SearchConfig.{name}", getattr(self, name), minimum=1, integer=True)
        check_number("SearchConfig.nearest_tries", self.nearest_tries, minimum=0, integer=True)
        check_number("SearchConfig.tolerance", self.tolerance, minimum=0, maximum=1)
        check_optional("SearchConfig.budget_bytes", self.budget_bytes, above=0)
        check_optional("SearchConfig.host_budget_bytes", self.host_budget_bytes, minimum=0)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def context_degrees(spec: TransformerSpec, hw: Hardware, tp: int, space: SearchSpace
                    ) -> list[int]:
    """The CP degrees tried with ``tp``: ``space.cp``, or by default 1 and the powers of two
    that cut the sequence into 2 cp chunks of at least ``space.min_cp_tokens`` / 2 tokens and
    keep tp x cp GPUs in one node (planner/context.py; Note [rank order] in costing.py)."""
    if space.cp is not None:
        return [cp for cp in space.cp if spec.seq_len % (2 * cp) == 0]
    degrees, cp = [1], 2
    while (spec.seq_len % (2 * cp) == 0 and spec.seq_len // cp >= space.min_cp_tokens
           and tp * cp <= hw.gpus_per_node):
        degrees.append(cp)
        cp *= 2
    return degrees


def _layouts(spec: TransformerSpec, hw: Hardware, config: SearchConfig,
             space: SearchSpace) -> Iterator[tuple[int, int, int, int]]:
    for tp in _divisors(config.gpus):
        # TP inside one node: a group that straddles nodes would run at the network's rate
        if hw.gpus_per_node % tp or spec.heads % tp or (space.tp and tp not in space.tp):
            continue
        for cp in context_degrees(spec, hw, tp, space):
            if (config.gpus // tp) % cp:
                continue
            for pp in _divisors(config.gpus // (tp * cp)):
                if pp > spec.num_layers or (space.pp and pp not in space.pp):
                    continue
                dp = config.gpus // (tp * pp * cp)
                if config.global_batch % dp == 0:
                    yield dp, tp, pp, cp


def _shapes(family: FamilySpec, pp: int, space: SearchSpace) -> Iterator[tuple[int, int | None]]:
    """(chunks, group size) pairs a family is tried with."""
    if family.fixed_chunks is not None:
        yield family.fixed_chunks, None
    elif "group_size" in family.options:
        groups = sorted({size.of(pp) for size in space.group_sizes})
        for v in space.chunks:
            for g in groups:
                yield v, g
    else:
        for v in space.chunks:
            yield v, None


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

    families = [space.registry.family(name) for name in space.schedules]
    for dp, tp, pp, cp in _layouts(spec, hw, config, space):
        per_replica = config.global_batch // dp
        for family in families:
            if pp == 1 and not family.planner.at_one_rank:
                continue
            for chunks, group in _shapes(family, pp, space):
                if pp * chunks > spec.num_layers:
                    continue
                for b in space.micro_batch_sizes:
                    if per_replica % b or not family.planner.microbatches(pp, per_replica // b):
                        continue
                    base = Candidate(family.name, dp, tp, pp, chunks, b, per_replica // b,
                                     group_size=group, cp=cp)
                    variants = _variants(priced, base, space, spec)
                    if variants:
                        out.append(variants)
    return out


def _variants(priced: Callable[[RunConfig], PieceCost], base: Candidate,
              space: SearchSpace, spec: TransformerSpec) -> list[Candidate]:
    keyed = []
    for r in space.recompute:
        cost = priced(RunConfig(base.micro_batch, base.tp, r, cp=base.cp))
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
    variants = [Candidate(base.schedule, base.dp, base.tp, base.pp, base.chunks,
                          base.micro_batch, base.microbatches, r, o, base.group_size, base.cp)
                for r in kept for o in offloads if o != CLASS_OFFLOAD]
    # Class plans are of layers without recompute, kept even where an option of equal time
    # and fewer bytes (lgd under flash attention) dominates none for whole chunks: the runtime
    # moves classes of layers it does not recompute (planner/class_offload.py).
    if (CLASS_OFFLOAD in offloads and Recompute.NONE in space.recompute
            and searchable(spec, Recompute.NONE, base.pp, base.tp, base.cp)):
        variants.append(dataclasses.replace(base, recompute=Recompute.NONE,
                                            offload=CLASS_OFFLOAD))
    return variants
