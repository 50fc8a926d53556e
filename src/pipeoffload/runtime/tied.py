"""Tied parameters: one parameter used by stages on different ranks (tied input / output
embeddings). Each rank holds its own copy; after a step every copy gets the summed gradient.

Note: [tied parameters] a tie is named, and each stage holding it says which of its parameters it
is: ``Pipeline(tied={"embed": {0: "tok.weight", 5: "head.weight"}})``, or the stage module's own
``tied_parameters`` attribute (``{"head.weight": "embed"}``; pipeoffload.hf sets it). In one
process (local mode) the stages share one Parameter and autograd already sums. Under
torch.distributed the gradient each rank computed in this step is all-reduced (sum) over the
pipeline group, ranks without the tie adding zeros, and gradients from earlier steps are kept as
they were (no double counting). The copies stay equal if they start equal and the optimizer is
the same on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from pipeoffload.errors import ConfigError

TiedSpec = Mapping[str, Mapping[int, str]]


def local_ties(stages: Mapping[int, nn.Module],
               tied: TiedSpec | None) -> dict[str, list[nn.Parameter]]:
    """Tie name -> this process's distinct parameters for it (declared or from the modules)."""
    found: dict[str, list[nn.Parameter]] = {}

    def add(name: str, stage: int, param_name: str) -> None:
        params = dict(stages[stage].named_parameters(remove_duplicate=False))
        if param_name not in params:
            raise ConfigError(f"tie {name!r}: stage {stage} has no parameter {param_name!r} "
                              f"(it has {sorted(params)[:6]}...); name a parameter of that stage")
        param = params[param_name]
        chosen = found.setdefault(name, [])
        if all(p is not param for p in chosen):
            chosen.append(param)

    for name, where in (tied or {}).items():
        for stage, param_name in where.items():
            if stage in stages:
                add(name, stage, param_name)
    for stage, module in stages.items():
        for param_name, name in getattr(module, "tied_parameters", {}).items():
            add(name, stage, param_name)
    return found


class TiedGradients:
    """All-reduces tied parameters' gradients of one step over ``group`` (see the Note); in
    one process (``distributed=False``) it sums over distinct local copies only."""

    def __init__(self, ties: dict[str, list[nn.Parameter]], group: dist.ProcessGroup | None,
                 device: torch.device, distributed: bool) -> None:
        mine = {name: (tuple(ps[0].shape), str(ps[0].dtype)) for name, ps in ties.items()}
        for name, params in ties.items():
            if any(p.shape != params[0].shape or p.dtype != params[0].dtype for p in params):
                raise ConfigError(f"tie {name!r} joins parameters of different shapes or dtypes "
                                  f"{[(list(p.shape), p.dtype) for p in params]}")
        gathered: list[dict] = [mine]
        if distributed:
            gathered = [{} for _ in range(dist.get_world_size(group))]
            dist.all_gather_object(gathered, mine, group=group)
        self._distributed = distributed
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}
        for rank, theirs in enumerate(gathered):
            for name, meta in theirs.items():
                if self._meta.setdefault(name, meta) != meta:
                    raise ConfigError(
                        f"tie {name!r} is a {list(meta[0])} {meta[1]} parameter on rank {rank} "
                        f"but a {list(self._meta[name][0])} {self._meta[name][1]} one elsewhere; "
                        "tied parameters must have the same shape and dtype on every rank")
        self._shared = sorted(n for n in self._meta
                              if sum(n in theirs for theirs in gathered) > 1
                              or len(ties.get(n, ())) > 1)
        self._ties = ties
        self._group = group
        self._device = device
        self._before: dict[int, torch.Tensor | None] = {}

    @property
    def names(self) -> list[str]:
        """Ties held by more than one rank (those whose gradients are all-reduced)."""
        return list(self._shared)

    def begin_step(self) -> None:
        """Set earlier gradients aside so that only this step's are summed."""
        self._before = {}
        for name in self._shared:
            for p in self._ties.get(name, []):
                self._before[id(p)] = p.grad
                p.grad = None

    def finish_step(self) -> None:
        """Sum this step's gradients over the ranks and add back what was set aside."""
        for name in self._shared:
            params = self._ties.get(name, [])
            shape, dtype = self._meta[name]
            total = torch.zeros(shape, dtype=getattr(torch, dtype.removeprefix("torch.")),
                                device=self._device)
            for p in params:
                if p.grad is not None:
                    total += p.grad
            if self._distributed:
                dist.all_reduce(total, group=self._group)
            for p in params:
                before = self._before.get(id(p))
                p.grad = total.clone() if before is None else before + total
        self._before = {}

    def abandon(self) -> None:
        """A failed step: put the earlier gradients back."""
        for name in self._shared:
            for p in self._ties.get(name, []):
                if id(p) in self._before:
                    p.grad = self._before[id(p)]
        self._before = {}
