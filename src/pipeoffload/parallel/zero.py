"""ZeRO-1, Megatron's distributed optimizer: AdamW whose float32 master weights and moments are
sharded over the data-parallel replicas (``ZeroAdamW``, a parallel/optimizer.py
PipelineOptimizer).

Note: [zero-1 layout] Per stage, this process's trainable parameters (their local shards under
tensor parallelism, which are thus sharded again over dp) lie end to end, in
``module.parameters()`` order, in one flat vector of N elements, padded with zeros to a multiple
of dp (fewer than dp elements of padding per stage); replica d owns elements
[d * N_pad / dp, (d + 1) * N_pad / dp) and holds only those of the float32 masters, of the two
AdamW moments and of the averaged gradient. A step: the stage's gradients (float32, parallel/
precision.py Note: [mixed precision]) are reduce-scattered over the data-parallel group into
the local gradient shard and divided by dp (the sum of two values does not depend on the order,
so at dp = 2 this is bitwise the all-reduce of ``sync_gradients``); the global norm sums each
element's square once (tie copies and replicated tensor-parallel parameters as
``clip_gradients`` counts them); AdamW updates the local shard (elementwise, as it updates
each parameter whole); the updated shards, cast to the parameters' dtype, are all-gathered
into the parameters before the next forward. Checkpoints keep each replica's shard in its own
file (parallel/checkpoint.py Note: [sharded optimizer checkpoint]).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeoffload.parallel.gradients import scale_gradients, tie_copies
from pipeoffload.parallel.optimizer import StageState
from pipeoffload.parallel.precision import accumulate_in_float32
from pipeoffload.parallel.topology import Topology
from pipeoffload.runtime.shards import ShardLayout, is_dtensor, local_shard

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter of a stage lies in its flat vector, and replica ``index``'s span of
    it (Note: [zero-1 layout])."""

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


class _Stage:
    """One stage's share: its trainable parameters, layout, float32 master shard (whose
    ``.grad`` is the averaged gradient shard) and the shard's elements the global norm counts,
    by kind: summed over the tensor-parallel group (``sharded``) or once (``whole``)."""

    def __init__(self, module: nn.Module, topology: Topology, copies: set[int]) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in self.params) else (
            torch.float32)  # float32 masters, but an fp64 run stays fp64
        self.layout = FlatLayout(tuple(local_shard(p).numel() for p in self.params),
                                 topology.dp if topology.distributed else 1,
                                 topology.dp_index if topology.distributed else 0, dtype)
        self.master = self.layout.mine(self.layout.flatten(self.params)).requires_grad_()
        self.sharded = torch.zeros(self.layout.shard_numel, dtype=torch.bool)
        self.whole = torch.zeros(self.layout.shard_numel, dtype=torch.bool)
        lo, hi = self.layout.start, self.layout.start + self.layout.shard_numel
        for p, (begin, end) in zip(self.params, self.layout.spans()):
            if id(p) in copies or end <= lo or begin >= hi:
                continue
            tp_sharded = is_dtensor(p) and any(
                pl.is_shard() for pl in p.placements)  # type: ignore[attr-defined]  # a DTensor
            mask = self.sharded if tp_sharded else self.whole
            mask[max(begin, lo) - lo:min(end, hi) - lo] = True


