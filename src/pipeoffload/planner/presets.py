"""Model presets and config.json loading.

Shapes and their sources (docs/planner-model.md, "Model presets", has the table):
- gpt3-*: Brown et al. 2020 ("Language Models are Few-Shot Learners", table 2.1): GeLU MLP with
  f = 4h, multi-head attention, vocabulary 50257, context 2048. 13B's hidden is 5120 (= 40 x 128;
  the table's 5140 is read as a typo, as Megatron and others do).
- pipeoffload-*: the PipeOffload paper's table 2 (layers, heads, hidden; GQA with 8 groups).
  f = 4h, GeLU and a 32000-token vocabulary are [derived]: with them the parameter counts
  (embedding counted once) come out at the paper's 5.8B .. 83.8B to 0.1B. Biases: GPT-3 has
  them (its paper follows GPT-2's layers); Llama has none; pipeoffload-* none [assumption].
- llama3-*: Llama 3 (Dubey et al. 2024, table 3) and the published config.json files.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from pipeoffload.checks import parse_json
from pipeoffload.errors import ConfigError
from pipeoffload.hf_families import SUPPORTED_MODEL_TYPES
from pipeoffload.planner.transformer import MlpKind, TransformerSpec


def _gpt3(name: str, layers: int, hidden: int, heads: int) -> TransformerSpec:
    return TransformerSpec(
        num_layers=layers, hidden=hidden, heads=heads, kv_heads=heads, ffn_hidden=4 * hidden,
        vocab=50257, seq_len=2048, mlp=MlpKind.GELU, dropout=True, bias=True, name=name,
    )


def _paper(name: str, layers: int, hidden: int, heads: int) -> TransformerSpec:
    return TransformerSpec(
        num_layers=layers, hidden=hidden, heads=heads, kv_heads=8, ffn_hidden=4 * hidden,
        vocab=32000, seq_len=8192, mlp=MlpKind.GELU, dropout=True, name=name,
    )


def _llama3(name: str, layers: int, hidden: int, heads: int, ffn: int) -> TransformerSpec:
    return TransformerSpec(
        num_layers=layers, hidden=hidden, heads=heads, kv_heads=8, ffn_hidden=ffn,
        vocab=128256, seq_len=8192, mlp=MlpKind.SWIGLU, dropout=False, name=name,
    )


_PRESETS: tuple[TransformerSpec, ...] = (
    _gpt3("gpt3-2.7b", 32, 2560, 32),
    _gpt3("gpt3-6.7b", 32, 4096, 32),
    _gpt3("gpt3-13b", 40, 5120, 40),
    _gpt3("gpt3-175b", 96, 12288, 96),
    _paper("pipeoffload-5.8b", 32, 4096, 32),
    _paper("pipeoffload-10.5b", 38, 5120, 40),
    _paper("pipeoffload-18.1b", 46, 6144, 48),
    _paper("pipeoffload-42.9b", 62, 8192, 64),
    _paper("pipeoffload-66.6b", 62, 10240, 80),
    _paper("pipeoffload-83.8b", 78, 10240, 80),
    _llama3("llama3-8b", 32, 4096, 32, 14336),
    _llama3("llama3-70b", 80, 8192, 64, 28672),
    _llama3("llama3-405b", 126, 16384, 128, 53248),
)


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "").replace("-", "").replace(" ", "")


def model_names() -> tuple[str, ...]:
    """Names ``model_preset`` accepts."""
    return tuple(spec.name for spec in _PRESETS)


def _replace(spec: TransformerSpec, overrides: dict[str, Any], where: str) -> TransformerSpec:
    fields = [f.name for f in dataclasses.fields(TransformerSpec)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where}: unknown model field(s) {', '.join(unknown)}; known: {', '.join(fields)}"
        )
    return dataclasses.replace(spec, **overrides) if overrides else spec


def model_preset(name: str, **overrides: Any) -> TransformerSpec:
    """The preset called ``name`` (case-insensitive, hyphens and underscores optional), with
    ``overrides`` of TransformerSpec fields (e.g. ``seq_len=4096``)."""
    by_key = {_key(spec.name): spec for spec in _PRESETS}
    spec = by_key.get(_key(name))
    if spec is None:
        raise ConfigError(
            f"unknown model {name!r}; known presets: {', '.join(model_names())} "
            f"(or a config.json path)"
        )
    return _replace(spec, overrides, f"model {spec.name!r}")


# Our own key, then the HuggingFace (Llama-style) and GPT-2-style keys that mean the same.
_SYNONYMS: dict[str, tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers", "n_layer"),
    "hidden": ("hidden_size", "n_embd"),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads",),
    "ffn_hidden": ("intermediate_size", "n_inner"),
    "vocab": ("vocab_size",),
    "seq_len": ("max_position_embeddings", "n_positions"),
}
_ACTIVATIONS = {
    "silu": MlpKind.SWIGLU, "swish": MlpKind.SWIGLU, "swiglu": MlpKind.SWIGLU,
    "gelu": MlpKind.GELU, "gelu_new": MlpKind.GELU, "gelu_fast": MlpKind.GELU,
    "gelu_pytorch_tanh": MlpKind.GELU, "gelu_python": MlpKind.GELU,
}
# transformers' default hidden_act / activation_function of the families train splits
_DEFAULT_ACTIVATIONS = {"llama": "silu", "mistral": "silu", "qwen2": "silu", "qwen3": "silu",
                        "gpt2": "gelu_new"}
_DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop")


def _lookup(data: dict[str, Any], field: str, source: str) -> Any:
    """The value of ``field`` under our key or a synonym; None when absent; an error when two
    keys disagree."""
    found = [(k, data[k]) for k in (field, *_SYNONYMS.get(field, ())) if data.get(k) is not None]
    if len({json.dumps(v) for _, v in found}) > 1:
        listed = ", ".join(f"{k}={v!r}" for k, v in found)
        raise ConfigError(f"{source}: {listed} disagree; keep one of them")
    return found[0][1] if found else None


def _mlp_kind(data: dict[str, Any], source: str) -> MlpKind | str:
    if data.get("mlp") is not None:
        return data["mlp"]
    act = data.get("hidden_act", data.get("activation_function"))
    if act is None:  # transformers' default for the family, as from_pretrained would use
        act = _DEFAULT_ACTIVATIONS.get(str(data.get("model_type")))
    if act is None:
        raise ConfigError(
            f"{source}: cannot tell the MLP kind; add \"mlp\": \"swiglu\" or \"gelu\" "
            f"(or HuggingFace's \"hidden_act\")"
        )
    if not isinstance(act, str) or act.lower() not in _ACTIVATIONS:
        raise ConfigError(
            f"{source}: unknown activation {act!r}; known: {', '.join(_ACTIVATIONS)}, "
            f"or set \"mlp\": \"swiglu\" / \"gelu\""
        )
    return _ACTIVATIONS[act.lower()]


def model_from_config(
    data: dict[str, Any], *, source: str = "<config>", **overrides: Any
) -> TransformerSpec:
    """A TransformerSpec from a config dictionary with our keys (TransformerSpec's field names)
    and/or HuggingFace / GPT-2 keys; ``overrides`` win over both (e.g. ``seq_len=8192`` when
    ``max_position_embeddings`` is the model's longest context, not the training one)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a JSON object of model fields")
    values: dict[str, Any] = {}
    for field in _SYNONYMS:
        value = _lookup(data, field, source)
        if value is not None:
            values[field] = value
    for field in ("flash_attention", "activation_bytes", "param_bytes", "dropout", "bias",
                  "tied_embeddings"):
        if data.get(field) is not None:
            values[field] = data[field]
    if "bias" not in values:
        # HuggingFace Llama-style configs say attention_bias / mlp_bias; GPT-2's layers have
        # biases and its config does not say
        flags = [data[k] for k in ("attention_bias", "mlp_bias") if data.get(k) is not None]
        values["bias"] = any(flags) if flags else "n_embd" in data
    values.update(overrides)
    if "mlp" not in values:
        values["mlp"] = _mlp_kind(data, source)
    if "ffn_hidden" not in values and "n_embd" in data and "hidden" in values:
        values["ffn_hidden"] = 4 * values["hidden"]  # GPT-2 writes n_inner = null for 4h
    if "kv_heads" not in values and "heads" in values:
        values["kv_heads"] = values["heads"]
    if "dropout" not in values:
        values["dropout"] = any(
            isinstance(data.get(k), (int, float)) and data[k] > 0 for k in _DROPOUT_KEYS
        )
    values.setdefault("name", data.get("name") or data.get("_name_or_path") or source)
    if isinstance(data.get("model_type"), str):
        values.setdefault("model_type", data["model_type"])
    missing = [f for f in _SYNONYMS if f not in values]
    if missing:
        wanted = "; ".join(f"{f} (or {' / '.join(_SYNONYMS[f])})" for f in missing)
        raise ConfigError(f"{source}: missing {wanted}")
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(TransformerSpec)})
    if unknown:
        raise ConfigError(f"{source}: unknown model field(s) {', '.join(unknown)}")
    for field, value in values.items():
        if isinstance(value, float) and value.is_integer():
            values[field] = int(value)
    try:
        return TransformerSpec(**values)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def load_model_config(path: str | Path, **overrides: Any) -> TransformerSpec:
    """``model_from_config`` on a JSON file (a HuggingFace config.json works as is); a config of
    a family `pipeoffload train --model` runs records the path it was read from (or
    ``train_model=`` its folder) as the spec's ``train_model``."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read model config {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"model config {path} is not UTF-8 text (byte {exc.start}: "
                          f"{exc.reason}); pass a config.json or a preset name") from None
    data = parse_json(text, str(path))
    train_model = overrides.pop("train_model", str(path))
    if isinstance(data, dict) and data.get("model_type") in SUPPORTED_MODEL_TYPES:
        overrides["train_model"] = train_model
    return model_from_config(data, source=str(path), **overrides)


def load_model(name_or_path: str, **overrides: Any) -> TransformerSpec:
    """A preset by name, a config file (a path ending in .json, or any existing file), or a
    folder holding a config.json (a Hugging Face model: `train --model FOLDER` loads its
    weights)."""
    path = Path(name_or_path)
    if path.is_dir() and (path / "config.json").is_file():
        return load_model_config(path / "config.json",
                                 **{"train_model": name_or_path, **overrides})
    if name_or_path.lower().endswith(".json") or path.is_file():
        return load_model_config(path, **overrides)
    return model_preset(name_or_path, **overrides)
