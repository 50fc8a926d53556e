"""The stage wrapper: runs one stage module's forward for a microbatch and, later, the backward
parts the schedule asks for (B, or I then W), keeping only what those need in between."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from pipeoffload.errors import PipelineRuntimeError
from pipeoffload.runtime.backward import (
    WeightGradState,
    input_backward,
    plain_backward,
    weight_backward,
)
from pipeoffload.runtime.stage_errors import check_loss, forward_failed

TensorTuple = tuple[torch.Tensor, ...]


class _StageInput(torch.autograd.Function):
    """Marks a received tensor as a stage input whose gradient I or B computes.

    I reads the gradient at this node's edge (``autograd.grad(inputs=)``), so the node does
    not run there. In B the node runs once and leaves the gradient in ``box[0]``: reading it
    with a pre-hook instead (``backward.full_backward``) costs a hook registration and a second
    Python call, ~3 % of a tiny stage's B (benchmarks/stage_backward.py). Unlike a leaf with
    requires_grad, nothing in the graph keeps the received buffer alive except saved tensors,
    which the offloader and the meter then account for.
    """

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, received: torch.Tensor,
                box: list[torch.Tensor | None]) -> torch.Tensor:
        ctx.box = box
        return received.view_as(received)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.box[0] = grad
        return None, None, None


@dataclass
class _Forwarded:
    """What one (stage, microbatch) keeps between its F and the end of its backward."""

    outputs: list[GradientEdge]  # outputs that need a gradient (the loss, on the last stage)
    grad_slots: list[int]  # for each of ``outputs``: index among the floating outputs sent on
    inputs: list[GradientEdge]  # stage inputs whose gradient is sent back
    input_meta: list[tuple[torch.Size, torch.dtype, torch.device]]
    input_boxes: list[list[torch.Tensor | None]]  # where B leaves each input's gradient
    loss_like: torch.Tensor | None = None  # an empty tensor with the loss's dtype and device
    weight_state: WeightGradState | None = None


@dataclass(frozen=True)
class RngState:
    """The random-number state a forward started with, so a recomputation draws the same
    numbers (dropout and the like): the CPU generator and, on CUDA, the device's."""

    cpu: torch.Tensor
    device: torch.device
    cuda: torch.Tensor | None

    @staticmethod
    def capture(device: torch.device) -> RngState:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return RngState(torch.get_rng_state(), device, cuda)

    @contextmanager
    def restored(self) -> Iterator[None]:
        """Run the block from this state; the generators continue afterwards as before it."""
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


