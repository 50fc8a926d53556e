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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeoffload.errors import ConfigError
from pipeoffload.parallel.gradients import scale_gradients
from pipeoffload.parallel.optimizer import StageState
from pipeoffload.parallel.topology import Topology
from pipeoffload.runtime.shards import local_shard

#: Why a checkpoint of sharded stages is refused (the trainer checks for it before it starts).
NO_CHECKPOINT = ("--zero 3 does not write checkpoints yet: its stage files would hold each "
                 "replica's parameter shards, which the checkpoint format does not name; use "
                 "--zero 1 to checkpoint")


def shard_stages(stages: Mapping[int, nn.Module], topology: Topology) -> dict[int, nn.Module]:
    """Each stage module wrapped in place with FSDP2's ``fully_shard`` over ``topology``'s
    data-parallel group, kept whole from its first forward of a step to its last backward
    (``reshard_after_forward=False``; the Pipeline reshards it)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    device = topology.device or torch.device("cpu")
    mesh = DeviceMesh.from_group(topology.dp_group, device.type, mesh_dim_names=("dp",))
    return {s: fully_shard(module, mesh=mesh, reshard_after_forward=False)  # type: ignore[misc]
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
        data-parallel group, then the pipeline) is at most ``max_norm``; returns it."""
        topology = self.topology
        grads = [p.grad for ps in self._params.values() for p in ps if p.grad is not None]
        total = torch.zeros((), dtype=torch.float64, device=topology.device)
        for g in grads:
            total += local_shard(g).double().pow(2).sum()
        dist.all_reduce(total, group=topology.dp_group)
        if topology.pp > 1:
            dist.all_reduce(total, group=topology.pp_group)
        norm = total.sqrt().item()
        scale_gradients(grads, norm, max_norm)
        return norm

    def set_lr(self, lr: float) -> None:
        for optimizer in self._optimizers.values():
            for group in optimizer.param_groups:
                group["lr"] = lr

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
        moments = sum(local_shard(v).numel() * v.element_size()
                      for o in self._optimizers.values() for state in o.state.values()
                      for k, v in state.items() if k in ("exp_avg", "exp_avg_sq"))
        return {"masters": masters, "moments": moments}

    def master_weights(self) -> Mapping[int, list[torch.Tensor]]:
        """Every parameter gathered whole (a collective over the data-parallel group)."""
        return {s: [p.full_tensor() for p in ps]  # type: ignore[attr-defined]  # DTensor
                for s, ps in self._params.items()}

    def stage_state(self, stage: int) -> StageState:
        raise ConfigError(NO_CHECKPOINT)

    def load_stage_state(self, stage: int, saved: Mapping[str, Any]) -> None:
        raise ConfigError(NO_CHECKPOINT)
