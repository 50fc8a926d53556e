"""The planner's offload below the chunk (issue 36): a candidate whose offload is
``CLASS_OFFLOAD`` is planned by the tensor-class search (offload/class_plan.py) with each rank's
budget the room its device leaves activations, and runs as the ``classes:A+B[/recompute:C+D]``
it found.

Note: [class plans in the search]
- What is searched: keep, offload or recompute per tensor class, one choice for every (stage,
  microbatch) (``ClassSearch(per_microbatch=False)``, at most ``RECOMPUTE_CAP`` recompute sets
  beyond none), recompute among the classes train recomputes (tensor_classes.TRAIN_RECOMPUTES);
  ``--offload classes:A+B/recompute:C+D`` is uniform, so the plan simulated is the one the
  printed command runs. Among the choices is the chunk planner's own ``all``; a plan that
  chose it prints ``--offload all``.
- Where: recompute none (the classes are a layer's saved tensors without recompute), tp 1 and
  cp 1 (where train moves and recomputes classes: a plan it cannot run would only be refused),
  pp > 1, flash attention (planner/tensor_classes.py). A stage's classes are its layers' (each
  class's share of the stage's bytes: layers x the class's bytes over the stage's); the
  embedding's and head's saved tensors are kept (the runtime tags them ``other``).
- When: the search (planner/search.py, rule 2c) reaches such a candidate only after its
  ``all`` sibling, and stops first when that sibling fits at the offload-free time, which no
  plan of the configuration beats (rule 1). So a class plan is tried where chunk offload
  stalls (k > 1) or does not fit, and not for more than ``SearchConfig.class_items``
  (stage, microbatch) items.
- Cost: one class search plans ``share_probes`` moved shares and up to about as many more
  around the best (offload/class_plan.py, step 2), each one chunk-planner run (a few
  simulations); it is simulated at all m (never reduced: its choice may differ with m).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeoffload.core.classes import TensorClass
from pipeoffload.core.schedule import Schedule
from pipeoffload.offload.class_plan import ClassPlan, ClassSearch, plan_classes
from pipeoffload.planner.costing import split_layers
from pipeoffload.planner.layer_time import RunConfig
from pipeoffload.planner.ratio import PieceCost
from pipeoffload.planner.tensor_classes import TRAIN_RECOMPUTES, layer_classes
from pipeoffload.planner.transformer import Recompute, TransformerSpec, layer_activation_bytes
from pipeoffload.sim.costs import CostModel

CLASS_OFFLOAD = "budget:fit"
"""The search's offload option planned per tensor class (Note: [class plans in the search])."""

#: Moved shares the class search plans before refining around the best (ClassSearch).
SHARE_PROBES = 5
#: Recompute sets the class search tries beyond none where the budget is met, and at most
#: where it is not (ClassSearch max_recompute, recompute_cap): each set adds as many plans as
#: the search without recompute makes.
MAX_RECOMPUTE, RECOMPUTE_CAP = 1, 2


@dataclass(frozen=True)
class ClassTarget:
    """What the class search needs for one candidate: each stage's classes and each rank's
    room for activations (bytes)."""

    classes: dict[int, tuple[TensorClass, ...]]
    rooms: tuple[float, ...]


def searchable(spec: TransformerSpec, recompute: Recompute, pp: int, tp: int, cp: int) -> bool:
    """Whether a configuration gets a ``CLASS_OFFLOAD`` variant (the Note's "where")."""
    return (spec.flash_attention and recompute is Recompute.NONE and pp > 1 and tp == 1
            and cp == 1)


def stage_classes(spec: TransformerSpec, run: RunConfig, pieces: tuple[PieceCost, ...]
                  ) -> dict[int, tuple[TensorClass, ...]]:
    """Each stage's tensor classes, shares of its own activation bytes (its layers' classes;
    the embedding's and head's bytes are no class and stay)."""
    layer = layer_classes(spec, run.micro_batch, tp=run.tp,
                          sequence_parallel=run.sequence_parallel)
    layer_bytes = layer_activation_bytes(spec, run.micro_batch, "none", tp=run.tp,
                                         sequence_parallel=run.sequence_parallel)
    out = {}
    for stage, (count, piece) in enumerate(zip(split_layers(spec.num_layers, len(pieces)),
                                                pieces)):
        scale = count * layer_bytes / piece.activation_bytes
        out[stage] = tuple(TensorClass(c.name, min(c.share * scale, 1.0),
                                       c.recompute_time if c.name in TRAIN_RECOMPUTES else None)
                           for c in layer)
    return out


def plan_class_offload(schedule: Schedule, costs: CostModel, target: ClassTarget) -> ClassPlan:
    """The fastest uniform class choice whose every rank fits its room (else the nearest)."""
    search = ClassSearch(rank_budgets=target.rooms, in_bytes=True, per_microbatch=False,
                         share_probes=SHARE_PROBES, max_recompute=MAX_RECOMPUTE,
                         recompute_cap=RECOMPUTE_CAP)
    return plan_classes(schedule, costs, target.classes, search)


def offload_spec(found: ClassPlan) -> str:
    """The ``--offload`` that runs ``found``: its classes, or ``all`` (whole chunks)."""
    moved, recomputed = found.choice.names
    if not moved and not recomputed:
        return "all"
    return f"classes:{'+'.join(moved)}" + (f"/recompute:{'+'.join(recomputed)}"
                                           if recomputed else "")
