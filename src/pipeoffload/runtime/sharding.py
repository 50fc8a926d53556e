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
- where the stage's backward is split (I / W: zbv, po-f, po-h), runs every I, W and B unsynced
  and, after the stage's last W (or B) of the step, FSDP's post-backward by hand
  (``reduce_after_split``): I computes only input gradients and W runs autograd from inside
  the graph, so FSDP's hooks either fire before the weight gradients exist (I) or not at all
  (W); torch.distributed.pipelining does the same (stage.py ``backward_maybe_with_nosync``
  for every backward, then ``perform_reduce_grad`` after the last),
- reshards it after its last B or W (and after a forward-only pass, which has no backward).
This is the order torch.distributed.pipelining drives FSDP2 in (its lowering's UNSHARD before
a stage's first compute and RESHARD after its last). Under a mixed-precision policy (``--dtype
bf16``: bf16 compute over float32 shards) the gathered parameters accumulate their gradients in
float32 (``accumulate_in_reduce_dtype``), each microbatch's cast as it is added, as the
unsharded bf16 optimizers do. Offload and recompute
compose: what autograd saves of a gathered parameter is a view of a parameter, which the
offloader keeps on the device and the meter does not count (runtime/keep.py, meter.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from pipeoffload.core.actions import Action, Kind


class ShardedStage(Protocol):
    """What the Pipeline asks of a sharded stage module (torch's ``FSDPModule`` has it)."""

    def unshard(self) -> object: ...

    def reshard(self) -> None: ...

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None: ...

    def set_reshard_after_backward(self, reshard_after_backward: bool) -> None: ...

    def set_is_last_backward(self, is_last_backward: bool) -> None: ...


def reduce_after_split(stage: ShardedStage) -> None:
    """The reduce-scatter and reshard of an FSDP2 stage whose backward ran split into I and W,
    with every part unsynced: what FSDP's autograd hooks do after a whole last backward, run by
    hand (torch.distributed.pipelining stage.py ``perform_reduce_grad`` does the same): each
    parameter group's post-backward with the three flags set, then the root's final callback,
    which waits for the reduce-scatter and finishes the backward."""
    from torch.distributed.fsdp import fully_shard

    stage.set_requires_gradient_sync(True)
    stage.set_reshard_after_backward(True)
    stage.set_is_last_backward(True)
    state = fully_shard.state(stage)  # type: ignore[attr-defined]
    for each in state._state_ctx.all_states:
        for group in each._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def accumulate_in_reduce_dtype(stage: ShardedStage) -> None:
    """Make autograd accumulate the gathered parameters' gradients in FSDP's reduce dtype
    (float32) where they are computed in a lower one (bf16 with a mixed-precision policy):
    every microbatch's gradient is cast to float32 as it is added, as ``--zero 0 / 1`` do
    (parallel/precision.py Note: [mixed precision]). FSDP itself casts only at its
    post-backward hook, which a split backward's W never reaches, so W's of several microbatches
    would otherwise add up in bf16. The gathered parameters persist across steps; call it after
    each unshard (cheap: an attribute per parameter)."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(stage)  # type: ignore[attr-defined]
    for group in state._fsdp_param_groups:
        for param in group.fsdp_params:
            reduce = param.reduce_dtype
            unsharded = param._unsharded_param
            if reduce is not None and unsharded.dtype != reduce and unsharded.grad is None:
                unsharded.grad_dtype = reduce


class StageShards:
    """Drives the sharded stages of one rank's action list in the order of Note: [sharded
    stages]: ``before(action)`` and ``after(action)`` around each action, ``finish()`` at the
    end of every pass (a step or a forward-only pass). ``reduce`` and ``unsharded`` are
    ``reduce_after_split`` and ``accumulate_in_reduce_dtype`` (stand-ins in tests)."""

    def __init__(self, stages: Mapping[int, ShardedStage], actions: Sequence[Action], *,
                 reduce: Callable[[ShardedStage], None] = reduce_after_split,
                 unsharded: Callable[[ShardedStage], None] = accumulate_in_reduce_dtype
                 ) -> None:
        self._stages = stages
        self._reduce, self._unsharded = reduce, unsharded
        mine = {s: [a for a in actions if a.stage == s] for s in stages}
        self._first = {s: next(a for a in acts if a.kind is Kind.F)
                       for s, acts in mine.items() if any(a.kind is Kind.F for a in acts)}
        # the stage's last backward action: its last B, or the last W of a split backward
        self._last = {s: [a for a in acts if a.kind in (Kind.B, Kind.W)][-1]
                      for s, acts in mine.items() if any(a.kind in (Kind.B, Kind.W)
                                                         for a in acts)}
        self._split = frozenset(s for s, acts in mine.items()
                                if any(a.kind in (Kind.I, Kind.W) for a in acts))

    def before(self, action: Action) -> None:
        stage = self._stages.get(action.stage)
        if stage is None:
            return
        if action.kind is Kind.F and self._first.get(action.stage) == action:
            stage.unshard()
            self._unsharded(stage)
        elif action.kind in (Kind.B, Kind.I, Kind.W):
            # a whole last B syncs in FSDP's hooks; a split backward reduces by hand after it
            last = self._last[action.stage] == action and action.stage not in self._split
            stage.set_requires_gradient_sync(last)
            stage.set_reshard_after_backward(last)
            stage.set_is_last_backward(last)

    def after(self, action: Action) -> None:
        if self._last.get(action.stage) != action:
            return
        stage = self._stages[action.stage]
        if action.stage in self._split:
            self._reduce(stage)
        stage.reshard()

    def finish(self) -> None:
        """Every sharded stage back to its shards (a no-op where its last B resharded it)."""
        for stage in self._stages.values():
            stage.reshard()
