"""Text data for `pipeoffload train`: sources, documents, batches, sharding, resume.

Tokens are bytes (vocab 256) unless a local tokenizer is given (``DataConfig.tokenizer``,
training/documents.py; tokenised once into the token cache, token_cache.py) or the source is
pre-tokenised (token_store.py), so any text is valid input and nothing needs downloading: the
default corpus is the source code of a few Python standard-library packages, which every Python
installation carries. What each kind of source gives is in sources.py. Documents are joined with
an end-of-document token between them (the tokenizer's; BYTE_EOS for bytes). The training
stream is cut into non-overlapping windows of seq_len + 1 (inputs are the first seq_len, targets
the last seq_len).

Note: [held-out split] ``eval_fraction`` of the tokens is held out as whole documents, drawn in
an order seeded by ``seed`` until they hold that many tokens (never every document); both
splits keep the store's order. A source of one document holds out its last tokens instead.

Note: [global batch] The batch of global step t is a pure function of (corpus, seed, seq_len,
batch_size, t): global samples t*B .. t*B+B-1 (B = batch_size), where global sample g is
window ``perm_e[g mod W]`` of epoch e = g // W, W the number of training windows and perm_e
torch.randperm(W) from a generator seeded by SHA-256 of (seed, e) (milliseconds at millions of
windows; the same on every rank and for a given torch version). Data-parallel replica r of
dp_size takes rows r*B/dp_size .. (r+1)*B/dp_size - 1 of it, so the replicas' batches
concatenated in rank order are exactly the batch one replica with dp_size=1 sees; the saved
state is just the step, which also lets a run resume with a different dp_size. A window is read
from the store when its batch is made (a memory-mapped store is never read whole).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pipeoffload.errors import ConfigError
from pipeoffload.training.data_config import DataConfig
from pipeoffload.training.documents import check_store_vocabulary
from pipeoffload.training.sources import Corpus, is_token_source, read_corpus
from pipeoffload.training.token_store import TokenStore, open_store

VOCAB_SIZE = 256
BYTE_EOS = 0
"""The end-of-document token between byte-level documents: NUL, which text never holds."""


def encode(text: str | bytes) -> Tensor:
    """Token ids (int64 [n]) of text: its UTF-8 bytes."""
    raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return torch.tensor(list(raw), dtype=torch.int64)


def decode(ids: Tensor | Sequence[int]) -> str:
    """Text of byte token ids; invalid UTF-8 becomes U+FFFD."""
    values = ids.tolist() if isinstance(ids, Tensor) else list(ids)
    return bytes(values).decode("utf-8", errors="replace")


def load_corpus(config: DataConfig) -> Corpus:
    """The configured text (sources.py ``read_corpus``); a pre-tokenised source is refused."""
    if is_token_source(config.source):
        raise ConfigError(f"{config.source} holds token ids, not text")
    return read_corpus(config)


def byte_store(corpus: Corpus) -> TokenStore:
    """The corpus's bytes as tokens, BYTE_EOS between documents (text read as text holds no
    NUL byte: a file with one is binary, sources.py)."""
    documents = corpus.documents()
    data = bytes([BYTE_EOS]).join(documents)
    ends = tuple(itertools.accumulate(len(d) + 1 for d in documents))
    ends = (*ends[:-1], len(data))
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return TokenStore(tokens, ends, BYTE_EOS, VOCAB_SIZE, corpus.origin,
                      hashlib.sha256(data).hexdigest())


def load_tokens(config: DataConfig) -> TokenStore:
    """The configured source's token ids: memory-mapped for a pre-tokenised source, from the
    token cache (tokenised on first use) with a tokenizer, bytes otherwise."""
    if is_token_source(config.source):
        store = open_store(Path(str(config.source)))
        if config.tokenizer is not None:
            check_store_vocabulary(store, config.tokenizer)
        return store
    if config.tokenizer is not None:
        from pipeoffload.training.token_cache import cached_store

        return cached_store(config)
    return byte_store(load_corpus(config))


def vocab_needed(config: DataConfig) -> int:
    """Token ids the model must embed: 256 for bytes, the tokenizer's vocabulary, or what a
    pre-tokenised source says."""
    if config.tokenizer is not None:
        from pipeoffload.training.documents import tokenizer_vocab_size

        return tokenizer_vocab_size(config.tokenizer)
    if is_token_source(config.source):
        return open_store(Path(str(config.source))).vocab_size
    return VOCAB_SIZE


def end_of_document_id(config: DataConfig) -> int | None:
    """The id between documents of the configured data: BYTE_EOS for bytes, the tokenizer's
    (None when it names none), or what a pre-tokenised store's header says."""
    if config.tokenizer is not None:
        from pipeoffload.training.documents import eos_token_id, load_tokenizer

        return eos_token_id(load_tokenizer(config.tokenizer), config.tokenizer)
    if is_token_source(config.source):
        return open_store(Path(str(config.source))).eos
    return BYTE_EOS


