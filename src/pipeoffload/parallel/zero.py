"""ZeRO-1, Megatron's distributed optimizer: AdamW whose float32 master weights and moments are
sharded over the ranks gradients are averaged over, the data-parallel replicas times the
context-parallel ranks (``ZeroAdamW``, a parallel/optimizer.py PipelineOptimizer).

Note: [zero-1 layout] Per stage, this process's trainable parameters (their local shards under
tensor parallelism, which are thus sharded again over dp) are grouped into buckets of about
``bucket_numel`` elements, from the last parameter back (the order a backward produces their
gradients in). The state is sharded over D = dp * cp ranks, Megatron's data-parallel group
with context parallelism (``Topology.grad_group``): each context-parallel rank holds the
gradient of its part of every sequence, so gradients are averaged over all D of them
(parallel/gradients.py sync_gradients). A bucket's parameters lie end to end in one flat
vector of N elements, padded with zeros to a multiple of D (fewer than D elements per
bucket); shard d (``Topology.grad_index``) owns elements [d * N_pad / D, (d + 1) * N_pad / D)
of every bucket and holds only those of the float32 masters, of the two AdamW moments and of
the averaged gradient, bucket after bucket in one tensor. A step: each bucket's gradients
(float32, parallel/precision.py Note: [mixed precision]) are reduce-scattered over that
group, started as soon as its parameters have accumulated the step's last microbatch (a
hook; buckets holding a tie wait for Pipeline's tie sum after the backward), and divided by
D (the sum of two values does not depend on the order, so at D = 2 this is bitwise the
all-reduce of ``sync_gradients``); the
global norm sums each element's square once (tie copies and replicated tensor-parallel
parameters as ``clip_gradients`` counts them); AdamW updates the local shard (elementwise, as
it updates each parameter whole); the updated shards, cast to the parameters' dtype, are
all-gathered bucket by bucket into the parameters before the next forward. Checkpoints keep
each shard in its own file (parallel/checkpoint.py Note: [sharded optimizer checkpoint]).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeoffload.parallel.gradients import scale_gradients, tie_copies
from pipeoffload.parallel.optimizer import MOMENTS, StageState, set_learning_rate
from pipeoffload.parallel.precision import accumulate_in_float32
from pipeoffload.parallel.topology import Topology
from pipeoffload.runtime.shards import ShardLayout, is_dtensor, local_shard
from pipeoffload.runtime.tied import TiedSpec, merge_ties

#: Elements per bucket of gradients reduce-scattered together (Megatron's default
#: --ddp-bucket-size is 40M elements; a bucket holds whole parameters, so it can be larger).
BUCKET_NUMEL = 40_000_000


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter of a bucket lies in its flat vector, and shard ``index``'s span of
    it, of ``dp`` shards (Note: [zero-1 layout])."""

    numels: tuple[int, ...]
    dp: int
    index: int
    dtype: torch.dtype = torch.float32

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def shard_numel(self) -> int:
        return -(-self.total // self.dp)

    @property
    def start(self) -> int:
        return self.index * self.shard_numel

    def spans(self) -> list[tuple[int, int]]:
        """Each parameter's [begin, end) in the flat vector."""
        ends = torch.tensor(self.numels).cumsum(0).tolist() if self.numels else []
        return [(end - n, end) for n, end in zip(self.numels, ends)]

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The parameters' values (one per parameter, any dtype) as the padded flat vector."""
        flat = torch.zeros(self.shard_numel * self.dp, dtype=self.dtype,
                           device=tensors[0].device if tensors else None)
        for (begin, end), t in zip(self.spans(), tensors):
            flat[begin:end] = local_shard(t).detach().reshape(-1)
        return flat

    def mine(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.start:self.start + self.shard_numel].clone()


def bucket_indices(numels: Sequence[int], bucket_numel: int) -> list[list[int]]:
    """A stage's parameters (by index) in buckets of at least ``bucket_numel`` elements (the
    last may hold fewer), from the last parameter back: the order a backward produces their
    gradients in."""
    buckets: list[list[int]] = []
    size = bucket_numel
    for i in reversed(range(len(numels))):
        if size >= bucket_numel:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += numels[i]
    return buckets


class _Bucket:
    """Some of a stage's parameters (``indices``), their flat layout and where this process's
    shard of it lies in the stage's master shard (``offset``); ``pending``: its gradients'
    reduce-scatter in flight (work, output, input), started once every parameter has
    accumulated all ``count`` microbatches of the step."""

    def __init__(self, indices: list[int], layout: FlatLayout, offset: int) -> None:
        self.indices = indices
        self.layout = layout
        self.offset = offset
        self.count = 0
        self.pending: tuple[Any, torch.Tensor, torch.Tensor] | None = None


class _Stage:
    """One stage's share: its trainable parameters, buckets, float32 master shard (whose
    ``.grad`` is the averaged gradient shard) and the shard's elements the global norm counts,
    by kind: summed over the tensor-parallel group (``sharded``) or once (``whole``)."""

    def __init__(self, module: nn.Module, topology: Topology, copies: set[int],
                 bucket_numel: int) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in self.params) else (
            torch.float32)  # float32 masters, but an fp64 run stays fp64
        numels = [local_shard(p).numel() for p in self.params]
        dp, index = ((topology.grad_replicas, topology.grad_index) if topology.distributed
                     else (1, 0))
        self.buckets: list[_Bucket] = []
        offset = 0
        for indices in bucket_indices(numels, bucket_numel):
            layout = FlatLayout(tuple(numels[i] for i in indices), dp, index, dtype)
            self.buckets.append(_Bucket(indices, layout, offset))
            offset += layout.shard_numel
        self.master = self.shard_of(self.params, dtype).requires_grad_()
        self.sharded = torch.zeros(offset, dtype=torch.bool)
        self.whole = torch.zeros(offset, dtype=torch.bool)
        for bucket in self.buckets:
            lo, hi = bucket.layout.start, bucket.layout.start + bucket.layout.shard_numel
            for i, (begin, end) in zip(bucket.indices, bucket.layout.spans()):
                p = self.params[i]
                if id(p) in copies or end <= lo or begin >= hi:
                    continue
                tp_sharded = is_dtensor(p) and any(
                    pl.is_shard() for pl in p.placements)  # type: ignore[attr-defined]  # DTensor
                mask = self.sharded if tp_sharded else self.whole
                at = bucket.offset - lo
                mask[max(begin, lo) + at:min(end, hi) + at] = True

    def shard_of(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """This process's shard of per-parameter ``tensors`` (values, moments), bucket by
        bucket."""
        parts = [b.layout.mine(b.layout.flatten([tensors[i] for i in b.indices]))
                 for b in self.buckets]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


class ZeroAdamW:
    """AdamW per stage over float32 master weights sharded over the data-parallel replicas
    and context-parallel ranks (Note: [zero-1 layout]); a PipelineOptimizer. ``topology`` None
    or without torch.distributed: one shard, the whole state here. ``microbatches``: how many
    gradients each parameter accumulates per step; given, a bucket's reduce-scatter starts as
    soon as its last one is in (during the pipeline's drain), except for buckets holding a tie
    (``tied`` and the modules' ``tied_parameters``), whose gradients Pipeline sums after the
    backward."""

    sharded = True

    def __init__(self, stages: Mapping[int, nn.Module], topology: Topology | None, *, lr: float,
                 betas: tuple[float, float], weight_decay: float, microbatches: int | None = None,
                 bucket_numel: int = BUCKET_NUMEL, tied: TiedSpec | None = None) -> None:
        self.topology = topology if topology is not None else Topology(pp=1, dp=1)
        params: list[torch.Tensor] = [p for m in stages.values() for p in m.parameters()
                                      if p.requires_grad]
        if any(p.dtype == torch.bfloat16 for p in params):
            accumulate_in_float32(params)
        copies = tie_copies(stages, tied)
        self._stages = {s: _Stage(m, self.topology, copies, bucket_numel)
                        for s, m in sorted(stages.items())}
        self._optimizers = {s: torch.optim.AdamW([st.master], lr=lr, betas=betas,
                                                 weight_decay=weight_decay)
                            for s, st in self._stages.items()}
        if microbatches is not None and self._dp > 1:
            self._start_early(microbatches, tied_ids(stages, tied))

    @property
    def _dp(self) -> int:
        """How many shards: dp * cp (Note: [zero-1 layout])."""
        return self.topology.grad_replicas if self.topology.distributed else 1

    @property
    def _group(self) -> Any:
        """The data- x context-parallel group the shards are spread over."""
        topology = self.topology
        return topology.grad_group if topology.grad_group is not None else topology.dp_group

    @property
    def params(self) -> Mapping[int, list[torch.Tensor]]:
        """Per stage, the one tensor it updates: the local master shard."""
        return {s: [st.master] for s, st in self._stages.items()}

    def in_flight(self) -> tuple[int, int]:
        """(buckets whose reduce-scatter has started, all buckets) of this process now."""
        buckets = [b for st in self._stages.values() for b in st.buckets]
        return sum(b.pending is not None for b in buckets), len(buckets)

    def _start_early(self, microbatches: int, tied: set[int]) -> None:
        """Hook each untied bucket's parameters: the step's last accumulation into the bucket
        starts its reduce-scatter."""
        for st in self._stages.values():
            for bucket in st.buckets:
                members = [st.params[i] for i in bucket.indices]
                if any(id(p) in tied for p in members):
                    continue
                due = microbatches * len(members)
                for p in members:
                    p.register_post_accumulate_grad_hook(
                        functools.partial(self._accumulated, st, bucket, due))

    def _accumulated(self, st: _Stage, bucket: _Bucket, due: int, _: torch.Tensor) -> None:
        bucket.count += 1
        if bucket.count == due and bucket.pending is None:
            bucket.pending = self._reduce_scatter(st, bucket, async_op=True)

    def _reduce_scatter(self, st: _Stage, bucket: _Bucket, *, async_op: bool
                        ) -> tuple[Any, torch.Tensor, torch.Tensor]:
        flat = bucket.layout.flatten([_grad_shard(st.params[i]) for i in bucket.indices])
        out = torch.empty(bucket.layout.shard_numel, dtype=flat.dtype, device=flat.device)
        work = dist.reduce_scatter_single(out, flat, group=self._group,
                                          async_op=async_op)
        return work, out, flat

    def take_grads(self) -> None:
        """Each stage's gradients, summed over the shards' ranks by the buckets'
        reduce-scatters (those not started yet start now), divided by dp * cp into its master
        shard's ``.grad``; the parameters' gradients are freed."""
        for st in self._stages.values():
            grad = torch.empty_like(st.master)
            for bucket in st.buckets:
                part = grad[bucket.offset:bucket.offset + bucket.layout.shard_numel]
                if self._dp == 1:
                    part.copy_(bucket.layout.flatten([_grad_shard(st.params[i])
                                                      for i in bucket.indices]))
                    continue
                work, out, _ = bucket.pending or self._reduce_scatter(st, bucket, async_op=False)
                if work is not None:
                    work.wait()
                part.copy_(out)
            if self._dp > 1:
                grad /= self._dp
            st.master.grad = grad
            self._reset(st)

    def _reset(self, st: _Stage) -> None:
        for bucket in st.buckets:
            if bucket.pending is not None and bucket.pending[0] is not None:
                bucket.pending[0].wait()
            bucket.pending, bucket.count = None, 0
        for p in st.params:
            p.grad = None

    def reduce_grads(self) -> None:
        """Nothing: take_grads has averaged them."""

    def clip_grads(self, max_norm: float | None) -> float:
        """Scale the gradient shards so the global norm is at most ``max_norm`` (None: only
        measure); returns the norm (a collective over every rank)."""
        topology = self.topology
        device = next((st.master.device for st in self._stages.values()),
                      topology.device or torch.device("cpu"))
        parts = torch.zeros(2, dtype=torch.float64, device=device)
        for st in self._stages.values():
            grad = st.master.grad
            assert grad is not None
            squares = grad.double().pow(2)
            parts[0] += squares[st.sharded.to(device)].sum()
            parts[1] += squares[st.whole.to(device)].sum()
        if topology.distributed:
            if self._dp > 1:
                dist.all_reduce(parts, group=self._group)
            if topology.tp > 1:
                dist.all_reduce(parts[:1], group=topology.tp_mesh.get_group())
            total = parts.sum()
            if topology.pp > 1:
                dist.all_reduce(total, group=topology.pp_group)
        else:
            total = parts.sum()
        norm = total.sqrt().item()
        scale_gradients([st.master.grad for st in self._stages.values()
                         if st.master.grad is not None], norm, max_norm)
        return norm

    def set_lr(self, lr: float) -> None:
        set_learning_rate(self._optimizers.values(), lr)

    @torch.no_grad()
    def step(self) -> None:
        """Update the local shards, then all-gather them into the parameters (in their dtype)."""
        for s, st in self._stages.items():
            self._optimizers[s].step()
            dtype = st.params[0].dtype if st.params else torch.float32
            for p, value in zip(st.params, self._whole(st, dtype)):
                local_shard(p).copy_(value)

    def _whole(self, st: _Stage, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every parameter's (local) value from the replicas' master shards, cast to ``dtype``
        first: one all-gather per bucket."""
        values: dict[int, torch.Tensor] = {}
        for bucket in st.buckets:
            size = bucket.layout.shard_numel
            shard = st.master.detach()[bucket.offset:bucket.offset + size].to(dtype)
            flat = shard
            if self._dp > 1:
                flat = torch.empty(size * self._dp, dtype=dtype, device=shard.device)
                dist.all_gather_single(flat, shard.contiguous(), group=self._group)
            for i, (begin, end) in zip(bucket.indices, bucket.layout.spans()):
                values[i] = flat[begin:end].view_as(local_shard(st.params[i]))
        return [values[i] for i in range(len(st.params))]

    @torch.no_grad()
    def master_weights(self) -> Mapping[int, list[torch.Tensor]]:
        """Per stage, every trainable parameter's float32 master, gathered whole over the
        data- x context-parallel group (a collective) and in the parameter's tensor-parallel
        layout."""
        return {s: [ShardLayout.of(p).rebuild(v.clone()) if is_dtensor(p) else v.clone()
                    for p, v in zip(st.params, self._whole(st, st.master.dtype))]
                for s, st in self._stages.items()}

    def zero_grad(self) -> None:
        """Drop the gradients, the masters' and any a backward outside a step left (its
        reduce-scatters are waited for)."""
        for st in self._stages.values():
            st.master.grad = None
            self._reset(st)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of this process's float32 masters and AdamW moments, from the tensors."""
        masters = moments = 0
        for s, st in self._stages.items():
            masters += st.master.numel() * st.master.element_size()
            state = self._optimizers[s].state.get(st.master, {})
            moments += sum(state[k].numel() * state[k].element_size()
                           for k in MOMENTS if k in state)
        return {"masters": masters, "moments": moments}

    def stage_state(self, stage: int) -> StageState:
        """This process's shard of the stage (Note: [sharded optimizer checkpoint])."""
        st = self._stages[stage]
        saved = self._optimizers[stage].state_dict()
        state = saved["state"].get(0, {})
        group = {k: v for k, v in saved["param_groups"][0].items() if k != "params"}
        shard: dict[str, Any] = {
            "numels": [local_shard(p).numel() for p in st.params],
            "shapes": [list(local_shard(p).shape) for p in st.params],
            "buckets": [b.indices for b in st.buckets], "master": st.master.detach(),
            "param_group": group,
            "step": state.get("step"), **{k: state[k] for k in MOMENTS if k in state}}
        return StageState({"shard": shard}, None)

    def load_stage_state(self, stage: int, saved: Mapping[str, Any]) -> None:
        """Restore from a stage's whole state as StageAdamW saves it (checkpoint.py joins the
        shards into that form, whatever dp, cp and zero level wrote them)."""
        st = self._stages[stage]
        masters, optimizer = saved["masters"], saved["optimizer"]
        if len(masters) != len(st.params):
            raise ValueError(f"{len(masters)} master tensors saved, {len(st.params)} here")
        with torch.no_grad():
            st.master.copy_(st.shard_of(masters, st.master.dtype))
        state = optimizer["state"]
        group = {**optimizer["param_groups"][0], "params": [0]}
        if not state:
            self._optimizers[stage].load_state_dict({"state": {}, "param_groups": [group]})
            return
        mine = {k: st.shard_of([state[i][k] for i in range(len(masters))], st.master.dtype)
                for k in MOMENTS}
        self._optimizers[stage].load_state_dict(
            {"state": {0: {"step": state[0]["step"], **mine}}, "param_groups": [group]})


def _grad_shard(p: torch.Tensor) -> torch.Tensor:
    """This process's part of ``p``'s gradient in ``p``'s layout: a tensor-parallel sharded
    parameter's gradient can come back replicated (its slice is taken, no communication)."""
    g = p.grad
    if g is None:
        return torch.zeros_like(local_shard(p))
    if is_dtensor(g) and tuple(g.placements) != tuple(p.placements):  # type: ignore[attr-defined]
        g = g.redistribute(p.device_mesh, p.placements)  # type: ignore[attr-defined]
    return local_shard(g)


def join_shards(shards: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A stage's optimizer state in StageAdamW's form (``{"optimizer": state dict, "masters":
    [...]}``) from every shard's ``stage_state``, in shard order (``Topology.grad_index``)."""
    first, dp = shards[0], len(shards)
    numels, shapes = first["numels"], first["shapes"]
    keys = [k for k in ("master", *MOMENTS) if k in first]
    whole: dict[str, list[Any]] = {k: [None] * len(numels) for k in keys}
    offset = 0
    for indices in first["buckets"]:
        total = sum(numels[i] for i in indices)
        size = -(-total // dp)
        for key in keys:
            flat = torch.cat([s[key][offset:offset + size] for s in shards])[:total]
            for i, part in zip(indices, flat.split([numels[i] for i in indices])):
                whole[key][i] = part.reshape(shapes[i]).clone()
        offset += size
    state: dict[int, dict[str, Any]] = {}
    if "exp_avg" in whole:
        state = {i: {"step": first["step"].clone(), **{k: whole[k][i] for k in MOMENTS}}
                 for i in range(len(numels))}
    group = {**first["param_group"], "params": list(range(len(numels)))}
    return {"optimizer": {"state": state, "param_groups": [group]}, "masters": whole["master"]}


def tied_ids(stages: Mapping[int, nn.Module], tied: TiedSpec | None = None) -> set[int]:
    """ids of every parameter of a tie (``tied`` and the modules' ``tied_parameters``) here."""
    specs = [tied or {}, *(getattr(m, "tied_parameters", {}) for m in stages.values())]
    named = [s for spec in specs for where in spec.values() for s in where]
    ids: set[int] = set()
    for where in merge_ties(specs, max([*stages, *named], default=0) + 1).values():
        for s, name in where.items():
            if s in stages:
                ids.add(id(dict(stages[s].named_parameters(remove_duplicate=False))[name]))
    return ids
