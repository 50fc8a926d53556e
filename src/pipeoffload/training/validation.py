"""Held-out validation in `pipeoffload train`: the loss on the data's held-out split
(``--eval-fraction``), forward only (``Pipeline.evaluate``), with dropout off."""

from __future__ import annotations

import math
from collections.abc import Mapping

from torch import nn

from pipeoffload.parallel.topology import Topology
from pipeoffload.runtime.pipeline import Pipeline
from pipeoffload.training.data import TextDataset
from pipeoffload.training.gather import gather_floats


def held_out_loss(pipe: Pipeline, stages: Mapping[int, nn.Module], dataset: TextDataset,
                  max_batches: int) -> float:
    """This replica's mean loss over the first ``max_batches`` held-out batches (each the
    mean over its microbatches, as a step's); nan on processes without the last stage. Every
    process of the pipeline calls it together; the model, its gradients and the data position
    are left as they were."""
    modes = {s: m.training for s, m in stages.items()}
    for module in stages.values():
        module.eval()
    losses: list[float] = []
    try:
        for _, (inputs, target) in zip(range(max_batches), dataset.eval_batches()):
            loss = pipe.evaluate(inputs, target=target)
            losses.append(math.nan if loss is None else float(loss.item()))
    finally:
        for s, module in stages.items():
            module.train(modes[s])
    return math.fsum(losses) / len(losses) if losses else math.nan


def eval_steps(start: int, steps: int, every: int, available: bool) -> set[int]:
    """The steps (optimizer steps done) after which the held-out loss is measured: the start
    and every ``every``-th step with ``--eval-every``, and the last step, when there is
    held-out data."""
    if not available:
        return set()
    wanted = {steps}
    if every:
        wanted.add(start)
        wanted.update(range(every * (start // every + 1), steps, every))
    return wanted


def held_out(pipe: Pipeline, stages: Mapping[int, nn.Module], dataset: TextDataset,
             topology: Topology, max_batches: int, last_rank: int) -> float:
    """The held-out loss: held_out_loss's, from the last stage's process of each replica,
    averaged over the data-parallel replicas (the same value on every process)."""
    rows = gather_floats(topology, [held_out_loss(pipe, stages, dataset, max_batches)])
    if not topology.distributed:
        return rows[0][0]
    losses = [rows[topology.global_rank(last_rank, d)][0] for d in range(topology.dp)]
    return sum(losses) / len(losses)
