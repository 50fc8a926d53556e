"""What `pipeoffload train` measures after training: the peaks of a step without offload."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from pipeoffload.core.actions import OFFLOAD_KINDS
from pipeoffload.parallel.topology import Topology
from pipeoffload.runtime.config import RuntimeConfig
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.pipeline import Pipeline
from pipeoffload.training.data import TextDataset
from pipeoffload.training.gather import gather_step
from pipeoffload.training.model import lm_loss


def measure_without_offload(pipe: Pipeline, stages: Mapping[int, nn.Module],
                            dataset: TextDataset, topology: Topology, runtime: RuntimeConfig,
                            last_rank: int) -> tuple[int, ...]:
    """Peak bytes per pipeline rank of one forward/backward of the next batch with the same
    schedule minus its transfers; gradients are dropped, the model and data position kept."""
    meter = ActivationMeter()
    bare = Pipeline(stages, pipe.schedule.without(*OFFLOAD_KINDS), lm_loss,
                    group=topology.pp_group, config=runtime, device=topology.device,
                    meter=meter, channel_groups=topology.channel_groups, context=pipe.context)
    inputs, target = dataset.batch_at(dataset.step)
    loss = bare.step(inputs, target=target)
    for module in stages.values():
        module.zero_grad(set_to_none=True)
    return tuple(gather_step(topology, loss, meter, last_rank).peak_bytes)
