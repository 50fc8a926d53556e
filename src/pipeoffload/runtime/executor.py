"""The executor of one rank's action list: one handler per action kind.

It owns no policy: the schedule says what runs when; the executor moves tensors between the
stage wrappers, the transport and the offloader, and keeps the per-step bookkeeping (received
tensors, tensors waiting to be sent, losses).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field

import torch

from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.schedule import Schedule
from pipeoffload.errors import PipelineRuntimeError
from pipeoffload.runtime.lowering import early_receives, message_of, peer_of
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.offloader import ActivationOffloader
from pipeoffload.runtime.p2p import DistTransport, LocalTransport, Pending
from pipeoffload.runtime.sharding import ShardedStage, StageShards
from pipeoffload.runtime.stage import RngState, StageRunner

TensorTuple = tuple[torch.Tensor, ...]


@dataclass
class StepData:
    """One step's microbatches (taken when used, so nothing outlives its forward) and losses."""

    inputs: list[TensorTuple | None]
    targets: list[TensorTuple | None]
    losses: dict[int, torch.Tensor] = field(default_factory=dict)


# Handlers by kind, as method names: a table of bound methods would make each executor a
# reference cycle, which keeps a dropped Pipeline (and its host buffers) until a full GC.
_HANDLERS: dict[Kind, str] = {
    Kind.F: "_forward", Kind.I: "_backward", Kind.B: "_backward", Kind.W: "_weight",
    Kind.SEND_F: "_send", Kind.SEND_B: "_send", Kind.RECV_F: "_recv", Kind.RECV_B: "_recv",
    Kind.OFFLOAD: "_offload", Kind.RELOAD: "_reload", Kind.FETCH: "_fetch",
    Kind.OFFLOAD_WAIT: "_offload_wait", Kind.RECOMPUTE: "_recompute",
}


