"""What a search returns: the ranked plans (``SearchResult``) and how they were found
(``SearchStats``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeoffload.planner.costing import GIB
from pipeoffload.planner.evaluate import Evaluator, Plan
from pipeoffload.planner.ratio import OffloadRatio
from pipeoffload.planner.transformer import TransformerSpec


@dataclass
class SearchStats:
    """Candidates (variants) searched and what became of them: ``simulated`` counts simulator
    runs (a reduced plan is three), ``finalists`` the reduced plans re-simulated in full,
    ``dominated`` the offloaded variants pruned by their offload-free sibling's time. A search
    counts into its own (planner/search.py ``SearchState``) and hands it over when done."""

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
    sharded_optimizer: bool = False  # memory counts ZeRO-1 (train_command adds --zero 1)
    fsdp: bool = False  # priced as train's --zero 3 (train_command adds --zero 3)
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
                 "optimizer state": ("add GPUs (more DP ranks to shard it over)"
                                     if self.sharded_optimizer else
                                     "shard the optimizer (--sharded-optimizer) over more DP "
                                     "ranks or add GPUs"),
                 "gradients": "add GPUs (more PP / TP)",
                 "parameters": "add GPUs (more PP / TP)"}
        return (f"nothing fits in {self.budget_bytes / GIB:.1f} GiB; {subject} needs "
                f"{best.memory_gib:.1f} GiB per device, {over / GIB:.1f} GiB over the budget; "
                f"the largest part is {part} ({size / GIB:.1f} GiB): {fixes[part]}, "
                f"or raise --memory")