def split_documents(store: TokenStore, eval_fraction: float, seed: int
                    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(training, held-out) token ranges of the store: see [held-out split]. Past the seeded
    shuffle, the work is in the held documents only (a corpus of 500k documents holds out
    25k), not in every document."""
    total = len(store)
    target = math.floor(total * eval_fraction)
    if target == 0:
        return [(0, total)], []
    ends = store.ends
    if len(ends) < 2:
        return [(0, total - target)], [(total - target, total)]
    order = list(range(len(ends)))
    random.Random(f"{seed}:held-out").shuffle(order)
    held: list[int] = []
    size = 0
    for d in itertools.islice(order, len(order) - 1):  # never every document
        if size >= target:
            break
        held.append(d)
        size += ends[d] - (ends[d - 1] if d else 0)
    held.sort()
    train_runs: list[tuple[int, int]] = []
    held_runs: list[tuple[int, int]] = []
    at = 0  # where the training run after the last held block starts
    for d in held:
        start = ends[d - 1] if d else 0
        if held_runs and held_runs[-1][1] == start:
            held_runs[-1] = (held_runs[-1][0], ends[d])
        else:
            if start > at:
                train_runs.append((at, start))
            held_runs.append((start, ends[d]))
        at = ends[d]
    if at < ends[-1]:
        train_runs.append((at, ends[-1]))
    return train_runs, held_runs


class TokenStream:
    """Token ranges of a store read as one stream; ``read`` slices only what it returns
    (a memory-mapped store is read a window at a time)."""

    def __init__(self, tokens: Tensor, ranges: list[tuple[int, int]]) -> None:
        self.tokens, self.ranges = tokens, ranges
        self.starts = list(itertools.accumulate((b - a for a, b in ranges), initial=0))

    def __len__(self) -> int:
        return self.starts[-1]

    def read(self, start: int, count: int) -> Tensor:
        """Tokens start .. start + count - 1 of the stream, int64."""
        parts = []
        i = bisect.bisect_right(self.starts, start) - 1
        while count > 0:
            a, b = self.ranges[i]
            at = a + start - self.starts[i]
            take = min(count, b - at)
            parts.append(self.tokens[at: at + take].to(torch.int64))
            start, count, i = start + take, count - take, i + 1
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def all(self) -> Tensor:
        """The whole stream (for small data and tests)."""
        return self.read(0, len(self)) if len(self) else torch.zeros(0, dtype=torch.int64)


class TextDataset:
    """Training batches for one data-parallel replica, plus the held-out evaluation batches.

    Iterating yields (inputs, targets), each int64 [batch_size // dp_size, seq_len], forever;
    see [global batch] above for which windows they hold. ``state_dict`` / ``load_state_dict``
    save and restore the position so a resumed run sees exactly the same batches.
    """

    def __init__(self, source: Corpus | TokenStore, config: DataConfig, *, dp_rank: int = 0,
                 dp_size: int = 1) -> None:
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ConfigError(f"dp_rank must be in [0, dp_size), got {dp_rank} of {dp_size}")
        if config.batch_size % dp_size:
            raise ConfigError(
                f"global batch_size={config.batch_size} does not split evenly over "
                f"dp_size={dp_size} replicas; use a multiple of {dp_size}"
            )
        self.config = config
        self.corpus = source if isinstance(source, Corpus) else None
        self.store = byte_store(source) if isinstance(source, Corpus) else source
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.local_batch_size = config.batch_size // dp_size
        train, held = split_documents(self.store, config.eval_fraction, config.seed)
        self.train = TokenStream(self.store.tokens, train)
        self.eval = TokenStream(self.store.tokens, held)
        self._check_sizes()
        self.data_identity = hashlib.sha256(
            f"{self.store.identity}|{config.eval_fraction}|{train}".encode()).hexdigest()
        self.step = 0
        self._perms: dict[int, Tensor] = {}

    def _check_sizes(self) -> None:
        seq, batch, origin = self.config.seq_len, self.config.batch_size, self.store.origin
        self.num_train_windows = (len(self.train) - 1) // seq
        if self.num_train_windows < batch:
            raise ConfigError(
                f"too little text in {origin}: {len(self.train)} training tokens "
                f"make {self.num_train_windows} windows of seq_len+1={seq + 1} tokens, but one "
                f"batch needs {batch}; add text, raise max_bytes, or lower batch_size/seq_len"
            )
        self.num_eval_batches = max(len(self.eval) - 1, 0) // seq // batch
        if self.config.eval_fraction > 0 and self.num_eval_batches == 0:
            raise ConfigError(
                f"the held-out {len(self.eval)} tokens ({self.config.eval_fraction:.0%} of "
                f"{origin}) are fewer than one batch needs ({batch * seq + 1}); raise "
                "eval_fraction, add text, lower batch_size/seq_len, or set eval_fraction=0"
            )

    @property
    def train_tokens(self) -> Tensor:
        """The training split's tokens, int64 (read whole: for small data and tests)."""
        return self.train.all()

    @property
    def eval_tokens(self) -> Tensor:
        """The held-out split's tokens, int64."""
        return self.eval.all()

    @classmethod
    def from_config(cls, config: DataConfig, *, dp_rank: int = 0, dp_size: int = 1) -> TextDataset:
        """Load the configured source's tokens and wrap them."""
        return cls(load_tokens(config), config, dp_rank=dp_rank, dp_size=dp_size)

    def _window(self, sample: int) -> int:
        epoch, position = divmod(sample, self.num_train_windows)
        if epoch not in self._perms:
            label = hashlib.sha256(f"{self.config.seed}:{epoch}".encode()).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(label[:8], "little") >> 1)
            order = torch.randperm(self.num_train_windows, generator=generator)
            self._perms = {e: p for e, p in self._perms.items() if e == epoch - 1}
            self._perms[epoch] = order
        return int(self._perms[epoch][position])

    def _windows(self, stream: TokenStream, windows: Iterable[int]) -> tuple[Tensor, Tensor]:
        seq = self.config.seq_len
        rows = torch.stack([stream.read(w * seq, seq + 1) for w in windows])  # [batch, seq + 1]
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def batch_at(self, step: int) -> tuple[Tensor, Tensor]:
        """This replica's (inputs, targets) of global step ``step``, without moving the position."""
        if step < 0:
            raise ConfigError(f"step must be >= 0, got {step}")
        first = step * self.config.batch_size + self.dp_rank * self.local_batch_size
        samples = range(first, first + self.local_batch_size)
        return self._windows(self.train, [self._window(g) for g in samples])

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
            yield self._windows(self.eval, range(first, first + local))

    def state_dict(self) -> dict[str, Any]:
        """The position (next global step) and what it is only meaningful with."""
        return {
            "step": self.step,
            "seed": self.config.seed,
            "seq_len": self.config.seq_len,
            "batch_size": self.config.batch_size,
            "data_identity": self.data_identity,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; refuses a state saved with other data or batching."""
        for key in ("seed", "seq_len", "batch_size", "data_identity"):
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
        corpus = self.corpus
        read = (f"{len(corpus.data):,} bytes in {len(corpus.files)} files"
                f"{', truncated at max_bytes' if corpus.truncated else ''}" if corpus
                else f"{len(self.store):,} tokens")
        return (f"{self.store.origin}: {read}, {len(self.store.ends):,} documents; "
                f"{self.num_train_windows:,} training windows of {self.config.seq_len} tokens, "
                f"{self.num_eval_batches} eval batches")
