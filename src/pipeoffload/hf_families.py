"""What pipeoffload knows about Hugging Face causal-LM families, as plain data read from a
``config.json`` (no torch, no transformers), so that the planner's printed command, the
checks `pipeoffload train` runs before starting any process, and the integration agree.

- SUPPORTED_MODEL_TYPES: ``model_type`` values ``pipeoffload.hf.split_causal_lm`` splits.
- TENSOR_PARALLEL_MODEL_TYPES: families whose decoder layers `train --tp` shards: every one
  of SUPPORTED_MODEL_TYPES (GPT-2's fused Q / K / V ``Conv1D`` is regrouped by rank before it is
  split, training/hf_tensor_parallel.py, Note [GPT-2 fused QKV]).
- RECOMPUTE_MODES: what `train --recompute` does for these models: ``full`` re-runs each
  decoder layer in the backward; ``lgd`` (norm and activation-function outputs only) needs the
  reference model's layer structure and is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeoffload.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
TENSOR_PARALLEL_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
#: families `train --cp` runs: rotary positions per token (GPT-2 learns absolute ones and its
#: fused attention is not replaced; parallel/context.py)
CONTEXT_PARALLEL_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
RECOMPUTE_MODES = ("none", "full")
#: config.json keys of dropout probabilities (Llama family, GPT-2).
DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop")


def value(config: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    """The first of ``keys`` present (not None) in ``config`` (HF and GPT-2 spell sizes
    differently: ``num_attention_heads`` / ``n_head``)."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def sizes(config: Mapping[str, Any]) -> dict[str, int]:
    """The sizes that parallelism and data must fit, in both spellings' meaning."""
    heads = value(config, "num_attention_heads", "n_head", default=0)
    hidden = value(config, "hidden_size", "n_embd", default=0)
    return {
        "vocab_size": value(config, "vocab_size", default=0),
        "layers": value(config, "num_hidden_layers", "n_layer", default=0),
        "heads": heads,
        "kv_heads": value(config, "num_key_value_heads", default=heads),
        "ffn_hidden": value(config, "intermediate_size", "n_inner", default=4 * hidden),
        "positions": value(config, "max_position_embeddings", "n_positions", default=0),
    }


def dropout(config: Mapping[str, Any]) -> dict[str, float]:
    """The non-zero dropout probabilities the config sets."""
    return {k: config[k] for k in DROPOUT_KEYS
            if isinstance(config.get(k), (int, float)) and config[k] > 0}


def check_family(config: Mapping[str, Any], where: str) -> str:
    """The config's ``model_type``, or ConfigError when split_causal_lm does not know it."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{where}: model_type {model_type!r} is not one pipeoffload splits into pipeline "
            f"stages (it knows {', '.join(SUPPORTED_MODEL_TYPES)}); write the stage modules "
            "yourself (docs/runtime.md, stage contract) or use one of those families")
    return model_type


def check_parallel(config: Mapping[str, Any], where: str, *, tp: int, recompute: str) -> None:
    """Refuse, before any process starts, a tensor-parallel degree or recompute mode that
    `train` cannot run for this model (see the module docstring)."""
    model_type = check_family(config, where)
    if recompute not in RECOMPUTE_MODES:
        raise ConfigError(
            f"--recompute {recompute}: for a Hugging Face model train recomputes whole decoder "
            f"layers (--recompute full) or nothing (none); lgd needs the reference model's "
            "layer structure")
    if recompute != "none" and dropout(config):
        raise ConfigError(
            f"--recompute {recompute}: {where} sets dropout {dropout(config)}, and a recomputed "
            "layer would draw other dropout masks than its forward did; set them to 0 in "
            "config.json or drop --recompute")
    if tp == 1:
        return
    if model_type not in TENSOR_PARALLEL_MODEL_TYPES:
        raise ConfigError(
            f"--tp {tp}: train does not shard {model_type} models over tensor-parallel ranks; "
            f"use --tp 1, or a family of {', '.join(TENSOR_PARALLEL_MODEL_TYPES)}")
    found = sizes(config)
    for name in ("heads", "kv_heads", "ffn_hidden"):
        if found[name] % tp:
            raise ConfigError(f"--tp {tp}: tensor parallelism must split {name}={found[name]} "
                              f"of {where} evenly; choose a --tp that divides it")
