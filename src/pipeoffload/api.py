"""The public entry points that combine layers: build a named schedule and plan offload into it.

PipeOffload's presets (docs/method.md section 4):
- ``po-h``: grouped-interleaved with g = ceil(p/2), the longest-lived chunk of each rank offloaded;
- ``po-f``: the same schedule, everything offloaded (transfers that cannot hide are skipped).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from pipeoffload.core import registry
from pipeoffload.core.schedule import Schedule
from pipeoffload.errors import ConfigError
from pipeoffload.offload.plan import OffloadPlan, OffloadPolicy, add_offload
from pipeoffload.offload.targets import OffloadTarget, parse_target
from pipeoffload.sim.collector import cyclic_gc_paused
from pipeoffload.sim.costs import CostModel

# preset key -> (description, default offload target)
PRESETS: dict[str, tuple[str, str]] = {
    "po-h": ("PipeOffload: grouped-interleaved, g=ceil(p/2), longest-lived chunk offloaded",
             "chunks:1"),
    "po-f": ("PipeOffload: grouped-interleaved, g=ceil(p/2), full offload", "all"),
}


def _preset(name: str) -> str | None:
    key = name.strip().lower().replace("_", "").replace("-", "")
    return next((p for p in PRESETS if p.replace("-", "") == key), None)


def schedule_names() -> list[tuple[str, str]]:
    """Every name ``build_schedule`` accepts, with a one-line description."""
    return list(registry.schedule_names()) + [(n, d) for n, (d, _) in PRESETS.items()]


def resolve_costs(costs: CostModel | None, offload_ratio: float | None) -> CostModel:
    """The cost model, with ``offload_ratio`` folded in (given in one place only)."""
    costs = costs or CostModel()
    if offload_ratio is None:
        return costs
    if costs.offload_ratio is not None and costs.offload_ratio != offload_ratio:
        raise ConfigError("offload_ratio is given twice (argument and CostModel) with "
                          "different values; give it once")
    return dataclasses.replace(costs, offload_ratio=offload_ratio)


def plan_schedule(
    name: str,
    pp: int,
    microbatches: int,
    offload: str | OffloadTarget | None = None,
    *,
    costs: CostModel | None = None,
    offload_ratio: float | None = None,
    policy: OffloadPolicy | None = None,
    **options: Any,
) -> OffloadPlan:
    """Build schedule ``name`` and plan ``offload`` into it; returns the plan and its report."""
    with cyclic_gc_paused():  # building makes 10^5 actions and no cycles (core/collector.py)
        return _plan_schedule(name, pp, microbatches, offload, costs, offload_ratio, policy,
                              options)


def _plan_schedule(name: str, pp: int, microbatches: int,
                   offload: str | OffloadTarget | None, costs: CostModel | None,
                   offload_ratio: float | None, policy: OffloadPolicy | None,
                   options: dict[str, Any]) -> OffloadPlan:
    preset = _preset(name)
    if preset is not None:
        options.setdefault("chunks", 2)
        options.setdefault("group_size", math.ceil(pp / 2))
        target = parse_target(offload if offload is not None else PRESETS[preset][1])
        schedule = registry.build_schedule("grouped-interleaved", pp, microbatches, **options)
        schedule = dataclasses.replace(schedule, name=preset)
    else:
        registry.canonical_name(name, also=tuple(PRESETS))  # an unknown name lists po-h / po-f
        target = parse_target(offload)
        schedule = registry.build_schedule(name, pp, microbatches, **options)
    return add_offload(schedule, resolve_costs(costs, offload_ratio), target, policy)


def build_schedule(
    name: str,
    pp: int,
    microbatches: int,
    offload: str | OffloadTarget | None = None,
    *,
    costs: CostModel | None = None,
    offload_ratio: float | None = None,
    policy: OffloadPolicy | None = None,
    **options: Any,
) -> Schedule:
    """A named schedule (see ``schedule_names``), with ``offload`` planned into it as OFFLOAD /
    RELOAD actions. Options take the CLI's names with underscores (chunks=, group_size=)."""
    plan = plan_schedule(name, pp, microbatches, offload, costs=costs,
                         offload_ratio=offload_ratio, policy=policy, **options)
    return plan.schedule
