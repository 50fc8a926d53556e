"""Tensor parallelism for Hugging Face decoder layers (Llama, Mistral, Qwen2, Qwen3), with
torch's DTensor styles: Megatron's layout without sequence parallelism, the plan Hugging Face
ships as ``base_model_tp_plan`` for these families.

- Q, K, V and the MLP's gate and up projections are column-parallel (each rank its heads, its
  slice of the inner width; Hugging Face's attention counts heads from the projection's width);
  the attention output and MLP down projections are row-parallel, their partial sums
  all-reduced, so the residual stream between layers and between stages is the whole hidden
  state on every tensor-parallel rank (pipeline messages are ordinary tensors);
- norms, the embedding and the head are replicated: each rank holds and computes them whole,
  which keeps tied embeddings one ordinary parameter (Note: [tied parameters]) at the cost of
  vocabulary-sized memory and head compute not divided by tp (the reference model shards
  them, training/tensor_parallel.py).

HF_TENSOR_PARALLEL is the one table both the sharding and the consolidation of checkpoint
shards (parallel/export.py) read.
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn

#: Module suffix -> "colwise" (output features split: weight and bias dim 0) or "rowwise"
#: (input features split: weight dim 1; bias whole).
HF_TENSOR_PARALLEL = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def shard_dim(param_name: str) -> int | None:
    """The dimension a parameter is split along across tensor-parallel ranks (None: whole)."""
    module, _, kind = param_name.rpartition(".")
    for suffix, style in HF_TENSOR_PARALLEL.items():
        if module == suffix or module.endswith("." + suffix):
            if style == "colwise":
                return 0
            return 1 if kind == "weight" else None
    return None


def apply_hf_tensor_parallel(stage: nn.Module, mesh: Any) -> nn.Module:
    """Shard ``stage``'s decoder layers over the 1-D device mesh ``mesh`` (in place)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    layers = len(cast(nn.ModuleList, stage.layers))
    plan = {f"layers.{i}.{suffix}": styles[style]()
            for i in range(layers) for suffix, style in HF_TENSOR_PARALLEL.items()}
    parallelize_module(stage, mesh, plan)
    return stage
