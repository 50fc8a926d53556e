"""The offload targets below the chunk, parsed and planned: ``budget:X`` (fit this peak as fast
as possible), ``classes:A+B[/recompute:C+D]`` (move these tensor classes of every activation
that hides, recompute those) and ``megatron:MODULES[,knob=value...]`` (Megatron-Core's policy,
offload/megatron.py). Each needs the chunk's tensor classes (planner/tensor_classes.py sizes
them for a model); the chunk targets of offload/targets.py do not.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

from pipeoffload.core.classes import ClassChoice, TensorClass
from pipeoffload.core.schedule import Schedule
from pipeoffload.errors import ConfigError
from pipeoffload.offload.class_plan import ClassSearch, plan_classes, uniform
from pipeoffload.offload.megatron import MegatronPolicy, megatron_plan
from pipeoffload.offload.plan import OffloadPlan, OffloadPolicy, add_offload
from pipeoffload.offload.targets import parse_target
from pipeoffload.sim.costs import CostModel

KINDS = ("budget", "classes", "megatron")
_HELP = ("budget:X (M_a units) or budget:XGiB, classes:A+B[/recompute:C+D], "
         "megatron:MOD+MOD[,fraction=X,delta=BYTES,min=BYTES,inflight=N,recompute=M+M,"
         "margin=0]")


def is_class_target(spec: object) -> bool:
    """Whether ``spec`` is one of this module's targets (by its name before the colon)."""
    return isinstance(spec, str) and spec.strip().lower().partition(":")[0] in KINDS


@dataclass(frozen=True)
class ModelClasses:
    """What the class targets need to know of the model: one layer's tensor classes, layers
    per stage, and one chunk's saved bytes (Megatron's delta and minimum size are in bytes)."""

    classes: tuple[TensorClass, ...]
    layers: int = 1
    chunk_bytes: float = 1.0


def plan_class_target(schedule: Schedule, costs: CostModel, spec: str, model: ModelClasses,
                      policy: OffloadPolicy | None = None) -> OffloadPlan:
    """``schedule`` (its transfers replaced) planned for the class target ``spec``."""
    kind, _, arg = spec.strip().partition(":")
    kind, arg = kind.lower(), arg.strip()
    if not arg:
        raise ConfigError(f"offload target {spec!r} needs a value: {_HELP}")
    if kind == "budget":
        limit = parse_target(f"limit:{arg}")  # the same numbers and units as limit:
        search = ClassSearch(budget=limit.value, in_bytes=limit.in_bytes)
        found = plan_classes(schedule, costs, model.classes, search, policy)
        off, rec = found.choice.names
        note = (f"{spec}: {'met' if found.met else 'NOT met, lowest peak found'}, offloading "
                f"{'+'.join(off) or 'nothing'}"
                f"{', recomputing ' + '+'.join(rec) if rec else ''} "
                f"({len(found.tried)} class plans tried; a bounded search)")
        report = dataclasses.replace(found.plan.report, notes=(*found.plan.report.notes, note))
        return dataclasses.replace(found.plan, report=report)
    if kind == "classes":
        choice = _explicit(arg, model.classes, spec)
        bare = schedule.with_classes(uniform(schedule, choice))
        return add_offload(bare, costs, "all", policy)
    planned, _ = megatron_plan(schedule, costs, model.classes, _megatron(arg, spec),
                               model.layers, model.chunk_bytes)
    return add_offload(planned, costs, "given", policy)


def _names(text: str, known: Sequence[TensorClass], spec: str) -> tuple[TensorClass, ...]:
    by_name = {c.name: c for c in known}
    chosen = [n.strip() for n in text.split("+") if n.strip()]
    bad = [n for n in chosen if n not in by_name]
    if bad:
        raise ConfigError(f"offload target {spec!r}: unknown tensor class {bad[0]!r} (choose "
                          f"from {', '.join(by_name)})")
    return tuple(by_name[n] for n in chosen)


def _explicit(arg: str, known: Sequence[TensorClass], spec: str) -> ClassChoice:
    moved, _, recomputed = arg.partition("/")
    if recomputed and not recomputed.startswith("recompute:"):
        raise ConfigError(f"offload target {spec!r}: write classes:A+B/recompute:C+D")
    return ClassChoice(_names(moved, known, spec),
                       _names(recomputed.removeprefix("recompute:"), known, spec))


def _megatron(arg: str, spec: str) -> MegatronPolicy:
    modules, *knobs = [part.strip() for part in arg.split(",")]
    values: dict[str, str] = {}
    for knob in knobs:
        name, eq, value = knob.partition("=")
        if not eq or name not in ("fraction", "delta", "min", "inflight", "recompute",
                                  "margin"):
            raise ConfigError(f"offload target {spec!r}: {knob!r} is not a knob; {_HELP}")
        values[name] = value.strip()
    try:
        return MegatronPolicy(
            tuple(m for m in modules.split("+") if m),
            fraction=float(values.get("fraction", 1.0)),
            delta_bytes=_bytes(values.get("delta", "0"), spec),
            min_tensor_bytes=_bytes(values.get("min", "0"), spec),
            max_inflight=int(values["inflight"]) if "inflight" in values else None,
            margin=values.get("margin", "1") not in ("0", "false", "no"),
            recompute=tuple(m for m in values.get("recompute", "").split("+") if m))
    except ValueError as error:
        raise ConfigError(f"offload target {spec!r}: {error}") from None


def _bytes(text: str, spec: str) -> float:
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-zA-Z]*)", text)
    if match is None:
        raise ConfigError(f"offload target {spec!r}: {text!r} is not a byte count")
    limit = parse_target(f"limit:{match.group(1)}{match.group(2) or 'b'}")
    return limit.value
