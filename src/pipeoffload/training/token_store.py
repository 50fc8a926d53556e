"""Token ids on disk: the pre-tokenised binary format, memory-mapped and read per batch.

A store is a folder (what ``pipeoffload tokenize`` and the token cache write) holding
- ``tokens.bin``: every token id, little-endian uint16 (vocabularies up to 65,536) or uint32,
  documents one after another with the end-of-document id between them (nanoGPT's ``.bin``);
- ``documents.bin``: int64 end offset (exclusive, in tokens) of each document, EOS included
  (Megatron's index keeps the same);
- ``tokens.json``: ``{"format": "pipeoffload-tokens", "version": 1, "dtype": "uint16",
  "tokens": N, "documents": D, "eos": ID or null, "vocab_size": V, "sha256": ...}``; ``sha256``
  is SHA-256 over tokens.bin's bytes, computed once while writing.
A bare ``NAME.bin`` of someone else's is read too when ``NAME.json`` beside it holds at least
``{"dtype": "uint16"}`` (or uint32); without ``documents`` it is one document, and without
``sha256`` its identity is its size, mtime and a sampled hash (``sampled_identity``).

Note: [data identity] what a resumed run must see again is named by a hash that costs
milliseconds at any size: the header's ``sha256`` for a store (hashed once, when written), the
sampled identity for a foreign binary, SHA-256 over the bytes for text read into memory.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipeoffload.errors import ConfigError
from pipeoffload.training.sources import DOCUMENTS, HEADER, TOKENS, store_paths

FORMAT = "pipeoffload-tokens"
_DTYPES = {"uint16": (torch.uint16, "H", 2), "uint32": (torch.uint32, "I", 4)}
SAMPLE_BLOCKS, SAMPLE_BYTES = 64, 1 << 16


@dataclass(frozen=True)
class TokenStore:
    """Token ids (1-D, any integer dtype, possibly memory-mapped: read a slice at a time),
    the exclusive end of each document in them, the end-of-document id, the vocabulary the
    ids need, where they came from and their identity ([data identity])."""

    tokens: Tensor = field(repr=False)
    ends: tuple[int, ...]
    eos: int | None
    vocab_size: int
    origin: str
    identity: str

    def __len__(self) -> int:
        return int(self.tokens.numel())


def sampled_identity(path: Path) -> str:
    """SHA-256 over the file's size and SAMPLE_BLOCKS evenly spaced blocks of SAMPLE_BYTES
    (the first and last included): a change anywhere in those, or in the size, is seen."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"{size}".encode())
    with path.open("rb") as f:
        step = max(size - SAMPLE_BYTES, 0) // max(SAMPLE_BLOCKS - 1, 1)
        for block in range(SAMPLE_BLOCKS if size > SAMPLE_BYTES else 1):
            f.seek(block * step)
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def _header(path: Path, bin_path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{bin_path}: a binary of token ids needs a header {path} saying at "
                          "least {\"dtype\": \"uint16\"} (or uint32); `pipeoffload tokenize` "
                          "writes whole stores")
    try:
        header = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as error:
        raise ConfigError(f"{path}: not a readable JSON header ({str(error)[:200]})") from None
    if not isinstance(header, dict) or header.get("dtype") not in _DTYPES:
        got = header.get("dtype") if isinstance(header, dict) else header
        raise ConfigError(f"{path}: \"dtype\" must be one of {sorted(_DTYPES)}, got {got!r}")
    for key in ("eos", "vocab_size", "tokens", "documents"):
        value = header.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 0):
            raise ConfigError(f"{path}: {key!r} must be an integer >= 0, got {value!r}")
    return header


