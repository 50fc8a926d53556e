"""Tied parameters: one parameter used by stages on different ranks (tied input / output
embeddings). Each rank holds its own copy; after a step every copy gets the summed gradient.

Note: [tied parameters] a tie is named and says, for every stage that uses it, which of that
stage's parameters it is: ``Pipeline(tied={"embed": {0: "tok.weight", 5: "head.weight"}})``, or
the same mapping in a stage module's ``tied_parameters`` attribute (pipeoffload.hf sets it on
every stage it makes). The mapping covers all stages, so every rank knows which ranks hold the
tie without asking them, and nothing is communicated for a pipeline without ties. In one process
(local mode) stages usually share one Parameter and autograd already sums; distinct copies are
summed, as they are when all the tie's stages sit on one rank of a distributed pipeline (the
first and last stage of a V schedule). A tie across ranks has the gradient each rank computed
in this step all-reduced (sum) over the pipeline group, ranks without the tie adding zeros
(every rank joins: each knows the tie's ranks from the mapping), with the P2P timeout; earlier
accumulated gradients are kept as they were (no double counting). The copies stay equal if they
start equal and the optimizer is the same on every rank. Every tensor posted lives on the
pipeline's device (NCCL refuses host tensors; tests/test_device_collectives.py).

Note: [sharded ties] Stages sharded by FSDP2 (``--zero 3``) hold a tied parameter as a DTensor
of 1/dp rows, and by ``finish_step`` FSDP has reduce-scattered its gradient into the same
layout (averaged over the replicas). The tie's holders of one data-parallel index hold the same
rows of the same shape (dim-0 shards over groups of the same size), so summing the local shards
over the pipeline group (whose ranks share the data-parallel index) sums the tie's gradient
shard by shard: what summing the whole gradients then sharding would give, elementwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from pipeoffload.core.schedule import Schedule
from pipeoffload.errors import ConfigError, PipelineRuntimeError
from pipeoffload.runtime.shards import ShardLayout, is_dtensor, local_shard

TiedSpec = Mapping[str, Mapping[int, str]]
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def merge_ties(specs: Iterable[TiedSpec], num_stages: int) -> dict[str, dict[int, str]]:
    """One spec from several (the argument and the modules' attributes); they must agree."""
    merged: dict[str, dict[int, str]] = {}
    for spec in specs:
        for name, where in spec.items():
            entry = merged.setdefault(name, {})
            for stage, param_name in where.items():
                if not 0 <= stage < num_stages:
                    raise ConfigError(f"tie {name!r} names stage {stage}, but the schedule has "
                                      f"stages 0..{num_stages - 1}")
                if entry.setdefault(stage, param_name) != param_name:
                    raise ConfigError(f"tie {name!r} is {entry[stage]!r} and {param_name!r} on "
                                      f"stage {stage}; declare one parameter per stage")
    return merged


class TiedGradients:
    """Sums tied parameters' gradients of one step (see the Note)."""

    def __init__(self, spec: dict[str, dict[int, str]], stages: Mapping[int, nn.Module],
                 schedule: Schedule, group: dist.ProcessGroup | None, device: torch.device,
                 distributed: bool, timeout_s: float) -> None:
        self._params: dict[str, list[nn.Parameter]] = {}
        shared, across = [], set()
        for name, where in sorted(spec.items()):
            params = self._params.setdefault(name, [])
            for stage, param_name in where.items():
                if stage in stages:
                    param = _parameter(stages[stage], name, stage, param_name)
                    if all(p is not param for p in params):
                        params.append(param)
            if any(p.shape != params[0].shape or _grad_dtype(p) != _grad_dtype(params[0])
                   for p in params):
                raise ConfigError(f"tie {name!r} joins parameters of different shapes or dtypes "
                                  f"{[(list(p.shape), p.dtype) for p in params]}")
            ranks = {schedule.rank_of(s) for s in where}
            if len(ranks) > 1 and distributed:
                across.add(name)  # every rank knows: all of them join its all-reduce
            if name in across or len(params) > 1:
                shared.append(name)
        self._shared = shared
        self._group = group
        self._device = device
        self._distributed = distributed
        self._across = across  # ties on several ranks (the rest are summed in this process)
        self._timeout = timedelta(seconds=timeout_s)
        self._meta: dict[str, tuple[int, torch.dtype]] = {}
        self._before: dict[int, torch.Tensor | None] = {}

    @property
    def names(self) -> list[str]:
        """Ties whose gradients are summed (held by several ranks or copies)."""
        return list(self._shared)

    def begin_step(self) -> None:
        """Set earlier gradients aside so that only this step's are summed."""
        self._before = {}
        for name in self._shared:
            for p in self._params[name]:
                self._before[id(p)] = p.grad
                p.grad = None

    def finish_step(self) -> None:
        """Sum this step's gradients over the ranks and add back what was set aside."""
        for name in self._shared:
            params = self._params[name]
            numel, dtype = self._agree(name)
            total = torch.zeros(numel, dtype=dtype, device=self._device)
            for p in params:
                if p.grad is not None:
                    total += local_shard(p.grad).reshape(-1)
            if name in self._across:
                self._all_reduce(total, f"the gradient of tied parameter {name!r}")
            for p in params:
                before = self._before.get(id(p))
                summed = total.view(local_shard(p).shape).clone()
                if is_dtensor(p):  # an FSDP2 shard (Note: [sharded ties])
                    summed = ShardLayout.of(p).rebuild(summed)
                p.grad = summed if before is None else before + summed
        self._before = {}

    def abandon(self) -> None:
        """A failed step: put the earlier gradients back."""
        for name in self._shared:
            for p in self._params[name]:
                if id(p) in self._before:
                    p.grad = self._before[id(p)]
        self._before = {}

    def _agree(self, name: str) -> tuple[int, torch.dtype]:
        """Size and dtype of the tie, the same on every rank (learnt once, from its holders)."""
        if name in self._meta:
            return self._meta[name]
        params = self._params[name]
        numel = local_shard(params[0]).numel() if params else 0
        code = _DTYPES.index(_grad_dtype(params[0])) if params else 0
        if name not in self._across:
            self._meta[name] = numel, _grad_dtype(params[0])
            return self._meta[name]
        # max and (negated) min of the holders' numel and dtype in one all-reduce
        big = 1 << 62
        # On the pipeline's device: an NCCL group takes device tensors only.
        mine = torch.tensor([numel if params else -1, -numel if params else -big,
                             code if params else -1, -code if params else -big],
                            device=self._device)
        self._all_reduce(mine, f"the size of tied parameter {name!r}", dist.ReduceOp.MAX)
        top_numel, low_numel, top_code, low_code = mine.tolist()
        if top_numel != -low_numel or top_code != -low_code:
            raise ConfigError(
                f"tied parameter {name!r} has different sizes or dtypes on different ranks; "
                "tie parameters of the same shape and dtype")
        self._meta[name] = int(top_numel), _DTYPES[int(top_code)]
        return self._meta[name]

    def _all_reduce(self, tensor: torch.Tensor, what: str,
                    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        work = dist.all_reduce(tensor, op=op, group=self._group, async_op=True)
        try:
            work.wait(self._timeout)
        except RuntimeError as error:
            raise PipelineRuntimeError(
                f"rank {dist.get_rank()}: summing {what} over the pipeline's ranks did not "
                f"finish within {self._timeout.total_seconds():g} s ({error}); every rank must "
                "run step() with the same tied parameters declared") from error


def _grad_dtype(param: nn.Parameter) -> torch.dtype:
    """The dtype of ``param``'s gradient: float32 for bf16 weights whose gradients accumulate
    in float32 (parallel/precision.py Note: [mixed precision])."""
    return getattr(param, "grad_dtype", None) or param.dtype


def _parameter(module: nn.Module, name: str, stage: int, param_name: str) -> nn.Parameter:
    params = dict(module.named_parameters(remove_duplicate=False))
    if param_name not in params:
        raise ConfigError(f"tie {name!r}: stage {stage} has no parameter {param_name!r} (it has "
                          f"{sorted(params)[:6]}...); name a parameter of that stage")
    return params[param_name]
