"""Cut the reference transformer into pipeline stages, or build it whole.

Stage s of ``num_stages`` holds a contiguous run of layers; stage 0 also holds the token
embedding and the last stage the final norm and head. Every stage is a ``Transformer`` whose
parameter names are the full model's, and weights are initialised per component from the
seed, so the stages' parameters together equal ``build_full_model``'s, whatever the split.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pipeoffload.errors import ConfigError
from pipeoffload.training.model import ModelConfig, Transformer, lm_loss

__all__ = [
    "build_full_model",
    "build_stage_modules",
    "layers_per_stage",
    "lm_loss",
    "stage_layer_ranges",
    "stage_param_names",
]


def layers_per_stage(
    n_layers: int, num_stages: int, *, lighter_ends: bool = False
) -> tuple[int, ...]:
    """How many transformer layers each stage holds, balanced to within one layer.

    With ``lighter_ends`` the embedding and the head each count as one layer, so the first and
    last stages hold one layer fewer than the others would. The remainder of the division goes
    to the middle stages first, then the last stage, then stage 0: the end stages carry the
    embedding and head, and stage 0 keeps the most microbatches in flight in 1F1B-like
    schedules. Raises ConfigError when some stage would get no layer.
    """
    if num_stages < 1:
        raise ConfigError(f"num_stages must be >= 1, got {num_stages}")
    if lighter_ends and num_stages == 1:
        raise ConfigError(
            "lighter_ends has no effect with one stage (it holds embedding and head alike); "
            "drop the option or use more stages"
        )
    units = n_layers + (2 if lighter_ends else 0)
    base, extra = divmod(units, num_stages)
    counts = [base] * num_stages
    for s in [*range(1, num_stages - 1), num_stages - 1, 0][:extra]:
        counts[s] += 1
    if lighter_ends:
        counts[0] -= 1
        counts[-1] -= 1
    if min(counts) < 1 and lighter_ends:
        plain = " or drop lighter_ends" if n_layers >= num_stages else ""
        raise ConfigError(
            f"cannot split {n_layers} layers into {num_stages} stages with lighter_ends: "
            f"layers per stage would be {counts}, and each stage needs at least one "
            f"({2 * num_stages - 2} layers in all); use fewer stages{plain}"
        )
    if min(counts) < 1:
        raise ConfigError(
            f"cannot split {n_layers} layers into {num_stages} stages: each stage needs at "
            f"least one layer; use at most {n_layers} stages or a model with more layers"
        )
    return tuple(counts)


def stage_layer_ranges(
    n_layers: int, num_stages: int, *, lighter_ends: bool = False
) -> tuple[range, ...]:
    """The global layer indices held by each stage, in order (see ``layers_per_stage``)."""
    ranges, start = [], 0
    for count in layers_per_stage(n_layers, num_stages, lighter_ends=lighter_ends):
        ranges.append(range(start, start + count))
        start += count
    return tuple(ranges)


def _finish(
    module: Transformer, seed: int, dtype: torch.dtype, device: torch.device | str | None
) -> Transformer:
    module.init_weights(seed)
    return module.to(device=device, dtype=dtype)


def build_stage_modules(
    config: ModelConfig,
    num_stages: int,
    stage_indices: Iterable[int],
    seed: int,
    *,
    lighter_ends: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> dict[int, nn.Module]:
    """The stage modules one rank holds, keyed by stage index, initialised from ``seed``.

    ``stage_indices`` is usually ``schedule.stages_on_rank(rank)``. Each module's forward takes
    one tensor and returns one: token ids [batch, seq] -> hidden [batch, seq, dim] for stage 0,
    hidden -> hidden in the middle, hidden -> logits [batch, seq, vocab] for the last stage.
    """
    stages = list(stage_indices)
    ranges = stage_layer_ranges(config.n_layers, num_stages, lighter_ends=lighter_ends)
    bad = [s for s in stages if not 0 <= s < num_stages]
    if bad:
        raise ConfigError(
            f"stage index {bad[0]} is out of range for num_stages={num_stages} "
            f"(valid: 0..{num_stages - 1})"
        )
    if len(set(stages)) != len(stages):
        raise ConfigError(f"stage_indices {stages} name a stage twice; list each stage once")
    return {
        s: _finish(
            Transformer(config, ranges[s], embedding=s == 0, head=s == num_stages - 1),
            seed, dtype, device,
        )
        for s in stages
    }


def build_full_model(
    config: ModelConfig,
    seed: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Transformer:
    """The unsplit model: token ids -> logits, with the same parameters as every split."""
    full = Transformer(config, range(config.n_layers), embedding=True, head=True)
    return _finish(full, seed, dtype, device)


def stage_param_names(module: nn.Module) -> dict[str, str]:
    """{name in this stage module: name in the full model} for every parameter.

    Stage modules use the full model's names as their own (layers are keyed by global
    index), so the map is the identity; callers use it instead of relying on that.
    """
    if not isinstance(module, Transformer):
        raise ConfigError(
            f"stage_param_names expects a module built by build_stage_modules, got "
            f"{type(module).__name__}"
        )
    return {name: name for name, _ in module.named_parameters()}
