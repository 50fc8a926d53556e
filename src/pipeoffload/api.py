"""The public entry points that combine layers: build a named schedule and plan offload into it.

PipeOffload's presets (docs/method.md section 4; declared in core/families/grouped.py):
- ``po-h``: grouped-interleaved with g = ceil(p/2), the longest-lived chunk of each rank offloaded;
- ``po-f``: the same schedule, everything offloaded (transfers that cannot hide are skipped).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pipeoffload.core import registry
from pipeoffload.core.schedule import Schedule
from pipeoffload.errors import ConfigError
from pipeoffload.offload.plan import OffloadPlan, OffloadPolicy, add_offload
from pipeoffload.offload.targets import OffloadTarget, parse_target
from pipeoffload.sim.collector import cyclic_gc_paused
from pipeoffload.sim.costs import CostModel


def schedule_names() -> list[tuple[str, str]]:
    """Every name ``build_schedule`` accepts, with a one-line description."""
    return [*registry.schedule_names(),
            *((p.name, p.description) for p in registry.PRESETS.values())]


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
    preset = registry.preset(name)
    if preset is not None:
        options = {**preset.options(pp), **options}
        target = parse_target(offload if offload is not None else preset.offload)
        schedule = registry.build_schedule(preset.family, pp, microbatches, **options)
        schedule = dataclasses.replace(schedule, name=preset.name)
    else:
        registry.canonical_name(name, also=tuple(registry.PRESETS))  # lists po-h / po-f too
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
