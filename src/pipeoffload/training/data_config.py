"""Where a run's text comes from and how it is cut into batches (``DataConfig``), without
torch (training/data.py reads and batches it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeoffload.errors import ConfigError

DEFAULT_STDLIB_PACKAGES = (
    "asyncio", "collections", "concurrent", "email", "http", "importlib", "json", "logging",
    "urllib", "xml",
)
STDLIB_MAX_BYTES = 1 << 20
"""What is read of the built-in corpus unless ``max_bytes`` says otherwise (1 MiB)."""


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from and how it is cut into batches.

    ``source``: a text file or a folder (all non-hidden files below it, sorted by path); None
    reads the ``stdlib_packages`` of this Python's standard library (``*.py`` files, sorted).
    ``max_bytes`` caps what is read (in that order); None reads all of the user's data and
    STDLIB_MAX_BYTES of the built-in corpus. ``text_key``: the field of a JSON-lines record,
    Parquet column or dataset column that holds the text. ``cache_dir``: where text tokenised
    with ``tokenizer`` is kept (token_cache.py; None: $PIPEOFFLOAD_CACHE or
    ~/.cache/pipeoffload). ``batch_size`` is the global batch in sequences per step, summed
    over data-parallel replicas. ``eval_fraction`` of the tokens is held out as whole documents
    (data.py's [held-out split]; 0 disables it).
    ``tokenizer``: a local tokenizer.json (or its folder) whose ids are the tokens; None: bytes.
    """

    source: str | Path | None = None
    seq_len: int = 128
    batch_size: int = 16
    seed: int = 0
    eval_fraction: float = 0.05
    max_bytes: int | None = None
    stdlib_packages: tuple[str, ...] = DEFAULT_STDLIB_PACKAGES
    tokenizer: str | None = None
    text_key: str = "text"
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.seq_len < 1 or self.batch_size < 1:
            raise ConfigError(
                f"DataConfig.seq_len and batch_size must be >= 1, got {self.seq_len} and "
                f"{self.batch_size}"
            )
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError(
                f"DataConfig.eval_fraction must be in [0, 1), got {self.eval_fraction}"
            )
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ConfigError(f"DataConfig.max_bytes must be >= 1 or None, got {self.max_bytes}")
        if not isinstance(self.text_key, str) or not self.text_key:
            raise ConfigError(f"DataConfig.text_key must be a non-empty string, got "
                              f"{self.text_key!r}")
        if isinstance(self.stdlib_packages, str):
            raise ConfigError("DataConfig.stdlib_packages must be a tuple of names, not a str")
        object.__setattr__(self, "stdlib_packages", tuple(self.stdlib_packages))
        bad = [p for p in self.stdlib_packages if not p.isidentifier()]
        if bad or not self.stdlib_packages:
            raise ConfigError(
                f"DataConfig.stdlib_packages must name standard-library packages, got "
                f"{list(self.stdlib_packages)}"
            )
