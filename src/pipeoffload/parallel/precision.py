"""Numeric precision of training: the dtypes, and float32 master weights for bf16 stages.

Note: [mixed precision] ``--dtype bf16`` is Megatron's scheme, the one the planner's memory
model assumes (planner/ratio.py OptimizerSpec: 2-byte weights, 4-byte gradients and master
weights, 8 bytes of Adam moments; planner/transformer.py: 2-byte activations): the stage
modules hold bfloat16 weights, so every activation, saved tensor, offloaded byte and P2P
message is bfloat16; each parameter has a float32 master copy, and AdamW updates the masters
(its moments float32 too) and writes them back rounded to bfloat16. Gradients accumulate over
the step's microbatches in float32, as Megatron's ``main_grad`` does: each parameter's
``grad_dtype`` is float32, so autograd casts every microbatch's bfloat16 gradient to float32
before adding it to ``.grad`` (``Tensor.grad_dtype``, pytorch/pytorch#162815, torch >= 2.10).
Against the exact sum of the same bfloat16 microbatch gradients, accumulating in bfloat16 missed
by 0.86 % at 64 microbatches, in float32 by 2e-9 (tests/test_bf16_gradients.py). Autocast was not
chosen: it keeps float32 weights (4 bytes a parameter more than the planner counts) and saves a
mix of float32 and bfloat16 activations, so the offloaded bytes would not halve.
``fp32`` and ``fp64`` train in that dtype with no master copy (fp64 for exactness tests).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from pipeoffload.errors import ConfigError
from pipeoffload.parallel.dtype_names import DTYPE_NAMES
from pipeoffload.runtime.shards import local_shard

DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float64), strict=True))
_HAS_GRAD_DTYPE = hasattr(torch.Tensor, "grad_dtype")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of ``--dtype`` ``name``."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ConfigError(f"--dtype {name!r}: choose one of {', '.join(DTYPES)}") from None


class MasterWeights:
    """The parameters the optimizer updates, per stage: the modules' own, or (bf16) float32
    copies of them (Note: [mixed precision])."""

    def __init__(self, stages: Mapping[int, nn.Module], mixed: bool) -> None:
        self.mixed = mixed
        self._model = {s: [p for p in m.parameters() if p.requires_grad]
                       for s, m in stages.items()}
        if mixed:
            accumulate_in_float32([p for ps in self._model.values() for p in ps])
        self.params: dict[int, list[torch.Tensor]] = {
            s: [p.detach().float().requires_grad_() for p in ps] if mixed else list(ps)
            for s, ps in self._model.items()}

    def take_grads(self) -> None:
        """Move the step's gradients (accumulated in float32) onto the masters (no-op
        unmixed)."""
        if not self.mixed:
            return
        for s, params in self._model.items():
            for p, master in zip(params, self.params[s]):
                master.grad = None if p.grad is None else p.grad.float()
                p.grad = None

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy the updated masters into the modules' weights (rounded; no-op unmixed)."""
        if not self.mixed:
            return
        for s, params in self._model.items():
            for p, master in zip(params, self.params[s]):
                local_shard(p).copy_(local_shard(master))


def accumulate_in_float32(params: list[torch.Tensor]) -> None:
    """Make autograd accumulate these (bfloat16) parameters' gradients in float32 (Note:
    [mixed precision])."""
    if not _HAS_GRAD_DTYPE:
        raise ConfigError(f"--dtype bf16 accumulates gradients in float32 with Tensor.grad_dtype, "
                          f"which torch {torch.__version__} lacks; use torch >= 2.10 or --dtype "
                          "fp32")
    for p in params:
        if p.grad is not None and p.grad.dtype != torch.float32:
            p.grad = p.grad.float()  # grad_dtype cannot be set over a gradient of another dtype
        p.grad_dtype = torch.float32
