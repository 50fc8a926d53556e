"""The optimizer of one process's pipeline stages as one component.

A training step drives it through ``PipelineOptimizer`` only: take the step's gradients onto
what it updates (``params``), average them over data-parallel replicas, clip them, set the
learning rate, step, zero the gradients; a checkpoint keeps and restores its state per stage
(``stage_state`` / ``load_stage_state``). ``StageAdamW`` is AdamW per stage over master
weights (parallel/precision.py Note: [mixed precision]); parallel/zero.py ``ZeroAdamW``, which
shards its state over data-parallel replicas (``sharded``), implements the same protocol and
replaces it without a change to the loop. ``StageOptimizers`` is the checkpoint side alone,
over torch optimizers a loop of your own made (pipeoffload.distributed's save_checkpoint /
load_checkpoint).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from pipeoffload.parallel.gradients import clip_gradients, sync_gradients, uncounted_masters
from pipeoffload.parallel.precision import MasterWeights
from pipeoffload.parallel.sharded_state import load_tensors, shard_optimizer_state
from pipeoffload.parallel.topology import Topology
from pipeoffload.runtime.shards import local_shard


class StageState(NamedTuple):
    """What a stage's checkpoint file keeps of the optimizer: its state dict, and the tensors
    it updates when they are not the stage's own parameters (None: they are)."""

    optimizer: dict[str, Any]
    masters: list[torch.Tensor] | None


class CheckpointedOptimizer(Protocol):
    """What parallel/checkpoint.py saves and restores of an optimizer, stage by stage:
    ``sharded`` ones a shard per data-parallel replica, the others once per stage."""

    @property
    def sharded(self) -> bool: ...

    def stage_state(self, stage: int) -> StageState: ...

    def load_stage_state(self, stage: int, saved: Mapping[str, Any]) -> None:
        """Restore from ``saved`` (the stage file's ``optimizer`` and ``masters`` entries);
        KeyError, RuntimeError or ValueError when it does not fit."""


class PipelineOptimizer(CheckpointedOptimizer, Protocol):
    """The optimizer a training loop drives each step, in this order: ``take_grads``,
    ``reduce_grads``, ``clip_grads`` (or not), ``set_lr``, ``step``, ``zero_grad``."""

    @property
    def params(self) -> Mapping[int, list[torch.Tensor]]:
        """Per stage, the tensors it updates."""

    def take_grads(self) -> None:
        """Move the step's gradients from the stages' parameters onto ``params``."""

    def reduce_grads(self) -> None:
        """Average the gradients over data-parallel replicas."""

    def clip_grads(self, max_norm: float | None) -> float:
        """Scale the gradients so the global norm (every stage and rank, ties once) is at most
        ``max_norm`` (None: only measure); returns the norm before clipping."""

    def state_bytes(self) -> dict[str, int]:
        """This process's bytes of ``masters`` (what it updates) and ``moments``, measured."""

    def master_weights(self) -> Mapping[int, list[torch.Tensor]]:
        """Per stage, one master weight per trainable parameter, whole (in the parameter's
        tensor-parallel layout); a collective over the data-parallel group when sharded."""

    def set_lr(self, lr: float) -> None: ...

    def step(self) -> None:
        """Update ``params`` and write them into the stages' parameters."""

    def zero_grad(self) -> None: ...


#: The AdamW state that is per element, as its state dict names it.
MOMENTS = ("exp_avg", "exp_avg_sq")


def moment_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes of this process's AdamW moments in ``optimizers`` (local shards of DTensors)."""
    return sum(local_shard(v).numel() * v.element_size()
               for o in optimizers for state in o.state.values()
               for k, v in state.items() if k in MOMENTS)


def set_learning_rate(optimizers: Iterable[torch.optim.Optimizer], lr: float) -> None:
    """Every parameter group of ``optimizers`` at learning rate ``lr`` (the step's schedule)."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr


class StageOptimizers:
    """One torch optimizer per stage, as a checkpoint keeps them: each one's state dict and,
    with ``masters`` (per stage, the tensors it updates when they are not the modules'
    parameters), those tensors."""

    sharded = False

    def __init__(self, optimizers: Mapping[int, torch.optim.Optimizer],
                 masters: Mapping[int, list[torch.Tensor]] | None = None) -> None:
        self.optimizers = optimizers
        self.masters = masters

    def stage_state(self, stage: int) -> StageState:
        masters = None if self.masters is None else list(self.masters[stage])
        return StageState(self.optimizers[stage].state_dict(), masters)

    def load_stage_state(self, stage: int, saved: Mapping[str, Any]) -> None:
        optimizer = self.optimizers[stage]
        optimizer.load_state_dict(saved["optimizer"])
        shard_optimizer_state(optimizer)
        if self.masters is not None:
            load_tensors(dict(enumerate(self.masters[stage])), dict(enumerate(saved["masters"])))


class StageAdamW:
    """AdamW per stage on the stages' master weights: the parameters themselves, or with
    ``mixed`` (bf16 stages) float32 copies written back after each step. Checkpoints keep the
    masters beside each AdamW state in either case. Gradients are averaged over ``topology``'s
    data-parallel replicas (None: one process)."""

    sharded = False

    def __init__(self, stages: Mapping[int, nn.Module], *, mixed: bool, lr: float,
                 betas: tuple[float, float], weight_decay: float,
                 topology: Topology | None = None) -> None:
        self.topology = topology
        self.masters = MasterWeights(stages, mixed=mixed)
        self._ties = uncounted_masters(stages, self.masters.params)
        self._optimizers = {s: torch.optim.AdamW(self.masters.params[s], lr=lr, betas=betas,
                                                 weight_decay=weight_decay)
                            for s in stages}
        self._saved = StageOptimizers(self._optimizers, self.masters.params)

    @property
    def params(self) -> Mapping[int, list[torch.Tensor]]:
        return self.masters.params

    def take_grads(self) -> None:
        self.masters.take_grads()

    def reduce_grads(self) -> None:
        sync_gradients(self.masters.params, self.topology)

    def clip_grads(self, max_norm: float | None) -> float:
        return clip_gradients([m for s in sorted(self.masters.params)
                               for m in self.masters.params[s]],
                              max_norm, self.topology, self._ties)

    def master_weights(self) -> Mapping[int, list[torch.Tensor]]:
        return self.masters.params

    def state_bytes(self) -> dict[str, int]:
        masters = sum(local_shard(m).numel() * m.element_size()
                      for ms in self.masters.params.values() for m in ms)
        moments = moment_bytes(self._optimizers.values())
        return {"masters": masters, "moments": moments}

    def set_lr(self, lr: float) -> None:
        set_learning_rate(self._optimizers.values(), lr)

    def step(self) -> None:
        for optimizer in self._optimizers.values():
            optimizer.step()
        self.masters.write_back()

    def zero_grad(self) -> None:
        for optimizer in self._optimizers.values():
            optimizer.zero_grad(set_to_none=True)

    def stage_state(self, stage: int) -> StageState:
        return self._saved.stage_state(stage)

    def load_stage_state(self, stage: int, saved: Mapping[str, Any]) -> None:
        self._saved.load_stage_state(stage, saved)
