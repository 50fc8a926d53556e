"""Checks of the Python API's arguments (``pipeoffload.distributed``, ``pipeoffload.hf``): a
wrong value is a ValueError, a wrong kind of thing a TypeError, each naming the argument and
what it got, before anything is written or a collective is entered."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def positive_number(name: str, value: Any, *, infinite: bool = False) -> float:
    """``value`` as a float if it is a number > 0 (not a bool), finite unless ``infinite``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    if math.isnan(value) or value <= 0 or (math.isinf(value) and not infinite):
        kind = "a number > 0 (inf: measure only)" if infinite else "a finite number > 0"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return float(value)


def step_number(name: str, value: Any) -> int:
    """``value`` if it is a whole number >= 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a whole number, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def stage_modules(name: str, stages: Any) -> Mapping[int, nn.Module]:
    """``stages`` if it is a mapping {stage index: nn.Module}."""
    if not isinstance(stages, Mapping):
        raise TypeError(f"{name} must be a dict {{stage index: nn.Module}}, got "
                        f"{type(stages).__name__}")
    for index, module in stages.items():
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise TypeError(f"{name} keys must be stage indices (whole numbers >= 0), got "
                            f"{index!r}")
        if not isinstance(module, nn.Module):
            raise TypeError(f"{name}[{index}] must be an nn.Module, got "
                            f"{type(module).__name__}")
    return stages


def stage_optimizers(name: str, optimizers: Any, stages: Mapping[int, nn.Module]
                     ) -> Mapping[int, torch.optim.Optimizer]:
    """``optimizers`` if it maps every stage of ``stages`` to a torch optimizer."""
    if not isinstance(optimizers, Mapping):
        raise TypeError(f"{name} must be a dict {{stage index: torch.optim.Optimizer}} (or "
                        f"pipeoffload.zero_optimizer's), got {type(optimizers).__name__}")
    missing = sorted(set(stages) - set(optimizers))
    if missing:
        raise ValueError(f"{name} has no optimizer for stage(s) {missing}; give one per stage "
                         f"of stages ({sorted(stages)})")
    for index in stages:
        if not isinstance(optimizers[index], torch.optim.Optimizer):
            raise TypeError(f"{name}[{index}] must be a torch.optim.Optimizer, got "
                            f"{type(optimizers[index]).__name__}")
    return optimizers


def float_dtype(name: str, dtype: Any) -> torch.dtype:
    """``dtype`` if it is a floating-point torch dtype (weights are exported as floats)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {type(dtype).__name__} {dtype!r}")
    if not dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating-point dtype (torch.float32, "
                         f"torch.bfloat16, ...), got {dtype}")
    return dtype
