"""Recompute regions inside a layer: a region's outputs and intermediates are not saved for
the backward; only its inputs are, and the backward re-runs it. training/model.py uses it for
``--recompute lgd`` (the paper authors' --recompute-lgd: norm and activation-function outputs),
``--recompute full`` (a whole block) and for half-precision norms (their float32 work).

Unlike torch.utils.checkpoint's non-reentrant mode, whose inputs never pass through the
saved-tensor hooks, the region here saves its inputs with ``ctx.save_for_backward``, so the
activation offloader moves them and the memory meter counts them like any saved tensor (the
simulator is given what the meter measured). Parameters are explicit inputs of the autograd
node, so their gradients flow through ordinary edges and the runtime's B/W split works: I asks
the node for the input gradient, W asks it again for the parameter gradients (the region is
re-run each time; runtime/backward.py Note: [B/W split]).

Note: [lgd gradient sums] a region changes which gradients autograd adds up, and in what
order: float addition is not associative, so only a region that keeps every sum's order keeps
results bit for bit. The block input x of ``--recompute lgd`` is used three times: by the
residual add and twice inside the norm (x * rsqrt(mean(x^2)) reads x directly and through
x^2). Without a region autograd sums (residual + direct) + through-the-square; a region over
the norm alone returns direct + through-the-square as one gradient, which the outer graph then
adds to the residual's: a different rounding, one float32 ulp in a loss on some CPUs (issue
25: 5.431514263 vs 5.431514740 with ATen's AVX2 kernels, equal with AVX-512 by chance). So a
region that reads a tensor the residual also reads passes it on (``h.view_as(h)``, made last,
so its gradient is added first, as the residual's is without a region) and the residual uses
that: all three terms are added inside the region, in the same order as without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from pipeoffload.runtime.shards import is_pending_collective


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable[..., tuple[Tensor, ...]], n_inputs: int,
                *args: Tensor) -> tuple[Tensor, ...]:
        ctx.fn, ctx.n_inputs = fn, n_inputs
        ctx.save_for_backward(*args[:n_inputs])
        ctx.params = args[n_inputs:]
        with torch.no_grad():
            return fn(*args[:n_inputs])

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        inputs = [t.detach().requires_grad_(needs) for t, needs
                  in zip(ctx.saved_tensors, ctx.needs_input_grad[2:2 + ctx.n_inputs])]
        wanted = [t for t in (*inputs, *ctx.params) if t.requires_grad]
        with torch.enable_grad():
            outputs = ctx.fn(*inputs)
        for output in outputs:
            if is_pending_collective(output):
                # Only its gradient is used here, so no op would wait for its collective (a
                # row-parallel reduce-scatter under TP): unwaited, its work stays registered,
                # buffers included, until the process ends.
                output.trigger_wait()
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        found = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                    allow_unused=True) if pairs else [None] * len(wanted)
        by_id = {id(t): g for t, g in zip(wanted, found)}
        return (None, None, *(by_id.get(id(t)) for t in (*inputs, *ctx.params)))


def recomputed(fn: Callable[..., tuple[Tensor, ...]], modules: Sequence[nn.Module],
               *inputs: Tensor) -> tuple[Tensor, ...]:
    """``fn(*inputs)`` (a tuple of tensors, computed from ``inputs`` and the parameters of
    ``modules`` only, without randomness), keeping only ``inputs`` for the backward."""
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    if not torch.is_grad_enabled():
        return fn(*inputs)
    return _Recomputed.apply(fn, len(inputs), *inputs, *params)