def open_store(source: Path) -> TokenStore:
    """Memory-map a store (or a headed ``.bin``); nothing but the document offsets is read."""
    paths = store_paths(source)
    if paths is None:
        raise ConfigError(f"{source} is not a token store (no {HEADER}, not a .bin file)")
    header_path, tokens_path, docs_path = paths
    header = _header(header_path, tokens_path)
    dtype, _, width = _DTYPES[header["dtype"]]
    if not tokens_path.is_file():
        raise ConfigError(f"{header_path}: its tokens file {tokens_path} is missing")
    size = tokens_path.stat().st_size
    if size % width or size == 0:
        raise ConfigError(f"{tokens_path}: {size} bytes is not a whole, non-zero number of "
                          f"{header['dtype']} ids")
    count = size // width
    if header.get("tokens") not in (None, count):
        raise ConfigError(f"{header_path} says {header['tokens']} tokens but {tokens_path} "
                          f"holds {count}; the store is incomplete, write it again")
    if sys.byteorder != "little":
        raise ConfigError("token stores are little-endian; this machine is not")
    tokens = torch.from_file(str(tokens_path), shared=False, size=count, dtype=dtype)
    ends = _document_ends(docs_path, count) if docs_path.is_file() else (count,)
    vocab = header.get("vocab_size")
    if vocab is None:
        vocab = max_id(tokens) + 1
    identity = header.get("sha256") or sampled_identity(tokens_path)
    return TokenStore(tokens, ends, header.get("eos"), vocab, str(source), str(identity))


def max_id(tokens: Tensor, chunk: int = 1 << 24) -> int:
    """The largest id, read ``chunk`` tokens at a time (torch has no max over uint16)."""
    return max(int(tokens[i: i + chunk].to(torch.int64).max())
               for i in range(0, tokens.numel(), chunk))


def _document_ends(path: Path, count: int) -> tuple[int, ...]:
    raw = path.read_bytes()
    ends = array.array("q")
    if len(raw) % ends.itemsize:
        raise ConfigError(f"{path}: not a whole number of int64 offsets")
    ends.frombytes(raw)
    if sys.byteorder != "little":
        ends.byteswap()
    previous = 0
    for end in ends:
        if end <= previous or end > count:
            raise ConfigError(f"{path}: document ends must rise within the {count} tokens; "
                              f"{end} after {previous} does not")
        previous = end
    if previous != count:
        raise ConfigError(f"{path}: the last document ends at {previous}, not at the last "
                          f"token {count}; the store is incomplete, write it again")
    return tuple(ends)


def token_dtype(vocab_size: int) -> str:
    """The narrowest store dtype holding ids below ``vocab_size``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def write_store(folder: Path, documents: Iterable[list[int]], *, eos: int | None,
                vocab_size: int, extra: dict[str, Any] | None = None) -> Path:
    """Write documents' ids as a store in ``folder`` (made; its files replaced), EOS between
    documents; tokens.json goes last, so a store with a header is complete."""
    name = token_dtype(vocab_size)
    code = _DTYPES[name][1]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / HEADER).unlink(missing_ok=True)
    digest, count, ends = hashlib.sha256(), 0, array.array("q")
    with (folder / TOKENS).open("wb") as out:
        for ids in documents:
            if not ids:
                continue
            if ends and eos is not None:
                ids = [eos, *ids]
                ends[-1] += 1
            chunk = array.array(code, ids)
            digest.update(memoryview(chunk).cast("B"))
            chunk.tofile(out)
            count += len(chunk)
            ends.append(count)
    if count == 0:
        raise ConfigError(f"nothing to write to {folder}: the documents hold no tokens")
    (folder / DOCUMENTS).write_bytes(ends.tobytes())
    header = {"format": FORMAT, "version": 1, "dtype": name, "tokens": count,
              "documents": len(ends), "eos": eos, "vocab_size": vocab_size,
              "sha256": digest.hexdigest(), **(extra or {})}
    temporary = folder / (HEADER + ".tmp")
    temporary.write_text(json.dumps(header, indent=1) + "\n", encoding="utf-8")
    os.replace(temporary, folder / HEADER)
    return folder
