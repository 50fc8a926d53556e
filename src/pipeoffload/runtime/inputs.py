"""What a stage module is called with: stage 0's keyword inputs and per-stage constants.

Note: [stage contract] every stage is called ``module(*received, **constants)``: the tensors the
previous stage returned (stage 0: the microbatch of ``inputs``, as positional tensors, or as
keyword arguments when ``inputs`` is a dict) plus ``stage_kwargs[s]``, passed unchanged to every
microbatch. A stage returns a tensor or a tuple of tensors; non-floating tensors (a padding mask,
position ids) travel on to the next stage and get no gradient. The last stage's output goes to
``loss_fn(output, *target)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from pipeoffload.errors import ConfigError


class StageCall(nn.Module):
    """Calls ``module`` per the stage contract: positional tensors are renamed to ``names``
    (stage 0 with dict inputs) and ``constants`` are added as keyword arguments."""

    def __init__(self, module: nn.Module, constants: Mapping[str, Any]) -> None:
        super().__init__()
        self.module = module
        self.constants = dict(constants)
        self.names: tuple[str, ...] | None = None  # set per step from the dict's keys

    def forward(self, *tensors: torch.Tensor) -> Any:
        if self.names is None:
            return self.module(*tensors, **self.constants)
        return self.module(**dict(zip(self.names, tensors)), **self.constants)


def wrap_stages(stages: Mapping[int, nn.Module], stage_kwargs: Mapping[int, Mapping[str, Any]],
                num_stages: int, is_first: Callable[[int], bool]) -> dict[int, nn.Module]:
    """First stages (which may get dict inputs; stage 0, or each route's first with DualPipe)
    and stages with constants, wrapped in StageCall."""
    unknown = sorted(set(stage_kwargs) - set(range(num_stages)))
    if unknown:
        raise ConfigError(f"stage_kwargs names stages {unknown}, but the schedule has stages "
                          f"0..{num_stages - 1}")
    wrapped = {}
    for s, module in stages.items():
        if is_first(s) or s in stage_kwargs:
            for key in stage_kwargs.get(s, {}):
                if not isinstance(key, str):
                    raise ConfigError(f"stage_kwargs[{s}] has key {key!r}; keys are the "
                                      "keyword names of the stage's forward")
            module = StageCall(module, stage_kwargs.get(s, {}))
        wrapped[s] = module
    return wrapped


def check_form(value: object, what: str) -> None:
    """Refuse what is neither None, a tensor, a sequence of tensors nor (inputs only) a dict,
    before anything iterates it (a str or an int would fail with a misleading message)."""
    if value is None or isinstance(value, torch.Tensor):
        return
    if isinstance(value, Mapping) and what == "inputs":
        return
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return
    kinds = "a tensor, a tuple of tensors" + (" or a dict of tensors" if what == "inputs" else "")
    raise ConfigError(f"{what} is a {type(value).__name__}; pass {kinds} (batch in dim 0)")


def positional(inputs: object
               ) -> tuple[tuple[str, ...] | None, torch.Tensor | Sequence[torch.Tensor] | None]:
    """``(names, tensors)``: a dict becomes its keys and its values in that order; anything else
    passes through unchanged (its items are checked by microbatch.as_tuple)."""
    check_form(inputs, "inputs")
    if not isinstance(inputs, Mapping):
        # check_form let only None, a tensor or a sequence (of tensors, as_tuple checks) by.
        return None, cast("torch.Tensor | Sequence[torch.Tensor] | None", inputs)
    names, values = [], []
    for name, value in inputs.items():
        if not isinstance(name, str):
            raise ConfigError(f"inputs has key {name!r}; a dict of inputs maps stage 0's keyword "
                              "argument names to tensors")
        if not isinstance(value, torch.Tensor):
            raise ConfigError(
                f"inputs[{name!r}] is a {type(value).__name__}; every value of a dict of inputs "
                "is a tensor with the batch in dim 0 (it is split into microbatches). Pass "
                "constants through Pipeline(stage_kwargs={0: {...}})")
        names.append(name)
        values.append(value)
    if not names:
        raise ConfigError("inputs is an empty dict; pass stage 0's tensors")
    return tuple(names), tuple(values)


def document_segments(ids: torch.Tensor, eos: int) -> torch.Tensor:
    """[batch, seq] int64: per token, the end-of-document ids before it in its row, so a
    document's tokens (its closing ``eos`` included) share one number (``--document-mask``)."""
    ends = (ids == eos).to(torch.int64)
    return torch.cumsum(ends, dim=1) - ends


def document_positions(segments: torch.Tensor) -> torch.Tensor:
    """[batch, seq] int64: each token's position within its document (0 at a document's first
    token in the row), from ``document_segments``."""
    seq = segments.shape[1]
    index = torch.arange(seq, device=segments.device).expand_as(segments)
    first = torch.ones_like(segments, dtype=torch.bool)
    first[:, 1:] = segments[:, 1:] != segments[:, :-1]
    start = torch.cummax(torch.where(first, index, torch.zeros_like(index)), dim=1).values
    return index - start
