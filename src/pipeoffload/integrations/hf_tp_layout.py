"""How a Hugging Face decoder layer's parameters are split across tensor-parallel ranks, and put
back whole: the one table that sharding (training/hf_tensor_parallel.py), checkpoint shards and
exports (parallel/export.py, ``pipeoffload export``) read.

Note [GPT-2 fused QKV]: GPT-2's ``c_attn`` is one ``Conv1D`` (weight ``[in, out]``, the
transpose of a Linear's) whose output columns are all of Q, then all of K, then all of V; a
plain column split would give rank 0 all of Q and part of K. Before sharding, its columns (and
bias) are regrouped so that rank r's contiguous slice is [Q of r's heads | K of r's heads | V of
r's heads] (``group_fused_qkv``), and the attention splits its local output in three of width
h / tp: each rank runs its own heads, as a Llama rank does. A checkpoint shard holds the
regrouped slice; an export joins the shards and restores Hugging Face's order
(``join_shards``, ``hf_order``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

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


def entry(module: str) -> tuple[str, tuple[str, str]] | None:
    for suffix, entry in HF_TENSOR_PARALLEL.items():
        if module == suffix or module.endswith("." + suffix):
            return suffix, entry
    return None


def shard_dim(param_name: str) -> int | None:
    """The dimension a parameter is split along across tensor-parallel ranks (None: whole)."""
    module, _, kind = param_name.rpartition(".")
    found = entry(module)
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