class ZeroAdamW:
    """AdamW per stage over float32 master weights sharded over the data-parallel replicas
    (Note: [zero-1 layout]); a PipelineOptimizer. ``topology`` None or without torch.distributed:
    one replica (dp = 1), the whole state here."""

    sharded = True

    def __init__(self, stages: Mapping[int, nn.Module], topology: Topology | None, *, lr: float,
                 betas: tuple[float, float], weight_decay: float) -> None:
        self.topology = topology if topology is not None else Topology(pp=1, dp=1)
        params: list[torch.Tensor] = [p for m in stages.values() for p in m.parameters()
                                      if p.requires_grad]
        if any(p.dtype == torch.bfloat16 for p in params):
            accumulate_in_float32(params)
        copies = tie_copies(stages)
        self._stages = {s: _Stage(m, self.topology, copies) for s, m in sorted(stages.items())}
        self._optimizers = {s: torch.optim.AdamW([st.master], lr=lr, betas=betas,
                                                 weight_decay=weight_decay)
                            for s, st in self._stages.items()}

    @property
    def _dp(self) -> int:
        return self.topology.dp if self.topology.distributed else 1

    @property
    def params(self) -> Mapping[int, list[torch.Tensor]]:
        """Per stage, the one tensor it updates: the local master shard."""
        return {s: [st.master] for s, st in self._stages.items()}

    def take_grads(self) -> None:
        """Reduce-scatter each stage's gradients into its master shard's ``.grad`` (the
        average over replicas) and free the parameters' gradients."""
        for st in self._stages.values():
            flat = st.layout.flatten([_grad_shard(p) for p in st.params])
            if self._dp > 1:
                shard = torch.empty_like(st.master)
                dist.reduce_scatter_single(shard, flat, group=self.topology.dp_group)
                shard /= self._dp
            else:
                shard = flat
            st.master.grad = shard
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
                dist.all_reduce(parts, group=topology.dp_group)
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
        for optimizer in self._optimizers.values():
            for group in optimizer.param_groups:
                group["lr"] = lr

    @torch.no_grad()
    def step(self) -> None:
        """Update the local shards, then all-gather them into the parameters (in their dtype)."""
        for s, st in self._stages.items():
            self._optimizers[s].step()
            flat = self._gather(st, st.params[0].dtype if st.params else torch.float32)
            for p, (begin, end) in zip(st.params, st.layout.spans()):
                local = local_shard(p)
                local.copy_(flat[begin:end].view_as(local))

    def _gather(self, st: _Stage, dtype: torch.dtype) -> torch.Tensor:
        """The stage's whole flat vector of master weights, cast to ``dtype`` first."""
        shard = st.master.detach().to(dtype)
        if self._dp == 1:
            return shard
        flat = torch.empty(st.layout.shard_numel * self._dp, dtype=dtype, device=shard.device)
        dist.all_gather_single(flat, shard, group=self.topology.dp_group)
        return flat

    @torch.no_grad()
    def master_weights(self) -> Mapping[int, list[torch.Tensor]]:
        """Per stage, every trainable parameter's float32 master, gathered whole over the
        data-parallel group (a collective) and in the parameter's tensor-parallel layout."""
        weights: dict[int, list[torch.Tensor]] = {}
        for s, st in self._stages.items():
            flat = self._gather(st, st.master.dtype)
            weights[s] = [
                ShardLayout.of(p).rebuild(flat[b:e].view_as(local_shard(p)).clone())
                if is_dtensor(p) else flat[b:e].view_as(p).clone()
                for p, (b, e) in zip(st.params, st.layout.spans())]
        return weights

    def zero_grad(self) -> None:
        for st in self._stages.values():
            st.master.grad = None

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
        """This replica's shard of the stage (Note: [sharded optimizer checkpoint])."""
        st = self._stages[stage]
        saved = self._optimizers[stage].state_dict()
        state = saved["state"].get(0, {})
        group = {k: v for k, v in saved["param_groups"][0].items() if k != "params"}
        shard: dict[str, Any] = {
            "numels": list(st.layout.numels), "shapes": [list(local_shard(p).shape)
                                                         for p in st.params],
            "start": st.layout.start, "master": st.master.detach(), "param_group": group,
            "step": state.get("step"), **{k: state[k] for k in MOMENTS if k in state}}
        return StageState({"shard": shard}, None)

    def load_stage_state(self, stage: int, saved: Mapping[str, Any]) -> None:
        """Restore from a stage's whole state as StageAdamW saves it (checkpoint.py joins the
        replicas' shards into that form, whatever dp and zero level wrote them)."""
        st = self._stages[stage]
        masters, optimizer = saved["masters"], saved["optimizer"]
        if len(masters) != len(st.params):
            raise ValueError(f"{len(masters)} master tensors saved, {len(st.params)} here")
        with torch.no_grad():
            st.master.copy_(st.layout.mine(st.layout.flatten(masters)))
        state = optimizer["state"]
        group = {**optimizer["param_groups"][0], "params": [0]}
        if not state:
            self._optimizers[stage].load_state_dict({"state": {}, "param_groups": [group]})
            return
        mine = {k: st.layout.mine(st.layout.flatten([state[i][k] for i in range(len(masters))]))
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
    [...]}``) from every replica's ``stage_state`` shard, in replica order."""
    first = shards[0]
    numels, shapes = first["numels"], first["shapes"]
    total = sum(numels)
    flats = {k: torch.cat([s[k] for s in shards])[:total]
             for k in ("master", *MOMENTS) if k in first}

    def split(flat: torch.Tensor) -> list[torch.Tensor]:
        return [part.reshape(shape).clone()
                for part, shape in zip(flat.split(numels), shapes)]

    masters = split(flats["master"])
    state: dict[int, dict[str, Any]] = {}
    if "exp_avg" in flats:
        moments = {k: split(flats[k]) for k in MOMENTS}
        state = {i: {"step": first["step"].clone(), **{k: moments[k][i] for k in MOMENTS}}
                 for i in range(len(numels))}
    group = {**first["param_group"], "params": list(range(len(numels)))}
    return {"optimizer": {"state": state, "param_groups": [group]}, "masters": masters}
