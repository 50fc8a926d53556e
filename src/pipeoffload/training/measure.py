"""What `pipeoffload train` measures across its processes: the loss and activation peaks of a
step, each stage's activation bytes, and the peaks of a step without offload."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from pipeoffload.core.actions import OFFLOAD_KINDS
from pipeoffload.runtime.config import RuntimeConfig
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.pipeline import Pipeline
from pipeoffload.training.data import TextDataset
from pipeoffload.training.launch import Topology
from pipeoffload.training.model import lm_loss


def gather_floats(topology: Topology, values: list[float]) -> list[list[float]]:
    """Every process's ``values`` (same length everywhere), by global rank."""
    if not topology.distributed:
        return [values]
    device = topology.device if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [t.tolist() for t in everyone]


def gather_step(topology: Topology, loss: torch.Tensor | None, meter: ActivationMeter,
                last_rank: int) -> tuple[float, list[int]]:
    """The step's loss (mean over replicas) and peak bytes per pipeline rank (replica 0)."""
    if not topology.distributed:
        assert loss is not None
        return loss.item(), [meter.peak_bytes(r) for r in range(topology.pp)]
    value = math.nan if loss is None else loss.item()
    rows = gather_floats(topology, [value, float(meter.peak_bytes(topology.pp_rank))])
    losses = [rows[topology.global_rank(last_rank, d)][0] for d in range(topology.dp)]
    return sum(losses) / len(losses), [int(rows[topology.global_rank(p, 0)][1])
                                       for p in range(topology.pp)]


def stage_sizes(topology: Topology, meter: ActivationMeter,
                num_stages: int) -> tuple[int, ...] | None:
    """Per-stage activation bytes of one microbatch measured on the last step, from every
    process; None if a stage's microbatches differed (the simulator takes one size)."""
    seen: dict[int, set[int]] = {}
    for (stage, _), nbytes in meter.scope_bytes.items():
        seen.setdefault(stage, set()).add(nbytes)
    # Per stage: its size, -1 if its microbatches differed, -2 if this process has none of it.
    local = [float(next(iter(seen[s])) if len(seen[s]) == 1 else -1) if s in seen else -2.0
             for s in range(num_stages)]
    sizes = []
    for values in zip(*gather_floats(topology, local)):
        measured = {int(v) for v in values if v != -2}
        sizes.append(measured.pop() if len(measured) == 1 else -1)
    return None if min(sizes) < 0 else tuple(sizes)


def measure_without_offload(pipe: Pipeline, stages: Mapping[int, nn.Module],
                            dataset: TextDataset, topology: Topology, runtime: RuntimeConfig,
                            last_rank: int) -> tuple[int, ...]:
    """Peak bytes per pipeline rank of one forward/backward of the next batch with the same
    schedule minus its transfers; gradients are dropped, the model and data position kept."""
    meter = ActivationMeter()
    bare = Pipeline(stages, pipe.schedule.without(*OFFLOAD_KINDS), lm_loss,
                    group=topology.pp_group, config=runtime, device=topology.device,
                    meter=meter, channel_groups=topology.channel_groups)
    inputs, target = dataset.batch_at(dataset.step)
    loss = bare.step(inputs, target=target)
    for module in stages.values():
        module.zero_grad(set_to_none=True)
    return tuple(gather_step(topology, loss, meter, last_rank)[1])