class RankExecutor:
    """Runs the actions of ``rank`` (a schedule with explicit comms, see lowering.with_comms)."""

    def __init__(
        self,
        rank: int,
        schedule: Schedule,
        stages: dict[int, StageRunner],
        transport: LocalTransport | DistTransport,
        offloader: ActivationOffloader | None,
        meter: ActivationMeter | None,
        clone_hand_off: bool,
        stream_offload: bool = True,
        device: torch.device | None = None,
        recv_lookahead: int = 0,
        forward_only: bool = False,
        sharded: dict[int, ShardedStage] | None = None,
    ) -> None:
        self.rank = rank
        # FSDP2 stages of this rank: gathered and freed around their actions (runtime/sharding.py)
        self._shards = (StageShards(sharded, schedule.ranks[rank]) if sharded else None)
        self._forward_only = forward_only  # Pipeline.evaluate: F records no graph
        self._schedule = schedule
        self._stages = stages
        self._transport = transport
        self._offloader = offloader
        self._meter = meter
        self._clone = clone_hand_off
        self._stream = stream_offload
        self._device = device  # the pipeline's: a parameter-free stage cannot tell it
        self._offloaded = {(a.stage, a.microbatch) for a in schedule.ranks[rank]
                           if a.kind is Kind.OFFLOAD}
        self._recomputed = {(a.stage, a.microbatch) for a in schedule.ranks[rank]
                            if a.kind is Kind.RECOMPUTE}
        # Receives posted ahead of their place (RuntimeConfig.recv_lookahead; gloo only).
        self._early = (early_receives(list(schedule.ranks[rank]), recv_lookahead)
                       if recv_lookahead else {})
        self._posted_early = frozenset(r for recvs in self._early.values() for r in recvs)
        self._reset()

    def _reset(self) -> None:
        self._inbox: dict[tuple[str, int, int], Pending | TensorTuple] = {}
        self._outbox: dict[tuple[str, int, int], TensorTuple] = {}
        self._grad_meta: dict[tuple[int, int], tuple[tuple[tuple[int, ...], torch.dtype], ...]] = {}
        # Note: [recompute] what a recomputed (stage, microbatch) keeps between its F (run
        # without autograd recording) and its RECOMPUTE: inputs, target and the RNG state.
        self._kept: dict[tuple[int, int], tuple[TensorTuple, TensorTuple, RngState]] = {}

    def run(self, action: Action, step: StepData) -> None:
        """Execute one action; any failure becomes a PipelineRuntimeError naming it."""
        try:
            early = self._early.get(action)
            if early is not None:
                for recv in early:
                    self._post_recv(recv)
            if self._shards is not None:
                self._shards.before(action)
            getattr(self, _HANDLERS[action.kind])(action, step)
            if self._shards is not None:
                self._shards.after(action)
        except PipelineRuntimeError:
            raise
        except Exception as error:
            raise PipelineRuntimeError(f"rank {self.rank}, action {action}: {error!r}") from error
        if self._offloader is not None:
            self._offloader.poll()

    def finish(self) -> None:
        """End of step: nothing may be left half done; sharded stages are resharded."""
        left = {str(k): v for k, v in {**self._inbox, **self._outbox}.items()}
        self._reset()
        if self._shards is not None:
            self._shards.finish()
        if left:
            raise PipelineRuntimeError(f"rank {self.rank}: step ended with unconsumed messages "
                                       f"{sorted(left)}; the schedule has a SEND or RECV too many")
        for stage in self._stages.values():
            if stage.pending():
                raise PipelineRuntimeError(
                    f"rank {self.rank}: stage {stage.index} microbatches {stage.pending()} "
                    "never finished their backward (missing B or W in the schedule)")

    def abandon(self) -> None:
        """Forget a failed step's messages and kept inputs."""
        self._reset()

    def _take(self, box_key: tuple[str, int, int], action: Action) -> TensorTuple:
        item = self._inbox.pop(box_key, None)
        if item is None:
            raise PipelineRuntimeError(
                f"rank {self.rank}, action {action}: its input {box_key} was neither received "
                "nor handed over on this rank; the schedule lacks a RECV or runs it too late")
        if isinstance(item, Pending):
            return self._transport.wait(item)
        return item

    def _forward(self, action: Action, step: StepData) -> None:
        stage, _, mb = action
        runner = self._stages[stage]
        if runner.is_first:
            inputs, step.inputs[mb] = step.inputs[mb], None
        else:
            inputs = self._take(("F", stage, mb), action)
        target: TensorTuple | None = ()
        if runner.is_last:
            target, step.targets[mb] = step.targets[mb], None
        if inputs is None or target is None:
            raise PipelineRuntimeError(f"rank {self.rank}: {action} runs twice in one step")
        if self._forward_only:
            outputs = runner.forward_unrecorded(inputs, target)
        elif (stage, mb) in self._recomputed:
            device = self._device if self._device is not None else runner.device
            self._kept[(stage, mb)] = (inputs, target, RngState.capture(device))
            outputs = runner.forward_unrecorded(inputs, target)
        else:
            outputs = self._recorded_forward(runner, mb, inputs, target)
        del inputs, target
        if runner.is_last:
            step.losses[mb] = outputs[0]
            return
        floating = tuple(t for t in outputs if t.is_floating_point())
        self._grad_meta[(stage, mb)] = tuple((tuple(t.shape), t.dtype) for t in floating)
        self._deliver(("F", stage + 1, mb), outputs)

    def _recorded_forward(self, runner: StageRunner, mb: int, inputs: TensorTuple,
                          target: TensorTuple) -> TensorTuple:
        stage = runner.index
        with ExitStack() as stack:
            if self._meter is not None:
                stack.enter_context(self._meter.scope(self.rank, (stage, mb)))
            return runner.forward(mb, inputs, target, self._saving(stage, mb))

    def _saving(self, stage: int, mb: int) -> AbstractContextManager[object] | None:
        choice = self._schedule.class_choice(stage, mb)
        offloaded = (stage, mb) in self._offloaded
        if self._offloader is not None and (offloaded or choice is not None and choice.recomputed):
            # an item that recomputes classes without an OFFLOAD keeps every other class
            moved, recomputed = choice.names if choice is not None else (None, ())
            return self._offloader.scope((stage, mb), self.rank, self._stream,
                                         classes=moved if offloaded else (),
                                         recomputed=recomputed)
        if self._meter is not None:
            return self._meter.observe(self.rank)
        return None

    def _deliver(self, box_key: tuple[str, int, int], tensors: TensorTuple) -> None:
        """Hand ``tensors`` to a stage of this rank, or keep them for the SEND action."""
        if box_key[1] in self._stages:
            self._inbox[box_key] = tuple(t.clone() for t in tensors) if self._clone else tensors
        else:
            self._outbox[box_key] = tensors

    def _backward(self, action: Action, step: StepData) -> None:
        stage, kind, mb = action
        runner = self._stages[stage]
        received: TensorTuple = ()
        if not runner.is_last:
            received = self._take(("B", stage, mb), action)
        if self._offloader is not None:
            self._offloader.wait_reloaded((stage, mb))
            self._offloader.recompute((stage, mb))  # its dropped tensor classes, if any
        grads = runner.backward(mb, received, split=kind is Kind.I)
        del received
        if kind is Kind.B:
            self._free(stage, mb)
        if not runner.is_first:
            self._deliver(("B", stage - 1, mb), grads)

    def _weight(self, action: Action, step: StepData) -> None:
        self._stages[action.stage].weight(action.microbatch)
        self._free(action.stage, action.microbatch)

    def _free(self, stage: int, mb: int) -> None:
        if self._offloader is not None:
            self._offloader.discard((stage, mb))

    def _send(self, action: Action, step: StepData) -> None:
        message = message_of(action)
        tensors = self._outbox.pop(message, None)
        if tensors is None:
            raise PipelineRuntimeError(
                f"rank {self.rank}, action {action}: nothing to send; the computation producing "
                f"{message} has not run on this rank before it")
        self._transport.send(message, tensors, peer_of(self._schedule, action), action)

    def _recv(self, action: Action, step: StepData) -> None:
        if action not in self._posted_early:
            self._post_recv(action)

    def _post_recv(self, action: Action) -> None:
        message = message_of(action)
        meta = self._grad_meta.get((action.stage, action.microbatch)) if message[0] == "B" else None
        if message[0] == "B" and meta is None:
            raise PipelineRuntimeError(f"rank {self.rank}, action {action}: a gradient is "
                                       "received before the forward of the same stage ran")
        self._inbox[message] = self._transport.recv(
            message, peer_of(self._schedule, action), meta, action)

    def _offload(self, action: Action, step: StepData) -> None:
        self._require_offloader(action).offload((action.stage, action.microbatch))

    def _reload(self, action: Action, step: StepData) -> None:
        self._require_offloader(action).reload((action.stage, action.microbatch))

    def _fetch(self, action: Action, step: StepData) -> None:
        self._require_offloader(action).fetch_on_use((action.stage, action.microbatch))

    def _require_offloader(self, action: Action) -> ActivationOffloader:
        if self._offloader is None:
            raise PipelineRuntimeError(f"rank {self.rank}, action {action}: no offloader")
        return self._offloader

    def _offload_wait(self, action: Action, step: StepData) -> None:
        self._require_offloader(action).wait_offloaded((action.stage, action.microbatch))

    def _recompute(self, action: Action, step: StepData) -> None:
        """Re-run the forward with autograd recording, from the kept inputs and RNG state, so
        the backward that follows sees exactly what a kept activation would have given."""
        stage, _, mb = action
        kept = self._kept.pop((stage, mb), None)
        if kept is None:
            raise PipelineRuntimeError(f"rank {self.rank}, action {action}: no forward of it ran "
                                       "on this rank before (RECOMPUTE follows its F)")
        inputs, target, rng = kept
        runner = self._stages[stage]
        with rng.restored():
            self._recorded_forward(runner, mb, inputs, target)
