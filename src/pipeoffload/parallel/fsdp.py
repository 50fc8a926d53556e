"""ZeRO-3 through torch's FSDP2: each stage module sharded over the data-parallel group with
``fully_shard`` (``shard_stages``), and AdamW over the shards (``ShardedAdamW``, a
parallel/optimizer.py PipelineOptimizer).

A sharded stage holds 1/dp of every parameter (dim 0, as DTensors over a mesh of the
data-parallel group), of its gradient after the step's backward and of the AdamW moments; the
Pipeline gathers it before its first forward of a step and frees it after its last backward,
where FSDP reduce-scatters the step's summed gradient once, averaged over the replicas
(runtime/sharding.py Note: [sharded stages]). The optimizer then updates the local shards
elementwise, as AdamW updates whole parameters, so in fp32 a step is the replicated optimizer's
up to the order of the reduction's sums (two values at dp = 2: bitwise).

Checkpoints: every replica writes its stage file in ZeRO-1's shard form (parallel/zero.py
Note: [zero-1 layout], one bucket per stage), made from the parameters and moments gathered
whole, and replica 0 the stage's model state gathered whole (``whole_state``); loading joins
them into the whole state (parallel/checkpoint.py Note: [sharded optimizer checkpoint]), of
which each process takes its FSDP shards (``load_whole``), so a checkpoint moves between
``--zero`` 0, 1 and 3 and another dp.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeoffload.parallel.gradients import scale_gradients, tie_copies
from pipeoffload.parallel.optimizer import MOMENTS, StageState, moment_bytes, set_learning_rate
from pipeoffload.parallel.topology import Topology
from pipeoffload.parallel.zero import FlatLayout, bucket_indices
from pipeoffload.runtime.shards import is_dtensor, local_shard


def is_sharded_stage(module: nn.Module) -> bool:
    """Whether ``module`` is wrapped with FSDP2's ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def whole_state(module: nn.Module) -> dict[str, Any]:
    """``module``'s state dict with every DTensor gathered whole (a collective over the
    data-parallel group for an FSDP2 stage; call it on every replica)."""
    return {k: v.full_tensor() if is_dtensor(v) else v
            for k, v in module.state_dict().items()}


@torch.no_grad()
def load_whole(targets: Mapping[Any, torch.Tensor], saved: Mapping[Any, torch.Tensor]) -> None:
    """Copy whole tensors ``saved`` into ``targets``: a DTensor takes its own shard of it (no
    communication), a plain tensor all of it; names and whole shapes must match."""
    from torch.distributed.tensor import distribute_tensor

    if set(targets) != set(saved):
        raise KeyError(f"names differ: {sorted(map(str, set(targets) ^ set(saved)))[:3]}")
    for key, target in targets.items():
        value = saved[key]
        if tuple(target.shape) != tuple(value.shape):
            raise ValueError(f"{key}: shape {list(value.shape)} saved, {list(target.shape)} here")
        if is_dtensor(target):
            mesh, placements = target.device_mesh, target.placements  # type: ignore[attr-defined]
            value = distribute_tensor(value.to(target.device), mesh, placements,
                                      src_data_rank=None).to_local()
        local_shard(target).copy_(value)


