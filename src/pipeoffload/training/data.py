"""Text data for `pipeoffload train`: corpus loading, batches, sharding, resume.

Tokens are bytes (vocab 256) unless a local tokenizer is given (``DataConfig.tokenizer``,
training/documents.py), so any file is valid input and nothing needs downloading: the default
corpus is the source code of a few Python standard-library packages, which every Python
installation carries; ``*.jsonl`` files contribute the ``text`` of each record. The tokens are
cut into non-overlapping windows of seq_len + 1 (inputs are the first seq_len, targets the
last seq_len); the last ``eval_fraction`` of the tokens is held out for evaluation.

Note: [global batch] The batch of global step t is a pure function of (corpus, seed, seq_len,
batch_size, t): global samples t*B .. t*B+B-1 (B = batch_size), where global sample g is
window ``perm_e[g mod W]`` of epoch e = g // W, W the number of training windows and perm_e a
permutation seeded by (seed, e). Data-parallel replica r of dp_size takes rows
r*B/dp_size .. (r+1)*B/dp_size - 1 of it, so the replicas' batches concatenated in rank order
are exactly the batch one replica with dp_size=1 sees; the saved state is just the step,
which also lets a run resume with a different dp_size.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipeoffload.errors import ConfigError
from pipeoffload.training.data_config import DataConfig
from pipeoffload.training.documents import JSONL_SUFFIX, read_jsonl, tokenize, tokens_sha256

VOCAB_SIZE = 256

@dataclass(frozen=True)
class Corpus:
    """The text read, where from (``origin``, ``files`` in reading order, ``file_bytes`` read
    from each), whether ``max_bytes`` cut it short, and where each document ends in ``data``
    (a plain file is one document, a JSON-lines record another)."""

    data: bytes = field(repr=False)
    files: tuple[str, ...]
    origin: str
    truncated: bool
    file_bytes: tuple[int, ...] = ()
    document_ends: tuple[int, ...] = ()

    def documents(self) -> list[bytes]:
        """The documents, in order."""
        ends = self.document_ends or (len(self.data),)
        return [self.data[a:b] for a, b in zip((0, *ends[:-1]), ends)]


def encode(text: str | bytes) -> Tensor:
    """Token ids (int64 [n]) of text: its UTF-8 bytes."""
    raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return torch.tensor(list(raw), dtype=torch.int64)


def decode(ids: Tensor | Sequence[int]) -> str:
    """Text of byte token ids; invalid UTF-8 becomes U+FFFD."""
    values = ids.tolist() if isinstance(ids, Tensor) else list(ids)
    return bytes(values).decode("utf-8", errors="replace")


def _stdlib_files(packages: Sequence[str]) -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    dirs = [root / name for name in packages if (root / name / "__init__.py").is_file()]
    if not dirs:
        raise ConfigError(
            f"none of the standard-library packages {list(packages)} was found under {root}; "
            "pass a text file or folder as the data source instead"
        )
    files = [p for d in dirs for p in d.rglob("*.py") if p.is_file()]
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _user_files(source: Path) -> tuple[Path, list[Path]]:
    if not source.exists():
        raise ConfigError(f"data source {source} does not exist; pass a text file or folder")
    if source.is_file():
        return source.parent, [source]
    if not source.is_dir():
        raise ConfigError(f"data source {source} is neither a file nor a folder")
    files = [
        p for p in source.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(source).parts)
    ]
    if not files:
        raise ConfigError(
            f"data folder {source} holds no files (hidden files are skipped); add text files"
        )
    return source, sorted(files, key=lambda p: p.relative_to(source).as_posix())


def load_corpus(config: DataConfig) -> Corpus:
    """Read the configured source in a fixed order, up to ``max_bytes``."""
    if config.source is None:
        root, files = _stdlib_files(config.stdlib_packages)
        origin = f"Python standard library ({', '.join(config.stdlib_packages)}) in {root}"
    else:
        root, files = _user_files(Path(config.source))
        origin = str(config.source)
    chunks: list[bytes] = []
    size, used, read, truncated = 0, [], [], False
    for path in files:
        if config.max_bytes is not None and size >= config.max_bytes:
            truncated = True
            break
        limit = -1 if config.max_bytes is None else config.max_bytes - size
        if path.suffix == JSONL_SUFFIX:
            documents, nbytes, cut = read_jsonl(path, limit)
        else:
            with path.open("rb") as f:
                documents = [f.read(limit)]
                cut = limit >= 0 and bool(f.read(1))
            nbytes = len(documents[0])
        truncated = truncated or cut
        chunks.extend(documents)
        used.append(path.relative_to(root).as_posix())
        read.append(nbytes)
        size += nbytes
    data = b"".join(chunks)
    if not data:
        raise ConfigError(f"data source {origin} is empty; give it some text")
    ends = tuple(itertools.accumulate(len(c) for c in chunks))
    return Corpus(data=data, files=tuple(used), origin=origin, truncated=truncated,
                  file_bytes=tuple(read), document_ends=ends)


def vocab_needed(config: DataConfig) -> int:
    """Token ids the model must embed: 256 for bytes, the tokenizer's vocabulary otherwise."""
    if config.tokenizer is None:
        return VOCAB_SIZE
    from pipeoffload.training.documents import tokenizer_vocab_size

    return tokenizer_vocab_size(config.tokenizer)


