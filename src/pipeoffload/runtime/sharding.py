"""Stages whose parameters are sharded over data-parallel ranks (FSDP2, ``--zero 3``): when
the Pipeline gathers and frees them, and when their gradients are reduce-scattered.

Note: [sharded stages] A sharded stage (torch's ``fully_shard``: an ``FSDPModule``) holds 1/dp
of each parameter between steps. Within a step the Pipeline, reading the rank's action list,
- unshards it (an all-gather) before its first F,
- keeps it whole through every later F and B (the module is wrapped with
  ``reshard_after_forward=False``, and each B but the last runs with
  ``set_reshard_after_backward(False)``),
- runs every B but the stage's last with ``set_requires_gradient_sync(False)`` and
  ``set_is_last_backward(False)``, so each microbatch's gradient accumulates into the
  unsharded gradient, and the last with all three set, so FSDP reduce-scatters the step's
  summed gradient once (averaged over the data-parallel ranks) and reshards after it,
- reshards it after its last B (and after a forward-only pass, which has no backward).
This is the order torch.distributed.pipelining drives FSDP2 in (stage.py
``backward_maybe_with_nosync``, then ``perform_reduce_grad`` after the last backward; its
lowering's UNSHARD before a stage's first compute and RESHARD after its last); torch calls
FSDP's post-backward by hand there because its B / W split bypasses the autograd hooks, so a
split backward (I / W) is refused here instead (``check_unsplit``). Offload and recompute
compose: what autograd saves of a gathered parameter is a view of a parameter, which the
offloader keeps on the device and the meter does not count (runtime/keep.py, meter.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from pipeoffload.core.actions import Action, Kind
from pipeoffload.errors import ConfigError


class ShardedStage(Protocol):
    """What the Pipeline asks of a sharded stage module (torch's ``FSDPModule`` has it)."""

    def unshard(self) -> object: ...

    def reshard(self) -> None: ...

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None: ...

    def set_reshard_after_backward(self, reshard_after_backward: bool) -> None: ...

    def set_is_last_backward(self, is_last_backward: bool) -> None: ...


def check_unsplit(actions: Sequence[Action], stages: Mapping[int, object]) -> None:
    """ConfigError when a sharded stage's backward is split into I and W (see the Note)."""
    split = next((a for a in actions if a.stage in stages and a.kind in (Kind.I, Kind.W)),
                 None)
    if split is not None:
        raise ConfigError(f"action {split}: a stage sharded with FSDP2 (--zero 3) needs whole "
                          "backward passes (B); FSDP reduce-scatters its gradients in the "
                          "autograd hooks of a whole backward, which I / W bypass; choose a "
                          "schedule without split backward, or --zero 1")


class StageShards:
    """Drives the sharded stages of one rank's action list in the order of Note: [sharded
    stages]: ``before(action)`` and ``after(action)`` around each action, ``finish()`` at the
    end of every pass (a step or a forward-only pass)."""

    def __init__(self, stages: Mapping[int, ShardedStage], actions: Sequence[Action]) -> None:
        check_unsplit(actions, stages)
        self._stages = stages
        self._first = {s: next(a for a in actions if a.stage == s and a.kind is Kind.F)
                       for s in stages if any(a.stage == s and a.kind is Kind.F
                                              for a in actions)}
        self._last = {s: [a for a in actions if a.stage == s and a.kind is Kind.B][-1]
                      for s in stages if any(a.stage == s and a.kind is Kind.B
                                             for a in actions)}

    def before(self, action: Action) -> None:
        stage = self._stages.get(action.stage)
        if stage is None:
            return
        if action.kind is Kind.F and self._first.get(action.stage) == action:
            stage.unshard()
        elif action.kind is Kind.B:
            last = self._last[action.stage] == action
            stage.set_requires_gradient_sync(last)
            stage.set_reshard_after_backward(last)
            stage.set_is_last_backward(last)

    def after(self, action: Action) -> None:
        if action.kind is Kind.B and self._last.get(action.stage) == action:
            self._stages[action.stage].reshard()

    def finish(self) -> None:
        """Every sharded stage back to its shards (a no-op where its last B resharded it)."""
        for stage in self._stages.values():
            stage.reshard()
