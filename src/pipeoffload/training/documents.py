"""Token ids from a local tokenizer: ``--tokenizer PATH`` (a ``tokenizer.json``, or a folder
holding one, read by the ``tokenizers`` package: no downloads). Each document (sources.py) is
encoded on its own, with what the tokenizer's post-processor adds (a BOS token for Llama's), and
the tokenizer's end-of-document token goes between documents (``eos_token_id``); without a
tokenizer, tokens are the documents' UTF-8 bytes (data.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeoffload.errors import ConfigError
from pipeoffload.parallel.tokenizer_files import CONFIG, EOS_NAMES, special_token

TOKENIZER_FILE = "tokenizer.json"


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json ``--tokenizer PATH`` names (the file, or a folder holding one)."""
    given = Path(path)
    found = given / TOKENIZER_FILE if given.is_dir() else given
    if not found.is_file():
        raise ConfigError(f"--tokenizer {path}: no {TOKENIZER_FILE} there; pass a local "
                          "tokenizer.json (or its folder); nothing is downloaded")
    return found


def load_tokenizer(path: str | Path) -> Any:
    """A ``tokenizers.Tokenizer`` from a local file (ConfigError without the package)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("--tokenizer needs the tokenizers package: pip install tokenizers "
                          "(it comes with the hf extra: pip install 'pipeoffload[hf]')") from None
    found = tokenizer_file(path)
    try:
        return Tokenizer.from_file(str(found))
    except Exception as error:
        raise ConfigError(f"--tokenizer {found} cannot be read by tokenizers ({error})") from None


def tokenizer_vocab_size(path: str | Path) -> int:
    """Token ids the tokenizer can produce (added tokens included)."""
    return int(load_tokenizer(path).get_vocab_size(with_added_tokens=True))


def eos_token_id(tokenizer: Any, path: str | Path) -> int | None:
    """The tokenizer's end-of-document id: ``eos_token`` of a tokenizer_config.json beside
    it, else the first of EOS_NAMES it knows (parallel/tokenizer_files.py, as exports name
    it); None when it names none."""
    config = tokenizer_file(path).parent / CONFIG
    given = None
    if config.is_file():
        try:
            values = json.loads(config.read_text(encoding="utf-8"))
            given = values.get("eos_token") if isinstance(values, dict) else None
        except (OSError, ValueError, RecursionError):
            given = None
    found = special_token(tokenizer, EOS_NAMES, None, given)
    return None if found is None else found[1]


def encode_documents(tokenizer: Any, documents: Sequence[bytes], path: str | Path
                     ) -> list[list[int]]:
    """Each document's ids, encoded on its own (the tokenizers package spreads a batch over
    its threads)."""
    texts = [d.decode("utf-8", errors="replace") for d in documents]
    try:
        encodings = tokenizer.encode_batch(texts)
    except Exception as error:  # tokenizers raises a bare Exception (a WordLevel without unk)
        raise ConfigError(f"--tokenizer {tokenizer_file(path)} cannot encode the data "
                          f"({error}); a word-level tokenizer needs an unknown token "
                          "(unk_token) for words outside its vocabulary") from None
    return [list(encoding.ids) for encoding in encodings]


def check_store_vocabulary(store: Any, path: str | Path) -> None:
    """Refuse a pre-tokenised store whose ids the tokenizer cannot have made."""
    size = tokenizer_vocab_size(path)
    if store.vocab_size > size:
        raise ConfigError(f"--data {store.origin} holds ids up to {store.vocab_size - 1}, but "
                          f"--tokenizer {path} has {size}; pass the tokenizer it was made "
                          "with")


def files_report(origin: str, files: Sequence[str], sizes: Sequence[int], shown: int = 12) -> str:
    """Which files were read and how many bytes of each (the first ``shown``)."""
    listed = ", ".join(f"{name} ({size:,} B)" for name, size in zip(files[:shown], sizes))
    more = f", and {len(files) - shown} more" if len(files) > shown else ""
    return (f"data: {sum(sizes):,} bytes from {len(files)} file(s) of {origin}: "
            f"{listed}{more}")
