"""Splitting a batch into the schedule's microbatches, and checking it before any compute."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeoffload.errors import ConfigError

TensorTuple = tuple[torch.Tensor, ...]


def as_tuple(value: torch.Tensor | Sequence[torch.Tensor] | None, what: str) -> TensorTuple:
    """Normalise a tensor or a sequence of tensors (None -> empty) and reject anything else."""
    if value is None:
        return ()
    items = (value,) if isinstance(value, torch.Tensor) else tuple(value)
    for index, item in enumerate(items):
        if not isinstance(item, torch.Tensor):
            raise ConfigError(
                f"{what}[{index}] is a {type(item).__name__}; pass tensors (or a tuple of tensors)"
            )
    return items


def split(batch: TensorTuple, microbatches: int, what: str,
          device: torch.device | None = None) -> list[TensorTuple]:
    """Split every tensor of ``batch`` along dim 0 into ``microbatches`` equal parts on ``device``.

    Each part is a contiguous copy with its own storage, so that what a (stage, microbatch) saves
    is its own memory (the meter and the simulator count it per microbatch).
    """
    if not batch:
        return [() for _ in range(microbatches)]
    for index, tensor in enumerate(batch):
        if tensor.dim() == 0:
            raise ConfigError(f"{what}[{index}] is a scalar (0-d tensor); it needs a batch "
                              f"dimension (dim 0) to split into {microbatches} microbatches")
        if tensor.is_meta:
            raise ConfigError(f"{what}[{index}] is on the meta device (a shape without data); "
                              "pass tensors with data, on the CPU or the stages' device")
        size = tensor.shape[0]
        if size == 0:
            raise ConfigError(
                f"{what}[{index}] is an empty batch (dim 0 has size 0), whose loss would be nan; "
                f"pass at least {microbatches} rows, one per microbatch")
        if size % microbatches:
            raise ConfigError(
                f"{what}[{index}] has batch size {size} (dim 0), which the schedule's "
                f"{microbatches} microbatches do not divide; use a batch size that is a multiple "
                f"of {microbatches}"
            )
    parts = [tensor.to(device).chunk(microbatches, dim=0) for tensor in batch]
    return [tuple(p[m].clone() for p in parts) for m in range(microbatches)]


def signature(batch: TensorTuple) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """Shape and dtype of each tensor, what a later step must repeat."""
    return tuple((tuple(t.shape), t.dtype) for t in batch)


def check_same(
    expected: tuple[tuple[tuple[int, ...], torch.dtype], ...],
    got: TensorTuple,
    what: str,
) -> None:
    """Raise ConfigError if ``got`` differs from the shapes and dtypes learnt earlier."""
    actual = signature(got)
    if actual == expected:
        return
    raise ConfigError(
        f"{what} has shapes/dtypes {_fmt(actual)}, but this Pipeline was set up for "
        f"{_fmt(expected)} (learnt on the first step or given as example); the P2P buffers and "
        "the other ranks expect those shapes. Pass a batch of that shape, or build a new Pipeline"
    )


def _fmt(sig: tuple[tuple[tuple[int, ...], torch.dtype], ...]) -> str:
    return "(" + ", ".join(f"{list(shape)} {str(dtype).removeprefix('torch.')}"
                           for shape, dtype in sig) + ")"