class StageRunner:
    """One stage module on this process; ``is_last`` stages apply ``loss_fn``."""

    def __init__(
        self,
        index: int,
        module: nn.Module,
        is_first: bool,
        is_last: bool,
        loss_fn: Callable[..., torch.Tensor],
        microbatches: int,
    ) -> None:
        self.index = index
        self.module = module
        self.is_first = is_first
        self.is_last = is_last
        self._loss_fn = loss_fn
        self._scale = 1.0 / microbatches
        self._anchor = torch.empty(0, requires_grad=True)
        self._state: dict[int, _Forwarded] = {}
        self._params: list[torch.Tensor] | None = None

    @property
    def device(self) -> torch.device:
        for tensor in self.module.parameters():
            return tensor.device
        return torch.device("cpu")

    def forward_unrecorded(self, inputs: TensorTuple, target: TensorTuple) -> TensorTuple:
        """F of a recomputed microbatch: the same outputs, no autograd graph, nothing kept."""
        with torch.no_grad():
            result = self.module(*inputs)
            if self.is_last:
                result = self._loss_fn(result, *target)
        return _as_outputs(result, self.index)

    @property
    def params(self) -> list[torch.Tensor]:
        """Trainable parameters (cached: asked for twice per microbatch)."""
        if self._params is None:
            self._params = [p for p in self.module.parameters() if p.requires_grad]
        return self._params

    def forward(
        self,
        microbatch: int,
        inputs: TensorTuple,
        target: TensorTuple,
        saving: AbstractContextManager[object] | None = None,
    ) -> TensorTuple:
        """Run F; returns the outputs to send on (detached), or the detached loss if last."""
        marked = []
        input_edges: list[GradientEdge] = []
        input_meta: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        boxes: list[list[torch.Tensor | None]] = []
        for tensor in inputs:
            if not self.is_first and tensor.is_floating_point():
                boxes.append([None])
                tensor = _StageInput.apply(self._anchor, tensor, boxes[-1])
                input_edges.append(get_gradient_edge(tensor))
                input_meta.append((tensor.shape, tensor.dtype, tensor.device))
            marked.append(tensor)
        with saving if saving is not None else nullcontext():
            try:
                result = self.module(*marked)
            except Exception as error:
                raise forward_failed(self.index, microbatch, self.is_first, self.module,
                                     tuple(marked), error) from error
            if self.is_last:
                output_needs_grad = any(t.requires_grad for t in _as_outputs(result, self.index))
                result = self._loss_fn(result, *target)
        del marked
        outputs = _as_outputs(result, self.index)
        if self.is_last:
            loss = outputs[0]
            if loss.numel() != 1:
                raise PipelineRuntimeError(
                    f"stage {self.index}: loss_fn returned shape {list(loss.shape)}; "
                    "it must return a scalar (reduce with mean or sum)"
                )
            check_loss(self.index, microbatch, loss, output_needs_grad)
            edges = [get_gradient_edge(loss)] if loss.requires_grad else []
            self._state[microbatch] = _Forwarded(edges, [0] * len(edges), input_edges, input_meta,
                                                 boxes, loss.new_empty(()))
            return (loss.detach(),)
        floating = [t for t in outputs if t.is_floating_point()]
        edges, slots = [], []
        for slot, tensor in enumerate(floating):
            if tensor.requires_grad:
                edges.append(get_gradient_edge(tensor))
                slots.append(slot)
        self._state[microbatch] = _Forwarded(edges, slots, input_edges, input_meta, boxes)
        return tuple(t.detach() for t in outputs)

    def _output_grads(self, state: _Forwarded, received: TensorTuple) -> list[torch.Tensor]:
        if state.loss_like is not None:
            # Mean over microbatches, like torch.distributed.pipelining's scale_grads=True.
            return [torch.full_like(state.loss_like, self._scale)] * len(state.outputs)
        return [received[slot] for slot in state.grad_slots]

    def backward(self, microbatch: int, received: TensorTuple, split: bool) -> TensorTuple:
        """B (``split=False``) or I: returns the gradients of the floating inputs, in order."""
        state = self._state.get(microbatch)
        if state is None:
            raise PipelineRuntimeError(f"stage {self.index}: backward of microbatch {microbatch} "
                                       "before its forward")
        grads_out = self._output_grads(state, received)
        if not state.outputs:
            grads: list[torch.Tensor | None] = [None] * len(state.inputs)
        elif split:
            grads, state.weight_state = input_backward(
                state.outputs, grads_out, state.inputs, self.params)
        else:
            plain_backward(state.outputs, grads_out)  # fills the boxes (see _StageInput)
            grads = [box[0] for box in state.input_boxes]
        result = tuple(
            torch.zeros(shape, dtype=dtype, device=device) if g is None else g
            for g, (shape, dtype, device) in zip(grads, state.input_meta)
        )
        if split:
            state.inputs = []  # W needs only the outputs and what I captured
        else:
            del self._state[microbatch]
        return result

    def weight(self, microbatch: int) -> None:
        """W: parameter gradients from what I kept; frees the (stage, microbatch)'s graph."""
        state = self._state.pop(microbatch, None)
        if state is None:
            raise PipelineRuntimeError(f"stage {self.index}: W of microbatch {microbatch} without "
                                       "a forward and I before it")
        if state.weight_state is not None:
            weight_backward(state.weight_state, state.outputs, self.params)

    def abandon(self) -> None:
        """Forget every microbatch of a failed step (their graphs are freed)."""
        self._state.clear()

    def pending(self) -> list[int]:
        """Microbatches whose backward has not finished (empty after a complete step)."""
        return sorted(self._state)


def _as_outputs(result: object, stage: int) -> TensorTuple:
    if isinstance(result, torch.Tensor):
        return (result,)
    if isinstance(result, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in result):
        return tuple(result)
    raise PipelineRuntimeError(
        f"stage {stage} returned a {type(result).__name__}; a stage must return a tensor or a "
        "tuple of tensors (and loss_fn a scalar tensor)"
    )
