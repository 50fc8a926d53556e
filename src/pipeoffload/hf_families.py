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

import math
from collections.abc import Mapping
from typing import Any

from pipeoffload.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
TENSOR_PARALLEL_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
#: families `train --cp` runs: rotary positions per token (GPT-2 learns absolute ones and its
#: fused attention is not replaced; parallel/context.py)
CONTEXT_PARALLEL_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
RECOMPUTE_MODES = ("none", "full")
#: Families whose modules the runtime tags by tensor class (runtime/classes.py), so train's
#: ``--offload classes:A+B`` runs them.
CLASS_MODEL_TYPES = ("llama",)
#: config.json keys of dropout probabilities (Llama family, GPT-2).
DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop")
#: config.json keys that are sizes: whole numbers >= 1 where present (GPT-2's n_inner may be null).
SIZE_KEYS = ("vocab_size", "num_hidden_layers", "n_layer", "hidden_size", "n_embd",
             "num_attention_heads", "n_head", "num_key_value_heads", "intermediate_size",
             "n_inner", "max_position_embeddings", "n_positions", "head_dim")
#: config.json keys that are finite non-negative numbers where present.
NUMBER_KEYS = ("rope_theta", "rms_norm_eps", "layer_norm_epsilon", "initializer_range",
               *DROPOUT_KEYS)
#: RoPE scaling types transformers 5 builds (modeling_rope_utils.ROPE_INIT_FUNCTIONS, and
#: "default"); another one fails inside transformers with a bare KeyError.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional")
#: Larger than any released model (about 130 layers); building the model's skeleton takes
#: about 0.2 ms per layer, so 10^6 layers took minutes before any check (issue 40).
MAX_LAYERS = 4096


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


def check_values(config: Mapping[str, Any], where: str) -> None:
    """Refuse a config.json value of the wrong type, naming the file and the key: sizes are
    whole numbers >= 1 (a float or a string fails deep inside transformers), rates and epsilons
    finite numbers, RoPE scaling a table of a type transformers builds, activations names."""
    for key in SIZE_KEYS:
        found = config.get(key)
        if found is None:
            continue
        if isinstance(found, bool) or not isinstance(found, int) or found < 1:
            raise ConfigError(f"{where}: {key} is {found!r}; it must be a whole number >= 1")
    layers = value(config, "num_hidden_layers", "n_layer", default=0)
    if layers > MAX_LAYERS:
        raise ConfigError(f"{where}: {layers} decoder layers, more than train builds "
                          f"({MAX_LAYERS}; the largest released models have about 130)")
    for key in NUMBER_KEYS:
        found = config.get(key)
        if found is not None and (isinstance(found, bool) or not isinstance(found, (int, float))
                                  or not math.isfinite(found) or found < 0):
            raise ConfigError(f"{where}: {key} is {found!r}; it must be a finite number >= 0")
    for key in ("hidden_act", "activation_function"):
        if config.get(key) is not None and not isinstance(config[key], str):
            raise ConfigError(f"{where}: {key} is {config[key]!r}; it must be an activation's "
                              "name, e.g. \"silu\"")
    for key in ("rope_scaling", "rope_parameters"):
        _check_rope(config.get(key), f"{where}: {key}")


def _check_rope(rope: Any, where: str) -> None:
    if rope is None:
        return
    if not isinstance(rope, dict):
        raise ConfigError(f"{where} is {rope!r}; it must be a table (or null)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{where}: rope_type {kind!r} is not one transformers builds "
                          f"({', '.join(ROPE_TYPES)})")
    for key, found in rope.items():
        if key in ("rope_type", "type") or found is None or isinstance(found, list):
            continue
        if isinstance(found, bool) or not isinstance(found, (int, float)) or not math.isfinite(
                found):
            raise ConfigError(f"{where}: {key} is {found!r}; it must be a finite number")


def parameter_estimate(config: Mapping[str, Any]) -> int:
    """About how many parameters the config makes (embeddings, attention and MLP matrices;
    norms and biases left out): what a size check compares with the memory a run has."""
    found = sizes(config)
    hidden = value(config, "hidden_size", "n_embd", default=0)
    heads = found["heads"] or 1
    head_dim = value(config, "head_dim", default=hidden // heads)
    attention = hidden * head_dim * (2 * heads + 2 * found["kv_heads"])
    mlp = (2 if config.get("model_type") == "gpt2" else 3) * hidden * (found["ffn_hidden"] or 0)
    tied = config.get("tie_word_embeddings", config.get("model_type") == "gpt2")
    embeddings = found["vocab_size"] * hidden * (1 if tied else 2)
    return int(embeddings + found["layers"] * (attention + mlp))


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
