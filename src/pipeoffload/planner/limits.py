"""What ``pipeoffload train`` can run of a model, as limits on the planner's search, and what
each limit cost: the search keeps to what train runs (its printed command must run), and says so
with the best plan it would have chosen without the limit (no silent restriction).

A Hugging Face model (``spec.train_model``) trains its whole decoder layers as Hugging Face
wrote them: train recomputes whole layers or nothing (never lgd), and nothing when the config
sets dropout (a recomputed layer would draw other masks); it shards over tensor parallelism only
the families of ``hf_families.TENSOR_PARALLEL_MODEL_TYPES``. The reference model (any other
spec) has no such limits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pipeoffload import hf_families
from pipeoffload.planner.evaluate import Plan
from pipeoffload.planner.hardware import Hardware
from pipeoffload.planner.search import SearchConfig, SearchResult, SearchSpace, search
from pipeoffload.planner.transformer import Recompute, TransformerSpec


@dataclass(frozen=True)
class TrainLimit:
    """The search's ``field`` (a SearchSpace field) kept to ``values`` because train cannot run
    the others (``why``)."""

    field: str
    values: tuple[object, ...]
    why: str

    @property
    def flags(self) -> str:
        return f"--{self.field} {' or '.join(str(getattr(v, 'value', v)) for v in self.values)}"


def train_limits(spec: TransformerSpec, given: set[str]) -> tuple[TrainLimit, ...]:
    """The limits train puts on ``spec``'s plans, except on the fields the user ``given``
    (their own values stand; the printer refuses a command train cannot run)."""
    if spec.train_model is None:
        return ()
    limits = []
    if "recompute" not in given:
        if spec.dropout:
            limits.append(TrainLimit("recompute", (Recompute.NONE,), (
                f"the config sets dropout, and train recomputes a {spec.model_type} model's "
                "layers only without it: a recomputed layer would draw other masks")))
        else:
            limits.append(TrainLimit(
                "recompute", tuple(Recompute(m) for m in hf_families.RECOMPUTE_MODES),
                f"train recomputes a {spec.model_type} model's whole layers or nothing"))
    if "tp" not in given and spec.model_type not in hf_families.TENSOR_PARALLEL_MODEL_TYPES:
        limits.append(TrainLimit("tp", (1,), f"train does not shard {spec.model_type} models "
                                             "over tensor-parallel ranks"))
    return tuple(limits)


def limited(space: SearchSpace, limits: tuple[TrainLimit, ...]) -> SearchSpace:
    """``space`` kept to ``limits``."""
    changes: dict[str, Any] = {limit.field: limit.values for limit in limits}
    return replace(space, **changes) if changes else space


@dataclass(frozen=True)
class LimitCost:
    """What the limits cost: the best plan of the search without them (None: none fits)."""

    limits: tuple[TrainLimit, ...]
    unlimited: Plan | None
    limited: Plan | None

    def note(self, model_type: str | None) -> str:
        said = "; ".join(f"{limit.flags} ({limit.why})" for limit in self.limits)
        head = f"note: {model_type or 'this'} model: the search kept to {said}"
        free, kept = self.unlimited, self.limited
        if free is None:
            return f"{head}; without that, nothing fits either"
        if kept is not None and kept.feasible and free.step_time >= kept.step_time:
            return f"{head}; that cost nothing: no plan without it is faster"
        c = free.candidate
        plan = (f"{c.display_name} (pp {c.pp}, tp {c.tp}, dp {c.dp}, recompute "
                f"{c.recompute.value}, offload {c.offload}), {free.step_time:.3f} s per step")
        if kept is None or not kept.feasible:
            return f"{head}; without it the best plan, {plan}, would fit"
        return (f"{head}; without it the best plan, {plan}, is "
                f"{1 - free.step_time / kept.step_time:.1%} faster")

    def as_json(self) -> dict[str, object]:
        free = self.unlimited
        return {"limits": [{"flags": limit.flags, "why": limit.why} for limit in self.limits],
                "unlimited_best": None if free is None else {
                    "schedule": free.candidate.display_name, "pp": free.candidate.pp,
                    "tp": free.candidate.tp, "dp": free.candidate.dp,
                    "recompute": free.candidate.recompute.value,
                    "offload": free.candidate.offload, "step_time": free.step_time},
                "limited_best_step_time": None if self.limited is None or not
                self.limited.feasible else self.limited.step_time}


def limit_cost(spec: TransformerSpec, hw: Hardware, config: SearchConfig, space: SearchSpace,
               limits: tuple[TrainLimit, ...], result: SearchResult) -> LimitCost:
    """Search ``space`` without ``limits`` (top 1, reusing ``result``'s evaluator) for what
    they cost against ``result``, the limited search's."""
    found = search(spec, hw, replace(config, top_k=1), space, evaluator=result.evaluator)
    free = found.best if found.best is not None and found.best.feasible else None
    return LimitCost(limits, free, result.best)
