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

Note [GPT-2 fused QKV]: GPT-2's ``c_attn`` is one ``Conv1D`` (weight ``[in, out]``, the
transpose of a Linear's) whose output columns are all of Q, then all of K, then all of V; a
plain column split would give rank 0 all of Q and part of K. Before sharding, its columns (and
bias) are regrouped so that rank r's contiguous slice is [Q of r's heads | K of r's heads | V of
r's heads] (``group_fused_qkv``), and the attention splits its local output in three of width
h / tp (``split_size``): each rank runs its own heads, as a Llama rank does. A checkpoint shard
holds the regrouped slice; export joins the shards and restores Hugging Face's order
(``join_shards``). torch's Colwise/RowwiseParallel take Linear and Embedding modules only, so
Conv1D layers are distributed with ``distribute_module`` and the same input and output layouts.

HF_TENSOR_PARALLEL is the one table both the sharding and the consolidation of checkpoint
shards (training/export.py) read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

#: Module suffix -> (style, layout): "colwise" splits output features, "rowwise" input
#: features; "linear" weights are [out, in] (nn.Linear), "conv1d" [in, out] (GPT-2's Conv1D).
#: A rowwise bias is whole; a colwise bias is split with the output features.
HF_TENSOR_PARALLEL = {
    "self_attn.q_proj": ("colwise", "linear"),
    "self_attn.k_proj": ("colwise", "linear"),
    "self_attn.v_proj": ("colwise", "linear"),
    "self_attn.o_proj": ("rowwise", "linear"),
    "mlp.gate_proj": ("colwise", "linear"),
    "mlp.up_proj": ("colwise", "linear"),
    "mlp.down_proj": ("rowwise", "linear"),
    "attn.c_attn": ("colwise", "conv1d"),  # Note [GPT-2 fused QKV]
    "attn.c_proj": ("rowwise", "conv1d"),
    "mlp.c_fc": ("colwise", "conv1d"),
    "mlp.c_proj": ("rowwise", "conv1d"),
}
#: The fused projection whose columns are regrouped by rank (Note [GPT-2 fused QKV]).
FUSED_QKV = "attn.c_attn"


def _entry(module: str) -> tuple[str, tuple[str, str]] | None:
    for suffix, entry in HF_TENSOR_PARALLEL.items():
        if module == suffix or module.endswith("." + suffix):
            return suffix, entry
    return None


def shard_dim(param_name: str) -> int | None:
    """The dimension a parameter is split along across tensor-parallel ranks (None: whole)."""
    module, _, kind = param_name.rpartition(".")
    found = _entry(module)
    if found is None:
        return None
    style, layout = found[1]
    out_dim, in_dim = (0, 1) if layout == "linear" else (1, 0)
    if kind == "bias":
        return 0 if style == "colwise" else None
    return out_dim if style == "colwise" else in_dim


def group_fused_qkv(tensor: torch.Tensor, tp: int, dim: int) -> torch.Tensor:
    """``tensor``'s [Q | K | V] along ``dim`` regrouped as [Q_0 K_0 V_0 | Q_1 K_1 V_1 | ...]
    for ``tp`` ranks (Note [GPT-2 fused QKV])."""
    shape = tensor.shape
    width = shape[dim] // (3 * tp)
    parts = tensor.reshape(*shape[:dim], 3, tp, width, *shape[dim + 1:])
    return parts.transpose(dim, dim + 1).reshape(shape)


def ungroup_fused_qkv(tensor: torch.Tensor, tp: int, dim: int) -> torch.Tensor:
    """The inverse of ``group_fused_qkv``: Hugging Face's [Q | K | V] order."""
    shape = tensor.shape
    width = shape[dim] // (3 * tp)
    parts = tensor.reshape(*shape[:dim], tp, 3, width, *shape[dim + 1:])
    return parts.transpose(dim, dim + 1).reshape(shape)


def hf_order(param_name: str, whole: torch.Tensor, tp: int) -> torch.Tensor:
    """A whole parameter gathered from ``tp`` shards (their concatenation in rank order) in
    Hugging Face's layout: the fused QKV's columns ungrouped (Note [GPT-2 fused QKV])."""
    module = param_name.rpartition(".")[0]
    dim = shard_dim(param_name)
    if tp > 1 and dim is not None and (module == FUSED_QKV or module.endswith("." + FUSED_QKV)):
        return ungroup_fused_qkv(whole, tp, dim)
    return whole


def join_shards(param_name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The whole parameter from its tensor-parallel shards (rank order), in Hugging Face's
    layout."""
    dim = shard_dim(param_name) if len(shards) > 1 else None
    if dim is None:
        return shards[0]
    return hf_order(param_name, torch.cat(list(shards), dim), len(shards))


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
            found = _entry(name)
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
