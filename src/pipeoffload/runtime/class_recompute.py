"""Recompute of dropped tensor classes: the ops that made a saved tensor, run again.

Note: [class recompute] a (stage, microbatch) whose class choice recomputes some classes
(core/classes.py) runs its forward under ``OpRecorder``, a dispatch mode that notes each aten op
by structure: the op, its non-tensor arguments, and for each tensor argument the op output it
is (``Ref``) or, for a tensor made before the forward, the tensor itself (parameters, buffers
and the stage's input, which the step holds anyway). It holds no tensor the forward made, so
what autograd does not save is freed as usual; it costs one Python call per op of such a
forward. The offloader keeps a dropped class's saved tensor as its ``Ref`` only, and
keeps the ``Ref`` of every saved tensor it does hold (kept, moved): those are where a recompute
starts. At the first backward pass of the item, ``replay`` runs, in forward order and without
autograd, exactly the ops between those saved tensors and the dropped ones (a norm, a matmul,
the attention core, the activation function: the steps planner/tensor_classes.py prices), so
the dropped tensors are back, bit for bit (same kernels, same inputs), before the backward
needs them: resident from that pass's start to the item's last backward pass, as the
simulator counts them (sim/memory.py).

An op that draws random numbers (dropout, an attention with dropout) is recorded with its
device generator's state as it ran, and replayed from that state (the state around it is put
back), so its draws are the same. Refused, naming the op (``PipelineRuntimeError``): a
recompute through a collective (one rank cannot run it again alone) or through an op that
changes in place a tensor the replay reads but does not make (a saved one, a parameter, the
stage's input); one that changes what the replay made (a dropout mask drawn into a fresh
tensor) runs again in its place. A tensor changed in place after an op
read it is no obstacle: the reader's recording names the op output it read, which the replay
makes again.

On CUDA (reasoned, not run on a GPU yet) the replay is queued on the compute stream after the
backward's wait for the item's RELOAD (executor: wait_reloaded, then recompute), so it reads
reloaded bytes; a fetched saved tensor is read as the backward reads it (the offloader's
``_fetch_storage``); its results are allocated and, at the item's discard, freed on that same
stream, behind the backward that used them, so the caching allocator cannot hand them out
early. A random op's CUDA generator state (seed and offset) is read on the host as the op is
launched, which is when the op takes its offset.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from pipeoffload.errors import PipelineRuntimeError
from pipeoffload.runtime.stage import RngState

#: Namespaces of communication ops (torch.distributed's functional and in-place collectives).
_COLLECTIVES = frozenset({"_c10d_functional", "c10d", "_c10d_functional_autograd"})


@dataclass(eq=False)
class _Op:
    """One recorded op: ``func`` called on ``args`` / ``kwargs`` whose tensors are ``Ref``s
    (made in the forward) or held tensors (made before it). ``order``: its place in the forward."""

    order: int
    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    writes: tuple[Any, ...]  # what an in-place or out= op changes, as recorded
    rng: RngState | None  # a random op's generator state before it


@dataclass(frozen=True, eq=False)
class Ref:
    """Output ``index`` (of the op's flattened outputs) of ``op``."""

    op: _Op
    index: int


class OpRecorder(TorchDispatchMode):
    """Records the aten ops run under it (Note: [class recompute]); ``ref_of`` names the op
    output a tensor is."""

    def __init__(self) -> None:
        super().__init__()
        self._made = WeakTensorKeyDictionary()  # tensor -> Ref of the op output it is
        self._count = 0

    def ref_of(self, tensor: torch.Tensor) -> Ref | None:
        """The op output ``tensor`` is, None for a tensor made before the recording."""
        return self._made.get(tensor)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        rng = None
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
            rng = RngState.capture(_device_of((args, kwargs)))
        out = func(*args, **kwargs)
        recorded_args, recorded_kwargs = tree_map(self._recorded, (tuple(args), dict(kwargs)))
        op = _Op(self._count, func, recorded_args, recorded_kwargs,
                 _written(func, recorded_args, recorded_kwargs), rng)
        self._count += 1
        leaves, _ = tree_flatten(out)
        for index, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                # an in-place op's output is the tensor it changed: from now on that tensor
                # is this op's output (what a later reader saw)
                self._made[leaf] = Ref(op, index)
        return out

    def _recorded(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        ref = self._made.get(value)
        return ref if ref is not None else value


def replay(wanted: list[Ref], saved: Mapping[Ref, Callable[[], torch.Tensor]],
           ran: list[str] | None = None) -> dict[Ref, torch.Tensor]:
    """The tensors ``wanted`` names, made again by running, in forward order and without
    autograd, the recorded ops between them and the tensors ``saved`` gives (a saved output
    is read, never recomputed). ``ran`` gets the name of each op run."""
    needed: set[_Op] = set()
    stack = [ref for ref in wanted if ref not in saved]
    while stack:
        op = stack.pop().op
        if op in needed:
            continue
        needed.add(op)
        for arg in tree_flatten((op.args, op.kwargs))[0]:
            if isinstance(arg, Ref) and arg not in saved and arg.op not in needed:
                stack.append(arg)
    values: dict[Ref, torch.Tensor] = {}
    outputs: dict[_Op, list[Any]] = {}

    def value(arg: Any) -> Any:
        if not isinstance(arg, Ref):
            return arg
        if arg in saved:
            if arg not in values:
                values[arg] = saved[arg]()
            return values[arg]
        return outputs[arg.op][arg.index]

    with torch.no_grad():
        for op in sorted(needed, key=lambda o: o.order):
            if getattr(op.func, "namespace", "") in _COLLECTIVES:
                raise PipelineRuntimeError(
                    f"a recomputed tensor class needs {op.func}, a collective, which one rank "
                    "cannot run again alone: keep or offload that class instead")
            if any(not isinstance(w, Ref) or w in saved for w in op.writes):
                raise PipelineRuntimeError(
                    f"a recomputed tensor class needs {op.func}, which changes a saved or "
                    "outside tensor in place: keep or offload that class instead")
            args, kwargs = tree_map(value, (op.args, op.kwargs))
            with op.rng.restored() if op.rng is not None else nullcontext():
                out = op.func(*args, **kwargs)
            if ran is not None:
                ran.append(str(op.func))
            outputs[op] = tree_flatten(out)[0]
    for ref in wanted:
        values[ref] = value(ref)
    return values



def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The recorded arguments ``func`` writes to (its schema's mutable ones)."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return ()
    written = []
    for i, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            written.append(args[i] if i < len(args) else kwargs.get(argument.name))
    return tuple(written)


def _device_of(tree: Any) -> torch.device:
    """The device of an op's first tensor (or device) argument; CPU without one."""
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf.device
        if isinstance(leaf, torch.device):
            return leaf
    return torch.device("cpu")

