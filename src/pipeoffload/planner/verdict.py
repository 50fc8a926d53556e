"""The verdict line of ``pipeoffload plan``: whether this model on this cluster needs activation
offload, and what the other choice would cost.

The search stops at the first variant of a configuration that fits (search.py, rule 3), so its
ranking does not hold the best plan of the other kind; one more search, restricted to the
offload options of that kind (top 1), finds it; it reuses the first search's evaluator, so
what both look at (schedules, bounds, plans) is priced once. ``pipeoffload plan --no-verdict``
skips it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeoffload.planner.costing import GIB
from pipeoffload.planner.evaluate import Plan
from pipeoffload.planner.hardware import Hardware
from pipeoffload.planner.search import SearchConfig, SearchResult, SearchSpace, search
from pipeoffload.planner.transformer import TransformerSpec


@dataclass(frozen=True)
class Verdict:
    """``needed``: offload is needed (nothing fits without it), not needed, or None when
    nothing fits at all. ``best``: the search's plan; ``other``: the best plan of the other
    kind (with offload when ``best`` has none, without when it has), None if none fits."""

    needed: bool | None
    best: Plan | None
    other: Plan | None

    def line(self) -> str:
        if self.best is None or not self.best.feasible:
            return "verdict: nothing fits, with or without offload (see the shortfall above)"
        best, other = self.best, self.other
        if best.candidate.offload == "none":
            if other is None:
                return ("verdict: offload not needed; the fastest plan fits without it (no "
                        "offloading plan fits or was searched)")
            return (f"verdict: offload not needed; the best offloading plan, "
                    f"{_name(other)}: {_slower(other, best)}, {_less(other, best)}")
        if other is None:
            return (f"verdict: offload needed; nothing fits in {best.budget_bytes / GIB:.1f} "
                    f"GiB per device without it")
        return (f"verdict: offload chosen, not needed; without it the best plan, "
                f"{_name(other)}: {_slower(other, best)}, {_less(other, best)}")

    def as_json(self) -> dict[str, object]:
        other = self.other
        return {
            "offload_needed": self.needed,
            "line": self.line(),
            "other": None if other is None else {
                "schedule": other.candidate.display_name, "offload": other.candidate.offload,
                "step_time": other.step_time, "memory_gib": other.memory_gib},
        }


def _name(plan: Plan) -> str:
    c = plan.candidate
    offload = "" if c.offload == "none" or c.preset is not None else f" + offload {c.offload}"
    return f"{c.display_name}{offload} (pp {c.pp}, tp {c.tp}, dp {c.dp})"


def _slower(plan: Plan, than: Plan) -> str:
    change = plan.step_time / than.step_time - 1
    return f"{abs(change):.1%} {'slower' if change >= 0 else 'faster'}"


def _less(plan: Plan, than: Plan) -> str:
    saved = (than.memory.total - plan.memory.total) / GIB
    return f"{abs(saved):.1f} GiB {'less' if saved >= 0 else 'more'} per GPU"


def offload_verdict(spec: TransformerSpec, hw: Hardware, config: SearchConfig,
                    space: SearchSpace, result: SearchResult) -> Verdict:
    """Search the other kind of plan than ``result.best`` (one more search, top 1)."""
    best = result.best
    if best is None or not best.feasible:
        return Verdict(None, best, None)
    offloaded = best.candidate.offload != "none"
    options = ("none",) if offloaded else tuple(o for o in space.offload if o != "none")
    other = None
    if options:
        found = search(spec, hw, replace(config, top_k=1), replace(space, offload=options),
                       evaluator=result.evaluator)
        other = found.best if found.best is not None and found.best.feasible else None
    return Verdict(offloaded and other is None, best, other)