class TextDataset:
    """Training batches for one data-parallel replica, plus the held-out evaluation batches.

    Iterating yields (inputs, targets), each int64 [batch_size // dp_size, seq_len], forever;
    see [global batch] above for which windows they hold. ``state_dict`` / ``load_state_dict``
    save and restore the position so a resumed run sees exactly the same batches.
    """

    def __init__(
        self, corpus: Corpus, config: DataConfig, *, dp_rank: int = 0, dp_size: int = 1
    ) -> None:
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank must be in [0, dp_size), got {dp_rank} of {dp_size}")
        if config.batch_size % dp_size:
            raise ConfigError(
                f"global batch_size={config.batch_size} does not split evenly over "
                f"dp_size={dp_size} replicas; use a multiple of {dp_size}"
            )
        self.config, self.corpus = config, corpus
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.local_batch_size = config.batch_size // dp_size
        if config.tokenizer is None:
            tokens = torch.frombuffer(bytearray(corpus.data), dtype=torch.uint8)
        else:
            tokens = tokenize(corpus.documents(), config.tokenizer)
        n_eval = math.floor(len(tokens) * config.eval_fraction)
        self.train_tokens = tokens[: len(tokens) - n_eval]
        self.eval_tokens = tokens[len(tokens) - n_eval:]
        seq, batch = config.seq_len, config.batch_size
        self.num_train_windows = (len(self.train_tokens) - 1) // seq
        if self.num_train_windows < batch:
            raise ConfigError(
                f"too little text in {corpus.origin}: {len(self.train_tokens)} training tokens "
                f"make {self.num_train_windows} windows of seq_len+1={seq + 1} tokens, but one "
                f"batch needs {batch}; add text, raise max_bytes, or lower batch_size/seq_len"
            )
        self.num_eval_batches = max(len(self.eval_tokens) - 1, 0) // seq // batch
        if config.eval_fraction > 0 and self.num_eval_batches == 0:
            raise ConfigError(
                f"the held-out {len(self.eval_tokens)} tokens ({config.eval_fraction:.0%} of "
                f"{corpus.origin}) are fewer than one batch needs ({batch * seq + 1}); raise "
                "eval_fraction, add text, lower batch_size/seq_len, or set eval_fraction=0"
            )
        self.train_sha256 = (
            hashlib.sha256(corpus.data[: len(self.train_tokens)]).hexdigest()
            if config.tokenizer is None else tokens_sha256(self.train_tokens))
        self.step = 0
        self._perms: dict[int, list[int]] = {}

    @classmethod
    def from_config(cls, config: DataConfig, *, dp_rank: int = 0, dp_size: int = 1) -> TextDataset:
        """Load the configured corpus and wrap it."""
        return cls(load_corpus(config), config, dp_rank=dp_rank, dp_size=dp_size)

    def _window(self, sample: int) -> int:
        epoch, position = divmod(sample, self.num_train_windows)
        if epoch not in self._perms:
            order = list(range(self.num_train_windows))
            random.Random(f"{self.config.seed}:{epoch}").shuffle(order)
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}
            self._perms[epoch] = order
        return self._perms[epoch][position]

    def _windows(self, tokens: Tensor, windows: Sequence[int]) -> tuple[Tensor, Tensor]:
        seq = self.config.seq_len
        index = torch.tensor(windows, dtype=torch.int64)[:, None] * seq + torch.arange(seq + 1)
        rows = tokens[index].long()  # [batch, seq + 1]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def batch_at(self, step: int) -> tuple[Tensor, Tensor]:
        """This replica's (inputs, targets) of global step ``step``, without moving the position."""
        if step < 0:
            raise ConfigError(f"step must be >= 0, got {step}")
        first = step * self.config.batch_size + self.dp_rank * self.local_batch_size
        samples = range(first, first + self.local_batch_size)
        return self._windows(self.train_tokens, [self._window(g) for g in samples])

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    @property
    def epoch(self) -> float:
        """Training windows consumed so far, in passes over the training split."""
        return self.step * self.config.batch_size / self.num_train_windows

    def eval_batches(self) -> Iterator[tuple[Tensor, Tensor]]:
        """This replica's share of the held-out split: windows in order, full global batches."""
        batch, local = self.config.batch_size, self.local_batch_size
        for b in range(self.num_eval_batches):
            first = b * batch + self.dp_rank * local
            yield self._windows(self.eval_tokens, range(first, first + local))

    def state_dict(self) -> dict[str, Any]:
        """The position (next global step) and what it is only meaningful with."""
        return {
            "step": self.step,
            "seed": self.config.seed,
            "seq_len": self.config.seq_len,
            "batch_size": self.config.batch_size,
            "train_sha256": self.train_sha256,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; refuses a state saved with other data or batching."""
        for key in ("seed", "seq_len", "batch_size", "train_sha256"):
            if state.get(key) != self.state_dict()[key]:
                raise ConfigError(
                    f"data state was saved with {key}={state.get(key)!r} but this dataset has "
                    f"{key}={self.state_dict()[key]!r}; resume with the same data source, "
                    "max_bytes, eval_fraction, seed, seq_len and batch_size"
                )
        step = state.get("step")
        if not isinstance(step, int) or step < 0:
            raise ConfigError(f"data state has an invalid step {step!r}; expected an int >= 0")
        self.step = step

    def summary(self) -> str:
        """One line for logs: source, size and split."""
        cut = ", truncated at max_bytes" if self.corpus.truncated else ""
        return (
            f"{self.corpus.origin}: {len(self.corpus.data):,} bytes in "
            f"{len(self.corpus.files)} files{cut}; {self.num_train_windows:,} training windows "
            f"of {self.config.seq_len} tokens, {self.num_eval_batches} eval batches"
        )
