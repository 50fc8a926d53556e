"""The verdict line of ``pipeoffload plan``: whether this model on this cluster needs activation
offload, and what the other choice would cost.

It compares like with like: the best plan without offload against the best plan with it, each
within the budget. The search stops at the first variant of a configuration that fits
(search.py, rule 3), so its ranking does not hold the best plan of the other kind; one more
search, restricted to the offload options of that kind (top 1), finds it. It reuses the first
search's evaluator, so what both look at (schedules, bounds, plans) is priced once.
``pipeoffload plan --no-verdict`` skips it.

Note [verdict and the chosen plan]: the first search returns a plan within ``tolerance`` of the
fastest (search.py, rule 3), so the second search can find a plan of the other kind that is
faster still (a 0.1% faster offloading plan beside a plan without offload, say). The chosen
plan is then that faster one (``Verdict.best``, and ``settled`` puts it first in the
ranking): the line never calls offload "not needed" beside a faster offloading plan, nor
chooses offload beside a faster plan without it. Either kind's best is within ``tolerance`` of
that kind's fastest, so the comparison is too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipeoffload.planner.costing import GIB
from pipeoffload.planner.evaluate import Plan
from pipeoffload.planner.hardware import Hardware
from pipeoffload.planner.search import SearchConfig, SearchResult, SearchSpace, search
from pipeoffload.planner.transformer import TransformerSpec


def offloads(plan: Plan) -> bool:
    """Whether ``plan`` is of the offloading kind (its memory option moves activations)."""
    return plan.candidate.offload != "none"


@dataclass(frozen=True)
class Verdict:
    """``best``: the chosen plan, the faster of the two kinds' bests (Note [verdict and the
    chosen plan]); ``other``: the best feasible plan of the other kind (with offload when
    ``best`` has none, without when it has), None if none fits. ``needed``: offload is needed
    (nothing fits without it), not needed, or None when nothing fits at all. ``swapped``: the
    second search found ``best`` faster than the first search's plan, which is now ``other``."""

    needed: bool | None
    best: Plan | None
    other: Plan | None
    swapped: bool = False

    def line(self) -> str:
        if self.best is None or not self.best.feasible:
            return "verdict: nothing fits, with or without offload (see the shortfall above)"
        best, other = self.best, self.other
        if not offloads(best):
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
            "best_offloads": None if self.best is None else offloads(self.best),
            "line": self.line(),
            "chosen_by_verdict": self.swapped,
            "other": None if other is None else {
                "schedule": other.candidate.display_name, "offload": other.candidate.offload,
                "pp": other.candidate.pp, "tp": other.candidate.tp, "dp": other.candidate.dp,
                "step_time": other.step_time, "memory_gib": other.memory_gib},
        }


def _name(plan: Plan) -> str:
    c = plan.candidate
    offload = "" if c.offload == "none" or c.preset is not None else f" + offload {c.offload}"
    return f"{c.display_name}{offload} (pp {c.pp}, tp {c.tp}, dp {c.dp})"


def _slower(plan: Plan, than: Plan) -> str:
    change = plan.step_time / than.step_time - 1
    if abs(change) < 5e-4:
        return "as fast (within 0.05%)"
    return f"{abs(change):.1%} {'slower' if change >= 0 else 'faster'}"


def _less(plan: Plan, than: Plan) -> str:
    saved = (than.memory.total - plan.memory.total) / GIB
    return f"{abs(saved):.1f} GiB {'less' if saved >= 0 else 'more'} per GPU"


def offload_verdict(spec: TransformerSpec, hw: Hardware, config: SearchConfig,
                    space: SearchSpace, result: SearchResult) -> Verdict:
    """Search the other kind of plan than ``result.best`` (one more search, top 1) and choose
    the faster of the two (Note [verdict and the chosen plan])."""
    best = result.best
    if best is None or not best.feasible:
        return Verdict(None, best, None)
    options = ("none",) if offloads(best) else tuple(o for o in space.offload if o != "none")
    other = None
    if options:
        found = search(spec, hw, replace(config, top_k=1), replace(space, offload=options),
                       evaluator=result.evaluator)
        other = found.best if found.best is not None and found.best.feasible else None
    swapped = other is not None and (other.step_time, other.memory.total) < (
        best.step_time, best.memory.total)
    if swapped:
        assert other is not None
        best, other = other, best
    return Verdict(offloads(best) and other is None, best, other, swapped)


def settled(result: SearchResult, verdict: Verdict) -> SearchResult:
    """``result`` ranked with the verdict's chosen plan first (the same result when the first
    search's plan stands)."""
    chosen = verdict.best
    if not verdict.swapped or chosen is None:
        return result
    others = [plan for plan in result.candidates if plan.candidate != chosen.candidate]
    ranked = [chosen, *others][:max(1, len(result.candidates))]
    return replace(result, candidates=tuple(ranked))
