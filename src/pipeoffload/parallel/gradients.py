"""Gradients across a pipeline: averaging over data-parallel replicas, which parameters count
once in a global norm (tied copies do not, Note: [tied parameters]), and clipping by the norm
over every stage and rank."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set

import torch
import torch.distributed as dist
from torch import nn

from pipeoffload.parallel.arguments import stage_modules
from pipeoffload.parallel.topology import Topology
from pipeoffload.runtime.shards import is_dtensor, local_shard
from pipeoffload.runtime.tied import TiedSpec, merge_ties


def tie_copy_names(stages: Mapping[int, nn.Module],
                   tied: TiedSpec | None = None) -> set[tuple[int, str]]:
    """(stage, parameter name) of every copy of a tie held by a lower stage: after Pipeline's
    step every copy holds the tie's whole gradient and value, so norms and exports take it
    from its lowest stage only. Ties come from ``tied`` and the modules' ``tied_parameters``,
    as Pipeline reads them."""
    specs = [tied or {}, *(getattr(m, "tied_parameters", {}) for m in stages.values())]
    named = [s for spec in specs for where in spec.values() for s in where]
    copies: set[tuple[int, str]] = set()
    for where in merge_ties(specs, max([*stages, *named], default=0) + 1).values():
        owner = min(where)
        copies.update((s, name) for s, name in where.items() if s != owner and s in stages)
    return copies


def tie_copies(stages: Mapping[int, nn.Module], tied: TiedSpec | None = None) -> set[int]:
    """ids of the parameters tie_copy_names names (a Parameter this process shares with the
    tie's lowest stage belongs to that stage and is not among them)."""
    stage_modules("tie_copies: stages", stages)
    names = tie_copy_names(stages, tied)
    copies: set[int] = set()
    owned: set[int] = set()
    for s, module in stages.items():
        for name, p in module.named_parameters(remove_duplicate=False):
            (copies if (s, name) in names else owned).add(id(p))
    return copies - owned


def unique_params(stages: Mapping[int, nn.Module]) -> list[torch.Tensor]:
    """The stages' parameters in stage order, each once."""
    seen: set[int] = set()
    params: list[torch.Tensor] = []
    for s in sorted(stages):
        for p in stages[s].parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def sync_gradients(params: Mapping[int, list[torch.Tensor]], topology: Topology | None) -> None:
    """Average gradients over data-parallel replicas and context-parallel ranks (one
    all-reduce per stage over ``topology.grad_group``): each context-parallel rank holds the
    gradient of its share of the whole-sequence mean loss's terms, so their mean is the
    gradient of that loss (parallel/context.py).

    Gradients of DTensor parameters are this rank's shards: the all-reduce moves shards.
    Clipping is clip_gradients, after this.
    """
    if topology is None or not topology.distributed or topology.grad_replicas == 1:
        return
    replicas = topology.grad_group if topology.grad_group is not None else topology.dp_group
    for group in ([p.grad for p in ps if p.grad is not None] for ps in params.values()):
        if not group:  # the same on every replica of this pipeline rank
            continue
        locals_ = [local_shard(g) for g in group]
        flat = torch.cat([g.reshape(-1) for g in locals_])
        dist.all_reduce(flat, group=replicas)
        flat /= topology.grad_replicas
        offset = 0
        for g in locals_:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def clip_gradients(params: Iterable[torch.Tensor], max_norm: float | None,
                   topology: Topology | None, uncounted: Set[int] = frozenset()) -> float:
    """Scale the gradients of ``params`` (this process's, each once) in place so that the
    global norm over the pipeline and tensor-parallel ranks is at most ``max_norm`` (None: only
    measure); returns that norm. Parameters whose id is in ``uncounted`` (tie copies) are
    scaled but left out of the norm. ``topology`` None: one process.
    Squares are summed in float64: sharded DTensor gradients over the tensor-parallel group,
    then everything over the pipeline group; replicated ones count once. Data-parallel
    replicas must already hold the same (averaged) gradients."""
    held = [(p, p.grad) for p in params if p.grad is not None]
    grads = [g for _, g in held]
    counted = [g for p, g in held if id(p) not in uncounted]
    sharded = [g for g in counted if is_dtensor(g) and any(
        p.is_shard() for p in g.placements)]  # type: ignore[attr-defined]  # a DTensor
    whole = [g for g in counted if not any(g is h for h in sharded)]

    # On the training device: NCCL takes device tensors only, a rank without gradients too.
    device = (topology.device if topology is not None else None) or torch.device("cpu")

    def squares(group: list[torch.Tensor]) -> torch.Tensor:
        values = [local_shard(g).double().pow(2).sum() for g in group]
        return (torch.stack(values).sum() if values
                else torch.zeros((), dtype=torch.float64, device=device))

    part = squares(sharded)
    if topology is not None and topology.distributed and topology.tp > 1 and sharded:
        dist.all_reduce(part, group=topology.tp_mesh.get_group())
    total = part + squares(whole)
    if topology is not None and topology.distributed and topology.pp > 1:
        dist.all_reduce(total, group=topology.pp_group)
    norm = total.sqrt().item()
    scale_gradients(grads, norm, max_norm)
    return norm


def scale_gradients(grads: Iterable[torch.Tensor], norm: float, max_norm: float | None) -> None:
    """Scale ``grads`` in place so that a global norm of ``norm`` becomes at most ``max_norm``
    (None: leave them)."""
    scale = 1.0 if max_norm is None else max_norm / (norm + 1e-6)
    if scale < 1:
        for g in grads:
            local_shard(g).mul_(scale)


def uncounted_masters(stages: Mapping[int, nn.Module],
                      masters: Mapping[int, list[torch.Tensor]]) -> set[int]:
    """ids of the master weights (precision.MasterWeights.params, one per trainable parameter
    of each stage) of tie copies (tie_copies): their gradients are clipped with the others
    but left out of the norm."""
    copies = tie_copies(stages)
    return {id(master) for s in sorted(stages)
            for p, master in zip([p for p in stages[s].parameters() if p.requires_grad],
                                 masters[s]) if id(p) in copies}
