"""What a failing stage forward or loss says: the stage, the microbatch, what it was given and
what it expected, instead of an exception from deep inside the user's module or autograd."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from pipeoffload.errors import PipelineRuntimeError
from pipeoffload.runtime.inputs import StageCall

TensorTuple = tuple[torch.Tensor, ...]


def describe(tensors: TensorTuple) -> str:
    """``(float32 [2, 8], int64 [2])``: dtype and shape of each tensor."""
    return "(" + ", ".join(f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
                           for t in tensors) + ")"


def forward_failed(stage: int, microbatch: int, is_first: bool, module: nn.Module,
                   inputs: TensorTuple, error: Exception) -> PipelineRuntimeError:
    """The error for a stage module that raised on ``inputs`` (Note: [stage contract])."""
    given = ("the microbatch of step()'s inputs" if is_first
             else f"the outputs of stage {stage - 1} (what the previous stage returned)")
    where = f"stage {stage}, microbatch {microbatch}: forward{describe(inputs)}"
    if isinstance(error, TypeError) and not _takes(module, len(inputs)):
        return PipelineRuntimeError(
            f"{where}: its forward{_signature(module)} cannot take {len(inputs)} positional "
            f"tensor(s); they are {given}: make the stages agree on what they pass on "
            f"(TypeError: {error})")
    hint = _dtype_hint(module, inputs)
    return PipelineRuntimeError(f"{where} failed on {given}{hint}: {type(error).__name__}: "
                                f"{error}")


def check_loss(stage: int, microbatch: int, loss: torch.Tensor, output_needs_grad: bool) -> None:
    """Refuse a loss that cannot be backpropagated: not floating point, or cut off from the
    stage's output (detached) while the output needs a gradient."""
    where = f"stage {stage}, microbatch {microbatch}: loss_fn returned"
    if not (loss.is_floating_point() or loss.is_complex()):
        raise PipelineRuntimeError(
            f"{where} a tensor of dtype {str(loss.dtype).removeprefix('torch.')}; it must return a "
            "floating-point scalar computed from the output (gradients flow only through "
            "floating point)")
    if output_needs_grad and not loss.requires_grad and torch.is_grad_enabled():
        raise PipelineRuntimeError(
            f"{where} a tensor that does not depend on the output through autograd (made with "
            ".detach(), .item(), torch.no_grad() or torch.tensor(...)): no parameter would get "
            "a gradient; compute the loss from the output with tensor operations")


def _inner(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, StageCall) else module


def _takes(module: nn.Module, count: int) -> bool:
    """Whether the module's forward accepts ``count`` positional tensors (True if unknown)."""
    inner = _inner(module)
    if isinstance(module, StageCall) and (module.names is not None or module.constants):
        return True  # keyword inputs or constants: positional arity says nothing
    try:
        inspect.signature(inner.forward).bind(*range(count))
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin)
        return True
    return True


def _signature(module: nn.Module) -> str:
    try:
        return str(inspect.signature(_inner(module).forward))
    except (TypeError, ValueError):
        return "(...)"


def _dtype_hint(module: nn.Module, inputs: TensorTuple) -> str:
    """Names a floating input whose dtype differs from the stage's floating parameters'."""
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        return ""
    (dtype,) = dtypes
    for index, tensor in enumerate(inputs):
        if tensor.is_floating_point() and tensor.dtype != dtype:
            return (f" (input {index} is {str(tensor.dtype).removeprefix('torch.')}, the "
                    f"stage's parameters are {str(dtype).removeprefix('torch.')})")
    return ""
