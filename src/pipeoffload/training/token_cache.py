"""Text tokenised once: the token cache.

A run with ``--tokenizer`` tokenises its text into a token store (token_store.py) in
``cache_dir/tokens/KEY`` and every later run, and every rank of this one, memory-maps it. KEY is
SHA-256 over what the tokens are a function of: the tokenizer file's bytes, the text key, the
byte cap, and the source's identity: per file its path, size, mtime and sampled hash
(token_store.sampled_identity), so finding the store costs a stat and a few reads per file,
not a read of the corpus. An edit that keeps a file's size, mtime and sampled blocks is not
seen; `pipeoffload tokenize` writes a store whose identity is its own content. The store's
header also says what the text was read from (``corpus``: files, bytes of each, binary files
skipped, cut by the byte cap), so a cached run reports its data without reading the text again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pipeoffload.errors import ConfigError
from pipeoffload.training.data_config import DataConfig
from pipeoffload.training.documents import (
    encode_documents,
    eos_token_id,
    load_tokenizer,
    tokenizer_file,
)
from pipeoffload.training.sources import Corpus, is_hf_source, read_corpus, user_files
from pipeoffload.training.token_store import HEADER, TokenStore, open_store, sampled_identity

CACHE_ENV = "PIPEOFFLOAD_CACHE"
REPORT = "corpus"
"""The header key of what the text was read from (``cached_report``)."""
ENCODE_BATCH = 512
"""Documents per encode_batch call: between calls the progress line moves."""
Progress = Callable[[int, int], None]


def cache_root(config: DataConfig) -> Path:
    """Where the token cache lives: ``config.cache_dir``, $PIPEOFFLOAD_CACHE, or
    ~/.cache/pipeoffload."""
    if config.cache_dir is not None:
        return Path(config.cache_dir)
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pipeoffload")


def source_identity(config: DataConfig) -> str:
    """The source's identity for the cache key (module docstring)."""
    source = config.source
    if source is None:
        return f"stdlib:{sys.version}:{','.join(config.stdlib_packages)}"
    if str(source).startswith("hf:"):
        return f"{source}"
    root, files = user_files(Path(source))
    if is_hf_source(source):
        root, files = Path(source), sorted(p for p in Path(source).rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for path in files:
        info = path.stat()
        digest.update(f"{path.relative_to(root).as_posix()}|{info.st_size}|"
                      f"{info.st_mtime_ns}|{sampled_identity(path)}\n".encode())
    return digest.hexdigest()


def cache_key(config: DataConfig) -> str:
    """The cache folder's name for this configuration's tokens."""
    assert config.tokenizer is not None
    tokenizer = hashlib.sha256(tokenizer_file(config.tokenizer).read_bytes()).hexdigest()
    key = {"version": 1, "tokenizer": tokenizer, "text_key": config.text_key,
           "max_bytes": config.max_bytes, "source": source_identity(config)}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def cached_store(config: DataConfig, progress: Progress | None = None) -> TokenStore:
    """The configuration's tokens from the cache, tokenised into it first if missing."""
    folder = cache_root(config) / "tokens" / cache_key(config)
    if not (folder / HEADER).is_file():
        write_tokens(config, folder, progress)
    return open_store(folder)


def cached_report(config: DataConfig) -> Corpus | None:
    """What the configuration's cached tokens were read from (a Corpus without its text), from
    the store's header; None when nothing is cached, or the store's header does not say."""
    header_path = cache_root(config) / "tokens" / cache_key(config) / HEADER
    try:
        header = json.loads(header_path.read_text(encoding="utf-8"))
        report = header[REPORT]
        return Corpus(data=b"", files=tuple(str(f) for f in report["files"]),
                      origin=str(header["origin"]), truncated=bool(report["truncated"]),
                      file_bytes=tuple(int(n) for n in report["file_bytes"]),
                      skipped=int(report["skipped"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def tokenized_documents(config: DataConfig, progress: Progress | None = None
                        ) -> tuple[Iterator[list[int]], int | None, int, Corpus]:
    """(each document's ids, the EOS id, the vocabulary, the text read) for the configured
    text."""
    path = config.tokenizer
    assert path is not None
    tokenizer = load_tokenizer(path)
    corpus = read_corpus(config)
    documents = corpus.documents()

    def encoded() -> Iterator[list[int]]:
        for first in range(0, len(documents), ENCODE_BATCH):
            yield from encode_documents(tokenizer, documents[first: first + ENCODE_BATCH], path)
            if progress is not None:
                progress(min(first + ENCODE_BATCH, len(documents)), len(documents))

    vocab = int(tokenizer.get_vocab_size(with_added_tokens=True))
    return encoded(), eos_token_id(tokenizer, path), vocab, corpus


def write_tokens(config: DataConfig, folder: Path, progress: Progress | None = None) -> Path:
    """Tokenise the configured text into a store at ``folder`` (written beside it, then
    renamed into place, so a reader never sees half a store)."""
    from pipeoffload.training.token_store import write_store

    documents, eos, vocab, corpus = tokenized_documents(config, progress)
    report = {"files": list(corpus.files), "file_bytes": list(corpus.file_bytes),
              "skipped": corpus.skipped, "truncated": corpus.truncated}
    folder.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        write_store(temporary, documents, eos=eos, vocab_size=vocab,
                    extra={"origin": corpus.origin, REPORT: report,
                           "tokenizer": str(config.tokenizer),
                           "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        os.replace(temporary, folder)  # a store appears whole; an existing one stays
    except OSError as error:
        shutil.rmtree(temporary, ignore_errors=True)
        if (folder / HEADER).is_file():  # another process (a rank, a run) wrote it first
            return folder
        raise ConfigError(f"cannot write tokens to {folder} ({error}); point --cache-dir "
                          "somewhere writable") from None
    return folder
