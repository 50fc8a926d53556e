"""What a training loop of your own needs around ``Pipeline``, the pieces `pipeoffload train`
uses itself: joining a torchrun job, gradient averaging and clipping across stages and ranks,
and per-stage checkpoints.

    topo = pipeoffload.init_distributed(pp=2, tp=1, dp=1)        # under torchrun
    mine = topo.stages_of(schedule)                              # this process's stages
    stages = split_causal_lm(model, schedule, rank=topo.pp_rank) # or split_blocks(...)
    pipe = Pipeline(stages, schedule, loss_fn, **topo.pipeline_options())
    loss = pipe.step(x, target=y)
    pipeoffload.average_gradients(stages, topo)                  # over data-parallel replicas
    pipeoffload.clip_grad_norm_(stages, 1.0, topo)               # ties counted once
    optimizer.step()
    pipeoffload.save_checkpoint("ckpt", step, stages, {s: opt for s in stages}, topo)

With data (or context) parallelism, ``zero_optimizer`` shards AdamW's float32 master weights
and moments over the replicas times the context-parallel ranks (ZeRO-1) in place of the
per-stage optimizers, average_gradients and clip_grad_norm_ above:

    optimizer = pipeoffload.zero_optimizer(stages, topo, lr=3e-4)
    loss = pipe.step(x, target=y)
    optimizer.take_grads()                                       # reduce-scatter, dp x cp
    optimizer.clip_grads(1.0)                                    # each shard counted once
    optimizer.step()                                             # update, all-gather
    optimizer.zero_grad()
    pipeoffload.save_checkpoint("ckpt", step, stages, optimizer, topo)  # a file per shard

Without torch.distributed (one process runs every stage) pass ``topology=None``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeoffload.parallel import arguments
from pipeoffload.parallel import checkpoint as ckpt
from pipeoffload.parallel.context import apply_context_parallel
from pipeoffload.parallel.gradients import (
    clip_gradients,
    sync_gradients,
    tie_copies,
    unique_params,
)
from pipeoffload.parallel.optimizer import CheckpointedOptimizer, StageOptimizers
from pipeoffload.parallel.rank_order import parse_order
from pipeoffload.parallel.topology import Topology, connect
from pipeoffload.parallel.zero import BUCKET_NUMEL, ZeroAdamW
from pipeoffload.runtime.tied import TiedSpec

__all__ = ["Topology", "apply_context_parallel", "average_gradients", "clip_grad_norm_",
           "clip_gradients", "init_distributed", "load_checkpoint", "save_checkpoint",
           "tie_copies", "zero_optimizer"]


def init_distributed(pp: int, tp: int = 1, dp: int = 1, *, device: str = "auto",
                     timeout_s: float = 300.0, cp: int = 1,
                     rank_order: str | tuple[str, ...] | None = None) -> Topology:
    """Join the job torchrun started (env:// variables RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT; WORLD_SIZE must be pp * dp * tp * cp): the default process group (NCCL on
    CUDA, bound to this process's GPU; gloo on CPU; ``timeout_s`` for every collective), the
    (pp, dp, cp, tp) device mesh in ``rank_order`` (outermost first, e.g. "pp,dp,cp,tp", the
    default; parallel/rank_order.py) and its groups (docs/training.md, rank layout), and one process
    group per P2P channel of this process's pipeline, which NCCL needs for V-shaped and
    interleaved schedules (docs/runtime.md). ``Pipeline(..., **topology.pipeline_options())``
    takes them; ``topology.tp_mesh`` is the mesh to shard a stage over with torch DTensor;
    with ``cp`` > 1 ``pipeline_options()`` carries the context split, and
    ``apply_context_parallel(stages, topology.sequence_split())`` makes the stages attend over
    ``topology.cp_group`` (parallel/context.py)."""
    for name, value in (("pp", pp), ("tp", tp), ("dp", dp), ("cp", cp)):
        if arguments.step_number(name, value) < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return connect(pp, dp, device, arguments.positive_number("timeout_s", timeout_s), tp=tp,
                   cp=cp, order=parse_order(rank_order))


def _placement(topology: Topology | None, stages: Mapping[int, nn.Module]) -> Topology:
    if topology is not None:
        return topology
    device = next((p.device for m in stages.values() for p in m.parameters()),
                  torch.device("cpu"))
    return Topology.local(1, device)


def clip_grad_norm_(stages: Mapping[int, nn.Module], max_norm: float,
                    topology: Topology | None = None, *, tied: TiedSpec | None = None) -> float:
    """``torch.nn.utils.clip_grad_norm_`` for a pipeline: the norm over every stage on every
    rank (a collective: all ranks call it), tied parameters counted once (on their lowest
    stage), DTensor shards summed over their tensor-parallel group. Returns the norm before
    clipping."""
    arguments.stage_modules("stages", stages)
    max_norm = arguments.positive_number("max_norm", max_norm, infinite=True)
    return clip_gradients(unique_params(stages), max_norm, topology, tie_copies(stages, tied))


def average_gradients(stages: Mapping[int, nn.Module], topology: Topology | None) -> None:
    """Average the stages' gradients over the data-parallel replicas (one all-reduce per
    stage; nothing without data parallelism)."""
    if topology is None or topology.dp == 1:
        return
    sync_gradients({s: [p for p in m.parameters() if p.grad is not None]
                    for s, m in stages.items()}, topology)


def zero_optimizer(stages: Mapping[int, nn.Module], topology: Topology | None, *,
                   lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                   weight_decay: float = 0.01, microbatches: int | None = None,
                   bucket_numel: int = BUCKET_NUMEL, tied: TiedSpec | None = None) -> ZeroAdamW:
    """AdamW over the stages' trainable parameters with its float32 master weights and moments
    sharded over ``topology``'s data-parallel replicas times its context-parallel ranks
    (ZeRO-1, parallel/zero.py; bf16 parameters accumulate gradients in float32). Each step
    after ``pipe.step``: ``take_grads`` (reduce-scatter: the average over replicas and
    context-parallel ranks), ``clip_grads(max_norm)`` (optional; the norm
    over every stage and rank, each shard and tie once), ``set_lr`` (optional), ``step``
    (update the shard, all-gather the parameters), ``zero_grad``. ``topology`` None: one
    process, nothing sharded. ``microbatches`` (the Pipeline's): each bucket of about
    ``bucket_numel`` gradient elements starts its reduce-scatter during the backward, once its
    last microbatch is in (None: all in take_grads); ``tied``: the ties given to Pipeline
    (their buckets wait for its tie sum). save_checkpoint / load_checkpoint take it as
    ``optimizers``."""
    return ZeroAdamW(stages, topology, lr=lr, betas=betas, weight_decay=weight_decay,
                     microbatches=microbatches, bucket_numel=bucket_numel, tied=tied)


def _check_optimizers(optimizers: Any, stages: Any) -> None:
    """A ZeroAdamW (zero_optimizer) covers its stages itself; anything else must map every
    stage to a torch optimizer (parallel/arguments.py)."""
    stages = arguments.stage_modules("stages", stages)
    if not isinstance(optimizers, ZeroAdamW):
        arguments.stage_optimizers("optimizers", optimizers, stages)


def _checkpointed(optimizers: Mapping[int, torch.optim.Optimizer] | ZeroAdamW,
                  masters: Mapping[int, list[torch.Tensor]] | None) -> CheckpointedOptimizer:
    if isinstance(optimizers, ZeroAdamW):
        return optimizers
    return StageOptimizers(optimizers, masters)


class _StepPosition:
    """The data position a checkpoint records: the step (checkpoint.DataPosition)."""

    def __init__(self, step: int = 0) -> None:
        self.step = step

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def save_checkpoint(root: str | Path, step: int, stages: Mapping[int, nn.Module],
                    optimizers: Mapping[int, torch.optim.Optimizer] | ZeroAdamW,
                    topology: Topology | None = None, *, info: dict[str, Any] | None = None,
                    masters: Mapping[int, list[torch.Tensor]] | None = None) -> Path:
    """Write ``root/step_<N>/`` as `pipeoffload train` does (docs/training.md, checkpoints):
    one file per stage (and tensor-parallel rank) with its modules' and optimizer's state,
    written by data-parallel replica 0 (a zero_optimizer: its shard by every replica), one per
    process with its RNG states, then a manifest
    with every file's SHA-256 and ``info`` (JSON), which load_checkpoint requires to match
    (``info["run"]``, if given, is the run id every file records). A
    collective: every process calls it. Returns the folder."""
    arguments.step_number("step", step)
    _check_optimizers(optimizers, stages)
    identity = dict(info or {})
    # Every file records a run id (checkpoint_files.FileIdentity); without one in ``info`` it is
    # a digest of ``info``, the same on every process and every save of the run.
    identity.setdefault("run", hashlib.sha256(
        json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:12])
    state = ckpt.TrainingState(stages, _checkpointed(optimizers, masters), _StepPosition(step))
    return ckpt.save(state, root, step, identity, _placement(topology, stages))


def load_checkpoint(path: str | Path, stages: Mapping[int, nn.Module],
                    optimizers: Mapping[int, torch.optim.Optimizer] | ZeroAdamW,
                    topology: Topology | None = None, *, info: dict[str, Any] | None = None,
                    masters: Mapping[int, list[torch.Tensor]] | None = None) -> int:
    """Load this process's part of the checkpoint ``path`` (a step folder, or a root whose
    newest complete checkpoint is taken) into the stages and optimizers; returns its step.
    Raises CheckpointError when it is missing, corrupt, or saved with another ``info`` or
    number of processes."""
    _check_optimizers(optimizers, stages)
    position = _StepPosition()
    state = ckpt.TrainingState(stages, _checkpointed(optimizers, masters), position)
    return ckpt.restore(state, path, None, dict(info or {}), _placement(topology, stages))
