"""Tensor parallelism for the reference transformer, with torch's DTensor styles.

Megatron's layout (Shoeybi et al. 2019) through ``torch.distributed.tensor.parallel``: in each
layer Q, K, V and the MLP's gate and up projections are column-parallel (each rank computes its
heads / its slice of the inner width), the attention output and MLP down projections are
row-parallel (partial sums all-reduced). The embedding is row-parallel over the vocabulary and
the head column-parallel over the vocabulary with its logits gathered, so the loss is the
plain one. Between those, the residual stream is a plain, replicated tensor [batch, seq, dim]:
norms run replicated, and what a stage sends to the next is a plain tensor, so the pipeline's
point-to-point path (runtime/p2p.py) sees ordinary tensors (each tensor-parallel rank talks to
the rank of the same tensor-parallel index in the next stage).

Sequence parallelism (norms over a sequence shard) is not applied: it would shard the norm
inputs too, but the residual stream would then be a sequence shard and every stage boundary a
shard; docs/training.md says what this costs in saved bytes.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pipeoffload.app.model import ModelConfig, Transformer
from pipeoffload.errors import ConfigError


def check_tensor_parallel(config: ModelConfig, tp: int) -> None:
    """Raise ConfigError unless the model's heads, widths and vocabulary split over ``tp``."""
    if tp < 1:
        raise ConfigError(f"--tp must be >= 1, got {tp}")
    for name in ("n_heads", "n_kv_heads", "ffn_hidden", "vocab_size"):
        value = getattr(config, name)
        if value % tp:
            flag = {"n_heads": "--heads", "n_kv_heads": "--kv-heads",
                    "ffn_hidden": "--ffn-hidden"}.get(name, "the vocabulary")
            raise ConfigError(f"tensor parallelism over tp={tp} splits {name}={value} (from "
                              f"{flag}) evenly; choose a multiple of {tp} or a tp that divides "
                              "it")


def apply_tensor_parallel(module: Transformer, mesh: Any) -> Transformer:
    """Shard ``module``'s weights over the 1-D device mesh ``mesh`` (in place; returns it)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    check_tensor_parallel(module.config, mesh.size())
    plan: dict[str, Any] = {}
    if module.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate())
    if module.output is not None:
        plan["output"] = ColwiseParallel(output_layouts=Replicate())
    for name in module.layers:
        layer = f"layers.{name}"
        for proj in ("attention.wq", "attention.wk", "attention.wv",
                     "feed_forward.w1", "feed_forward.w3"):
            plan[f"{layer}.{proj}"] = ColwiseParallel()
        for proj in ("attention.wo", "feed_forward.w2"):
            plan[f"{layer}.{proj}"] = RowwiseParallel()
    parallelize_module(module, mesh, plan)
    return module


def sharded_parameters(module: nn.Module) -> list[str]:
    """Names of ``module``'s parameters that are DTensors (sharded or replicated by a style)."""
    from pipeoffload.runtime.shards import is_dtensor

    return [name for name, p in module.named_parameters() if is_dtensor(p)]
