"""Training text beyond plain files: JSON-lines records and token ids from a local tokenizer.

A JSON-lines file (``*.jsonl``) holds one JSON object per line whose ``"text"`` string is one
document; blank lines are skipped. A plain file is one document. With ``--tokenizer PATH`` (a
``tokenizer.json``, or a folder holding one, read by the ``tokenizers`` package: no downloads)
each document is encoded on its own, with what the tokenizer's post-processor adds (a BOS token
for Llama's), and the documents' ids are concatenated; without one, tokens are the documents'
UTF-8 bytes (data.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipeoffload.errors import ConfigError

JSONL_SUFFIX = ".jsonl"
TOKENIZER_FILE = "tokenizer.json"


def read_jsonl(path: Path, limit: int) -> tuple[list[bytes], int, bool]:
    """The ``text`` of each record of ``path`` (UTF-8), reading at most ``limit`` bytes (-1:
    all) and only whole lines; also the bytes read and whether the limit cut the file short."""
    documents: list[bytes] = []
    used = 0
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if limit >= 0 and used + len(line) > limit:
                return documents, used, True
            used += len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise ConfigError(f"{path}:{number}: not a JSON object ({error}); a .jsonl file "
                                  "holds one {\"text\": ...} object per line") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise ConfigError(f"{path}:{number}: the record has no \"text\" string (keys "
                                  f"{sorted(record)[:5] if isinstance(record, dict) else '-'})")
            documents.append(text.encode("utf-8"))
    return documents, used, False


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


def tokenize(documents: Sequence[bytes], path: str | Path) -> Tensor:
    """Token ids (int64 [n]) of the documents, each encoded on its own, concatenated."""
    tokenizer = load_tokenizer(path)
    texts = [d.decode("utf-8", errors="replace") for d in documents]
    try:
        encodings = tokenizer.encode_batch(texts)
    except Exception as error:  # tokenizers raises a bare Exception (a WordLevel without unk)
        raise ConfigError(f"--tokenizer {tokenizer_file(path)} cannot encode the data "
                          f"({error}); a word-level tokenizer needs an unknown token "
                          "(unk_token) for words outside its vocabulary") from None
    ids = [i for encoding in encodings for i in encoding.ids]
    return torch.tensor(ids, dtype=torch.int64)


def tokens_sha256(tokens: Tensor) -> str:
    """SHA-256 of token ids (as int64), what a resumed run must see again."""
    data = tokens.to(torch.int64).contiguous().clone()
    return hashlib.sha256(bytes(data.untyped_storage())).hexdigest()


def files_report(origin: str, files: Sequence[str], sizes: Sequence[int], shown: int = 12) -> str:
    """Which files were read and how many bytes of each (the first ``shown``)."""
    listed = ", ".join(f"{name} ({size:,} B)" for name, size in zip(files[:shown], sizes))
    more = f", and {len(files) - shown} more" if len(files) > shown else ""
    return (f"data: {sum(sizes):,} bytes from {len(files)} file(s) of {origin}: "
            f"{listed}{more}")
