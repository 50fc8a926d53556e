"""The tokenizer files of a Hugging Face export, so that ``AutoTokenizer.from_pretrained(export)``
encodes as training did and generation knows where text begins, ends and pads.

Given the tokenizer.json training used: ``tokenizer_config.json`` and ``special_tokens_map.json``
found beside it are copied as given; missing ones are generated: the class is
``PreTrainedTokenizerFast`` (it reads tokenizer.json itself, so the ids are training's; without
it transformers picks a class by the model type, Qwen2Tokenizer for Qwen3, which encodes
differently and adds its own end-of-text id), and bos / eos / pad are the model config's ids
where the tokenizer has them, else the tokenizer's usual names (``BOS_NAMES``, ``EOS_NAMES``,
``PAD_NAMES``), pad falling back to eos. The chosen ids, all within the vocabulary, are also
written into the export's config.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeoffload.errors import ConfigError

EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "[SEP]")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[CLS]")
PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")
CONFIG, SPECIAL = "tokenizer_config.json", "special_tokens_map.json"


def load_tokenizer_file(path: str | Path) -> Any:
    """A ``tokenizers.Tokenizer`` from a tokenizer.json (ConfigError without the package)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("the tokenizer needs the tokenizers package: pip install tokenizers "
                          "(it comes with the hf extra: pip install 'pipeoffload[hf]')") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:
        raise ConfigError(f"tokenizer {path} cannot be read by tokenizers ({error})") from None


def _given(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:
        raise ConfigError(f"{path}: not readable JSON ({str(error)[:200]})") from None
    if not isinstance(found, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return found


def _token(value: Any) -> str | None:
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def special_token(tokenizer: Any, names: tuple[str, ...], config_id: Any = None,
                  given: Any = None) -> tuple[str, int] | None:
    """(token, id) of a special token: the one ``given`` by name, the config's id, else the
    first of ``names`` the tokenizer knows; None when none is."""
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    name = _token(given)
    if name is not None and tokenizer.token_to_id(name) is not None:
        return name, int(tokenizer.token_to_id(name))
    if isinstance(config_id, int) and 0 <= config_id < vocab:
        token = tokenizer.id_to_token(config_id)
        if token is not None:
            return token, config_id
    for name in names:
        found = tokenizer.token_to_id(name)
        if found is not None:
            return name, int(found)
    return None


def tokenizer_files(tokenizer_json: str | Path, config: dict[str, Any]
                    ) -> tuple[dict[str, bytes], dict[str, int]]:
    """(file name -> contents, config.json ids to set) for an export whose config.json holds
    ``config`` (see the module docstring)."""
    path = Path(tokenizer_json)
    tokenizer = load_tokenizer_file(path)
    given_config = _given(path.parent / CONFIG)
    given_special = _given(path.parent / SPECIAL)
    hints = {**(given_special or {}), **(given_config or {})}
    roles = {"bos": BOS_NAMES, "eos": EOS_NAMES, "pad": PAD_NAMES}
    chosen = {role: special_token(tokenizer, names, config.get(f"{role}_token_id"),
                                  hints.get(f"{role}_token"))
              for role, names in roles.items()}
    if chosen["pad"] is None:
        chosen["pad"] = chosen["eos"]
    special = {f"{role}_token": found[0] for role, found in chosen.items() if found is not None}
    files = {"tokenizer.json": path.read_bytes()}
    generated = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces":
                 False, "model_max_length": config.get("max_position_embeddings", 1 << 30),
                 **special}
    for name, given, made in ((CONFIG, given_config, generated), (SPECIAL, given_special,
                                                                   special)):
        files[name] = (path.parent / name).read_bytes() if given is not None else (
            json.dumps(made, indent=2, sort_keys=True) + "\n").encode()
    ids = {f"{role}_token_id": found[1] for role, found in chosen.items() if found is not None}
    return files, ids