def shard_stages(stages: Mapping[int, nn.Module], topology: Topology, *,
                 mixed: bool = False) -> dict[int, nn.Module]:
    """Each stage module wrapped in place with FSDP2's ``fully_shard`` over ``topology``'s
    data-parallel group, kept whole from its first forward of a step to its last backward
    (``reshard_after_forward=False``; the Pipeline reshards it).

    ``mixed`` (``--dtype bf16``, stages built in bfloat16): the shards become the float32
    master weights (the bfloat16 values, exactly, as ``MasterWeights`` copies them) and FSDP's
    mixed-precision policy gathers them as bfloat16 for compute and reduce-scatters the
    gradients in float32 (parallel/precision.py Note: [mixed precision])."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = topology.device or torch.device("cpu")
    mesh = DeviceMesh.from_group(topology.dp_group, device.type, mesh_dim_names=("dp",))
    policy = MixedPrecisionPolicy()
    if mixed:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for module in stages.values():
            module.float()
    return {s: fully_shard(module, mesh=mesh, reshard_after_forward=False,  # type: ignore[misc]
                           mp_policy=policy)
            for s, module in stages.items()}


class ShardedAdamW:
    """AdamW per stage over FSDP2-sharded stages (``shard_stages``): the parameters are the
    local shards' DTensors, their gradients already averaged over the replicas by FSDP."""

    sharded = True

    def __init__(self, stages: Mapping[int, nn.Module], topology: Topology, *, lr: float,
                 betas: tuple[float, float], weight_decay: float) -> None:
        self.topology = topology
        self._params: dict[int, list[torch.Tensor]] = {
            s: [p for p in m.parameters() if p.requires_grad] for s, m in sorted(stages.items())}
        self._copies = tie_copies(stages)  # counted once in the norm, at the tie's lowest stage
        self._optimizers = {s: torch.optim.AdamW(ps, lr=lr, betas=betas,
                                                 weight_decay=weight_decay)
                            for s, ps in self._params.items()}

    @property
    def params(self) -> Mapping[int, list[torch.Tensor]]:
        return self._params

    def take_grads(self) -> None:
        """Nothing: FSDP reduce-scattered the step's gradients after each stage's last B."""

    def reduce_grads(self) -> None:
        """Nothing: they are averaged over the replicas already."""

    def clip_grads(self, max_norm: float | None) -> float:
        """Scale the gradient shards so the global norm (every shard once: summed over the
        data-parallel group, then the pipeline; a tie's copies on higher stages not at all) is at
        most ``max_norm``; returns it."""
        topology = self.topology
        held = [p for ps in self._params.values() for p in ps if p.grad is not None]
        grads = [p.grad for p in held if p.grad is not None]
        total = torch.zeros((), dtype=torch.float64, device=topology.device)
        for p in held:
            if id(p) not in self._copies and p.grad is not None:
                total += local_shard(p.grad).double().pow(2).sum()
        dist.all_reduce(total, group=topology.dp_group)
        if topology.pp > 1:
            dist.all_reduce(total, group=topology.pp_group)
        norm = total.sqrt().item()
        scale_gradients(grads, norm, max_norm)
        return norm

    def set_lr(self, lr: float) -> None:
        set_learning_rate(self._optimizers.values(), lr)

    def step(self) -> None:
        for optimizer in self._optimizers.values():
            optimizer.step()

    def zero_grad(self) -> None:
        for optimizer in self._optimizers.values():
            optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> dict[str, int]:
        """This process's shards of the parameters (the fp32 masters) and moments."""
        masters = sum(local_shard(p).numel() * p.element_size()
                      for ps in self._params.values() for p in ps)
        moments = moment_bytes(self._optimizers.values())
        return {"masters": masters, "moments": moments}

    def master_weights(self) -> Mapping[int, list[torch.Tensor]]:
        """Every parameter gathered whole (a collective over the data-parallel group)."""
        return {s: [p.full_tensor() for p in ps]  # type: ignore[attr-defined]  # DTensor
                for s, ps in self._params.items()}

    def stage_state(self, stage: int) -> StageState:
        """This replica's part of the stage in ZeRO-1's shard form (one bucket), cut from the
        parameters and moments gathered whole: a collective over the data-parallel group."""
        params = self._params[stage]
        saved = self._optimizers[stage].state_dict()
        state = saved["state"]
        whole = {"master": [p.full_tensor() for p in params]}  # type: ignore[attr-defined]
        if state:
            for key in MOMENTS:
                whole[key] = [state[i][key].full_tensor() for i in range(len(params))]
        numels = [p.numel() for p in params]
        indices = bucket_indices(numels, max(sum(numels), 1))[0] if params else []
        layout = FlatLayout(tuple(numels[i] for i in indices), self.topology.dp,
                            self.topology.dp_index, params[0].dtype if params else torch.float32)
        shard: dict[str, Any] = {
            "numels": numels, "shapes": [list(p.shape) for p in params], "buckets": [indices],
            "param_group": {k: v for k, v in saved["param_groups"][0].items() if k != "params"},
            "step": state[0]["step"] if state else None,
            **{k: layout.mine(layout.flatten([v[i] for i in indices]))
               for k, v in whole.items()}}
        return StageState({"shard": shard}, None)

    def load_stage_state(self, stage: int, saved: Mapping[str, Any]) -> None:
        """Restore from a stage's whole state (StageAdamW's form, as checkpoint.py joins it):
        each parameter and moment takes this replica's shard."""
        params, optimizer = self._params[stage], saved["optimizer"]
        masters = saved["masters"]
        if len(masters) != len(params):
            raise ValueError(f"{len(masters)} master tensors saved, {len(params)} here")
        load_whole(dict(enumerate(params)), dict(enumerate(masters)))
        group = {**optimizer["param_groups"][0], "params": list(range(len(params)))}
        state = {}
        for i, values in optimizer["state"].items():
            moments = {k: torch.zeros_like(params[int(i)]) for k in MOMENTS}
            load_whole(moments, {k: values[k] for k in MOMENTS})
            state[int(i)] = {"step": values["step"], **moments}
        self._optimizers[stage].load_state_dict({"state": state, "param_groups": [group]})
