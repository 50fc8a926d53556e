"""Tensor parallelism for Hugging Face decoder layers (Llama, Mistral, Qwen2, Qwen3, GPT-2), with
torch's DTensor: Megatron's layout without sequence parallelism, the plan Hugging Face ships as
``base_model_tp_plan`` for the Llama families.

- Q, K, V and the MLP's gate and up projections (GPT-2: the fused ``c_attn`` and ``c_fc``) are
  column-parallel (each rank its heads, its slice of the inner width; Hugging Face's attention
  counts heads from the projection's width); the attention output and MLP down projections
  (GPT-2: both ``c_proj``) are row-parallel, their partial sums all-reduced, so the residual
  stream between layers and between stages is the whole hidden state on every tensor-parallel
  rank (pipeline messages are ordinary tensors);
- norms, the embedding and the head are replicated: each rank holds and computes them whole,
  which keeps tied embeddings one ordinary parameter (Note: [tied parameters]) at the cost of
  vocabulary-sized memory and head compute not divided by tp (the reference model shards
  them, training/tensor_parallel.py).

The split itself (which parameters, along which dimension, GPT-2's fused QKV regrouped by
rank: Note [GPT-2 fused QKV]) is integrations/hf_tp_layout.py's table, which checkpoint
consolidation and exports read too. torch's Colwise/RowwiseParallel take Linear and Embedding
modules only, so GPT-2's Conv1D layers are distributed with ``distribute_module`` and the same
input and output layouts.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from pipeoffload.integrations.hf_tp_layout import FUSED_QKV, entry, group_fused_qkv


def apply_hf_tensor_parallel(stage: nn.Module, mesh: Any) -> nn.Module:
    """Shard ``stage``'s decoder layers over the 1-D device mesh ``mesh`` (in place)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {}
    layers = cast(nn.ModuleList, stage.layers)
    for i, layer in enumerate(layers):
        for name, module in layer.named_modules():
            found = entry(name)
            if found is None:
                continue
            style, layout = found[1]
            if layout == "linear":
                plan[f"layers.{i}.{name}"] = styles[style]()
            else:
                _shard_conv1d(layer, name, module, style, mesh)
    if plan:
        parallelize_module(stage, mesh, plan)
    return stage


def _shard_conv1d(layer: nn.Module, name: str, module: nn.Module, style: str,
                  mesh: Any) -> None:
    """One GPT-2 Conv1D as a column- or row-parallel layer (Note [GPT-2 fused QKV])."""
    from torch.distributed.tensor import (
        DTensor,
        Replicate,
        Shard,
        distribute_module,
        distribute_tensor,
    )

    tp = mesh.size()
    if name == FUSED_QKV or name.endswith("." + FUSED_QKV):
        weight, bias = cast(torch.Tensor, module.weight), cast(torch.Tensor, module.bias)
        with torch.no_grad():
            weight.copy_(group_fused_qkv(weight, tp, 1).clone())
            bias.copy_(group_fused_qkv(bias, tp, 0).clone())
        attention: Any = layer.get_submodule(name.rpartition(".")[0])
        attention.split_size = attention.split_size // tp  # q, k, v of this rank's heads
    colwise = style == "colwise"

    def partition(_: str, mod: nn.Module, device_mesh: Any) -> None:
        placements = {"weight": [Shard(1)] if colwise else [Shard(0)],
                      "bias": [Shard(0)] if colwise else [Replicate()]}
        for key, placement in placements.items():
            tensor = cast(torch.Tensor, getattr(mod, key))
            mod.register_parameter(key, nn.Parameter(
                distribute_tensor(tensor, device_mesh, placement)))

    def inputs(_: nn.Module, args: tuple[Any, ...], device_mesh: Any) -> tuple[Any, ...]:
        x = args[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, [Replicate()] if colwise else [Shard(-1)],
                                   run_check=False)
        return (x, *args[1:])

    def outputs(_: nn.Module, out: Any, device_mesh: Any) -> Any:
        if not colwise:  # partial sums of the rows: all-reduced, whole on every rank
            out = out.redistribute(device_mesh, [Replicate()])
        return out.to_local()

    distribute_module(module, mesh, partition, cast(Any, inputs), cast(Any, outputs))
