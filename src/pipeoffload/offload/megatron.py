"""Megatron-Core's fine-grained activation offloading as a policy in the simulator: the
baseline our class planner (offload/class_plan.py) is measured against.

What it models, from megatron/core/pipeline_parallel/fine_grained_activation_offload.py and
docs/user-guide/features/fine_grained_activation_offloading.md in NVIDIA/Megatron-LM at commit
d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22):

- Groups: each layer of a model chunk has one offload group per module named in
  ``--offload-modules``; a group holds the tensors saved while that module's forward runs
  (``attn_norm``: the layer input; ``qkv_linear``: the norm output; ``core_attn``: Q, K, V and
  the attention output with its softmax statistics; ``attn_proj``: the attention output,
  already moved if ``core_attn`` is chosen; ``mlp_norm``: the MLP norm's input). Dense MLP
  tensors have no group (``expert_fc1`` / ``moe_act`` are MoE only). Tensors under
  ``--min-offloaded-tensor-size`` stay (``tensor_need_offloading_checker``).
- After the warm-up iteration (``post_warmup_callback``), in this order: the margin keeps the
  last group of each module name of the first chunk to run its backward on the device; the
  per-rank delta keeps groups, in backward order, until ``pp_rank *
  delta_offload_bytes_across_pp_ranks`` bytes are kept; the fraction keeps the last
  ``int(n * (1 - fraction))`` of each chunk's n remaining eligible groups (forward order).
  On the last pipeline stage a chunk whose backward comes right after its forward keeps its
  last group of each name (``should_bulk_offload``). The warm-up iteration itself offloads
  everything; we model the steady state.
- Copies: each group is copied out as its module's forward ends (here: streamed out while the
  chunk's F runs, as our own OFFLOAD), and the copies back are driven by the backward: the
  first layer's at the end of the previous backward chunk (``pre_reload_last_layer``), the
  rest one layer ahead. Here the RELOAD is issued right after the rank's previous backward
  pass and the backward waits for all of it, which is slower than the layer-by-layer
  overlap when the copy back is longer than the gap (a bound in Megatron's favour on memory,
  against it on time). ``fine_grained_offloading_max_inflight_offloads`` = N: the compute
  stream waits until at most N copies out are unfinished (an OFFLOAD_WAIT before the next
  forward).
- Recompute (``--recompute-modules``, which Megatron combines with offloading): ``layernorm``
  drops both norms' outputs, ``mlp`` the MLP's hidden and activation tensors, ``core_attn``
  the attention output; they are recomputed before the backward (Note: [class accounting]).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeoffload.checks import check_number, check_optional
from pipeoffload.core.actions import OFFLOAD_KINDS, Action, Kind
from pipeoffload.core.classes import ClassChoice, TensorClass
from pipeoffload.core.schedule import Schedule
from pipeoffload.errors import ConfigError
from pipeoffload.offload.placement import ComputeIndex, insert
from pipeoffload.offload.plan import OffloadPolicy, add_offload
from pipeoffload.offload.targets import OffloadTarget, TargetKind
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.simulator import SimResult, simulate

Item = tuple[int, int]

#: Megatron's offload modules (dense layers) -> the tensor classes their groups hold, in the
#: order a layer's forward runs them.
OFFLOAD_MODULES: dict[str, tuple[str, ...]] = {
    "attn_norm": ("layer_input",),
    "qkv_linear": ("attn_norm",),
    "core_attn": ("qkv", "attn_out"),
    "attn_proj": ("attn_out",),
    "mlp_norm": ("mlp_input",),
}
#: Megatron's recompute modules -> the classes they drop and recompute.
RECOMPUTE_MODULES: dict[str, tuple[str, ...]] = {
    "layernorm": ("attn_norm", "mlp_norm"),
    "mlp": ("mlp_hidden", "mlp_act"),
    "core_attn": ("attn_out",),
}


@dataclass(frozen=True)
class MegatronPolicy:
    """Megatron-Core's knobs: ``modules`` (--offload-modules), ``fraction``
    (--activation-offload-fraction), ``delta_bytes`` (--delta-offload-bytes-across-pp-ranks),
    ``min_tensor_bytes`` (--min-offloaded-tensor-size, here in bytes of one layer's tensor),
    ``max_inflight`` (fine_grained_offloading_max_inflight_offloads), ``margin`` (the
    warm-up's kept groups), ``recompute`` (--recompute-modules)."""

    modules: tuple[str, ...]
    fraction: float = 1.0
    delta_bytes: float = 0.0
    min_tensor_bytes: float = 0.0
    max_inflight: int | None = None
    margin: bool = True
    recompute: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, table in (("modules", OFFLOAD_MODULES), ("recompute", RECOMPUTE_MODULES)):
            for module in getattr(self, name):
                if module not in table:
                    raise ConfigError(f"megatron {name}: unknown module {module!r} (choose "
                                      f"from {', '.join(table)})")
        check_number("MegatronPolicy.fraction", self.fraction, minimum=0, maximum=1)
        check_number("MegatronPolicy.delta_bytes", self.delta_bytes, minimum=0)
        check_number("MegatronPolicy.min_tensor_bytes", self.min_tensor_bytes, minimum=0)
        check_optional("MegatronPolicy.max_inflight", self.max_inflight, minimum=0,
                       integer=True)


@dataclass(frozen=True)
class _Group:
    layer: int
    module: str
    classes: tuple[TensorClass, ...]

    @property
    def share(self) -> float:
        return sum(c.share for c in self.classes)


def _groups(classes: Sequence[TensorClass], policy: MegatronPolicy, layers: int,
            chunk_bytes: float) -> list[_Group]:
    """One chunk's offload groups in forward order, each with its classes' per-layer parts
    (a class already in an earlier group of its layer, recomputed, or under the minimum size
    moves nothing more)."""
    by_name = {c.name: c for c in classes}
    dropped = {name for module in policy.recompute for name in RECOMPUTE_MODULES[module]}
    order = [m for m in OFFLOAD_MODULES if m in policy.modules]
    groups = []
    for layer in range(layers):
        taken: set[str] = set()
        for module in order:
            parts = []
            for name in OFFLOAD_MODULES[module]:
                c = by_name.get(name)
                if c is None or name in taken or name in dropped:
                    continue
                if c.share * chunk_bytes / layers < policy.min_tensor_bytes:
                    continue
                taken.add(name)
                parts.append(TensorClass(f"{layer}.{name}", c.share / layers))
            groups.append(_Group(layer, module, tuple(parts)))
    return groups


def megatron_choices(schedule: Schedule, classes: Sequence[TensorClass],
                     policy: MegatronPolicy, layers: int, chunk_bytes: float
                     ) -> dict[Item, ClassChoice]:
    """Per (stage, microbatch), the classes Megatron's policy moves and recomputes (the
    module docstring's post-warm-up rules, rank by rank)."""
    by_name = {c.name: c for c in classes}
    dropped = tuple(by_name[n] for m in policy.recompute for n in RECOMPUTE_MODULES[m]
                    if n in by_name)
    template = _groups(classes, policy, layers, chunk_bytes)
    choices: dict[Item, ClassChoice] = {}
    for rank, actions in enumerate(schedule.ranks):
        compute = [a for a in actions if a.kind.is_compute]
        backwards = [(a.stage, a.microbatch) for a in compute if a.kind in (Kind.I, Kind.B)]
        enabled = {item: [g.share > 0 for g in template] for item in backwards}
        _last_stage_rule(compute, template, enabled)
        if policy.margin and backwards:
            _keep_last_of_each_name(template, enabled[backwards[0]])
        keep = rank * policy.delta_bytes
        for item in backwards:
            for i, group in enumerate(template):
                if keep > 0 and enabled[item][i]:
                    keep -= group.share * chunk_bytes
                    enabled[item][i] = False
        for item in backwards:
            on = [i for i, flag in enumerate(enabled[item]) if flag]
            for i in on[len(on) - int(len(on) * (1 - policy.fraction)):]:
                enabled[item][i] = False
            moved = tuple(c for i, g in enumerate(template) if enabled[item][i]
                          for c in g.classes)
            choices[item] = ClassChoice(moved, dropped)
    return choices


def _last_stage_rule(compute: list[Action], template: list[_Group],
                     enabled: dict[Item, list[bool]]) -> None:
    """A chunk whose backward is the next compute action after its forward keeps its last
    group of each name (Megatron's ``should_bulk_offload``)."""
    for a, b in zip(compute, compute[1:]):
        if a.kind is Kind.F and b.kind in (Kind.I, Kind.B) and (a.stage, a.microbatch) == (
                b.stage, b.microbatch):
            _keep_last_of_each_name(template, enabled[(a.stage, a.microbatch)])


def _keep_last_of_each_name(template: list[_Group], flags: list[bool]) -> None:
    seen: set[str] = set()
    for i in reversed(range(len(template))):
        if template[i].module not in seen:
            seen.add(template[i].module)
            flags[i] = False


def megatron_plan(schedule: Schedule, costs: CostModel, classes: Sequence[TensorClass],
                  policy: MegatronPolicy, layers: int, chunk_bytes: float = 1.0, *,
                  planned_reloads: bool = False) -> tuple[Schedule, SimResult]:
    """``schedule`` with Megatron's policy's transfers (module docstring), and its
    simulation. ``layers``: layers per stage; ``chunk_bytes``: one chunk's saved bytes (for
    the delta and the minimum size). ``planned_reloads``: Megatron's choice of what moves, but
    the copies back placed by our planner (``add_offload``, every item kept, stalls allowed)
    instead of Megatron's backward-driven ones: the benefit of the doubt on time, where our
    model of its layer-by-layer reloads is pessimistic."""
    if layers < 1:
        raise ConfigError(f"megatron: layers per stage must be >= 1, got {layers}")
    bare = schedule.without(*OFFLOAD_KINDS)
    choices = megatron_choices(bare, classes, policy, layers, chunk_bytes)
    bare = bare.with_classes(choices)
    if planned_reloads:
        plan = add_offload(bare, costs, OffloadTarget(TargetKind.ALL, allow_stall=True),
                           OffloadPolicy(max_pending_offloads=policy.max_inflight))
        return plan.schedule, plan.result
    index = ComputeIndex(bare)
    leads: dict[Item, int] = {}
    waits: dict[Action, Item] = {}
    for compute in index.compute:
        last_backward, pending, forward = -1, [], {}
        for i, a in enumerate(compute):
            item = (a.stage, a.microbatch)
            if a.kind is Kind.F:
                forward[item] = i
            if a.kind is Kind.F and choices[item].moved > 0:
                pending.append(item)
                cap = policy.max_inflight
                if cap is not None and len(pending) > cap and i + 1 < len(compute):
                    waits.setdefault(compute[i + 1], pending[-1 - cap])
            elif a.kind in (Kind.I, Kind.B):
                if choices[item].moved > 0:
                    # after the previous backward, and after its own forward
                    leads[item] = i - max(last_backward, forward[item]) - 1
                last_backward = i
    planned = insert(index, leads, waits, set())
    return planned, simulate(planned, costs)
