"""Reading documents from what ``--data`` names, each kind read as what it is.

- a text file, or a folder (every non-hidden file below it, sorted by path): a plain file is
  one document; a file whose first 8 KiB hold a NUL byte or are not UTF-8 is binary (a
  ``.pyc``, a PNG) and is skipped and counted, never trained on;
- JSON lines (``.jsonl`` in any letter case): one object per line, its ``text_key`` string one
  document; each line is read with bounded memory (``MAX_LINE_BYTES``) and any line that is not
  such an object is refused by number;
- compressed files (``.gz``; ``.zst`` with the zstd extra): read as the file without that
  suffix (``a.jsonl.gz`` is JSON lines);
- Parquet (``.parquet``, the parquet extra: pyarrow): the ``text_key`` column, a row a document;
- a ``datasets`` dataset saved with ``save_to_disk`` (a folder holding ``dataset_info.json`` or
  ``dataset_dict.json``), or ``hf:NAME[:SPLIT]`` for one already in the local cache (the
  datasets extra; nothing is downloaded): the ``text_key`` column.
Pre-tokenised binaries are not documents; token_store.py reads them.
"""

from __future__ import annotations

import gzip
import io
import itertools
import json
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pipeoffload.errors import ConfigError
from pipeoffload.training.data_config import STDLIB_MAX_BYTES, DataConfig

MAX_LINE_BYTES = 64 << 20
"""The longest JSON line read (64 MiB): memory per line stays bounded, a longer one is refused."""
SNIFF_BYTES = 8192
HF_PREFIX = "hf:"
HEADER, TOKENS, DOCUMENTS = "tokens.json", "tokens.bin", "documents.bin"  # token_store.py
_EXTRAS = {
    "zstandard": "the zstd extra: pip install 'pipeoffload[zstd]'",
    "pyarrow": "the parquet extra: pip install 'pipeoffload[parquet]'",
    "datasets": "the datasets extra: pip install 'pipeoffload[datasets]'",
}


@dataclass(frozen=True)
class FileDocuments:
    """What one file gave: its documents, the bytes read from it, whether ``max_bytes`` cut
    it short, and whether it was skipped as binary (then no documents)."""

    documents: list[bytes]
    nbytes: int
    truncated: bool = False
    binary: bool = False


def import_extra(module: str, what: str) -> Any:
    """``module`` imported, or a ConfigError naming the extra that brings it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{what} needs {module}, which is not installed; install "
                          f"{_EXTRAS.get(module.split('.')[0], module)}") from None


def kind_of(path: Path) -> tuple[str, str | None]:
    """(kind, compression) of a file by its name: kind "jsonl", "parquet" or "text";
    compression "gz", "zst" or None."""
    name = path.name.lower()
    compression = None
    for suffix in ("gz", "zst"):
        if name.endswith("." + suffix):
            compression, name = suffix, name[: -len(suffix) - 1]
    if name.endswith(".jsonl"):
        return "jsonl", compression
    if name.endswith(".parquet") and compression is None:
        return "parquet", None
    return "text", compression


def _open(path: Path, compression: str | None) -> IO[bytes]:
    if compression == "gz":
        return io.BufferedReader(gzip.GzipFile(path, "rb"))
    if compression == "zst":
        zstandard = import_extra("zstandard", f"{path} (zstd-compressed)")
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(path.open("rb")))
    return path.open("rb")


def read_file(path: Path, limit: int, text_key: str = "text") -> FileDocuments:
    """The documents of one file, at most ``limit`` bytes of it (-1: all; compressed files
    count their uncompressed bytes)."""
    kind, compression = kind_of(path)
    if kind == "parquet":
        return read_parquet(path, limit, text_key)
    try:
        with _open(path, compression) as f:
            if kind == "jsonl":
                return read_jsonl_stream(f, path, limit, text_key)
            return _read_text(f, limit)
    except (OSError, EOFError) as error:
        if isinstance(error, (gzip.BadGzipFile, EOFError)) or compression is not None:
            raise ConfigError(f"{path}: cannot be decompressed ({error}); is it really "
                              f"{compression}-compressed?") from None
        raise ConfigError(f"{path}: cannot be read ({error})") from None


def _read_text(f: IO[bytes], limit: int) -> FileDocuments:
    head = f.read(SNIFF_BYTES if limit < 0 else min(SNIFF_BYTES, limit))
    if is_binary(head):
        return FileDocuments([], 0, binary=True)
    rest = f.read(-1 if limit < 0 else limit - len(head))
    cut = limit >= 0 and bool(f.read(1))
    data = head + rest
    return FileDocuments([data], len(data), truncated=cut)


def is_binary(head: bytes) -> bool:
    """Whether a file's first bytes say it is not text: a NUL byte, or not UTF-8 (a character
    cut at the end of ``head`` is allowed)."""
    if b"\0" in head:
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as error:
        return error.start < len(head) - 3
    return False


def read_jsonl_stream(f: IO[bytes], path: Path, limit: int, text_key: str = "text"
                      ) -> FileDocuments:
    """The ``text_key`` of each record (UTF-8), whole lines only, at most ``limit`` bytes; a
    line longer than MAX_LINE_BYTES is refused unread past that bound."""
    documents: list[bytes] = []
    used, number = 0, 0
    while True:
        number += 1
        bound = MAX_LINE_BYTES if limit < 0 else min(MAX_LINE_BYTES, limit - used)
        line = f.readline(bound + 1)
        if not line:
            return FileDocuments(documents, used)
        if len(line) > bound:
            if bound < MAX_LINE_BYTES:
                return FileDocuments(documents, used, truncated=True)
            raise ConfigError(f"{path}:{number}: the line is longer than {MAX_LINE_BYTES >> 20} "
                              "MiB (MAX_LINE_BYTES); split that document")
        used += len(line)
        if line.strip():
            documents.append(_record_text(line, path, number, text_key))


def _record_text(line: bytes, path: Path, number: int, text_key: str) -> bytes:
    where = f"{path}:{number}"
    try:
        record = json.loads(line)
    except RecursionError:
        raise ConfigError(f"{where}: the record is nested too deeply to read") from None
    except ValueError as error:  # JSONDecodeError, bad UTF-8, a number of too many digits
        raise ConfigError(f"{where}: not a JSON object ({str(error)[:200]}); a .jsonl file "
                          f"holds one {{\"{text_key}\": ...}} object per line") from None
    text = record.get(text_key) if isinstance(record, dict) else None
    if not isinstance(text, str):
        keys = sorted(record)[:5] if isinstance(record, dict) else "-"
        raise ConfigError(f"{where}: the record has no \"{text_key}\" string (keys {keys}); "
                          "name the text field with --text-key")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ConfigError(f"{where}: the \"{text_key}\" string holds a lone surrogate "
                          f"({error.object[error.start:error.end]!r}), which is not text; "
                          "fix that record") from None


def _column_documents(column: Any, origin: str, limit: int) -> FileDocuments:
    documents: list[bytes] = []
    used = 0
    for row, text in enumerate(column):
        if not isinstance(text, str):
            raise ConfigError(f"{origin}: row {row} is {type(text).__name__}, not text")
        data = text.encode("utf-8", errors="replace")
        if limit >= 0 and used + len(data) > limit:
            return FileDocuments(documents, used, truncated=True)
        documents.append(data)
        used += len(data)
    return FileDocuments(documents, used)


def read_parquet(path: Path, limit: int, text_key: str = "text") -> FileDocuments:
    """The ``text_key`` column of a Parquet file, a row a document, read a row group at a
    time."""
    parquet = import_extra("pyarrow.parquet", f"{path} (Parquet)")
    try:
        reader = parquet.ParquetFile(path)
    except Exception as error:
        raise ConfigError(f"{path}: not a readable Parquet file ({error})") from None
    if text_key not in reader.schema_arrow.names:
        raise ConfigError(f"{path}: no column {text_key!r} (columns "
                          f"{reader.schema_arrow.names[:8]}); name it with --text-key")

    def rows() -> Iterator[Any]:
        for group in range(reader.num_row_groups):
            yield from reader.read_row_group(group, columns=[text_key]).column(0).to_pylist()

    return _column_documents(rows(), str(path), limit)


def store_paths(source: Path) -> tuple[Path, Path, Path] | None:
    """(header, tokens, documents) when ``source`` is a token store or a ``.bin`` with a
    header beside it, else None."""
    if source.is_dir() and (source / HEADER).is_file():
        return source / HEADER, source / TOKENS, source / DOCUMENTS
    if source.is_file() and source.suffix.lower() == ".bin":
        return source.with_suffix(".json"), source, source.with_suffix(".idx")
    return None


def is_token_source(source: str | Path | None) -> bool:
    """Whether the source is pre-tokenised (a token store, or a ``.bin`` of ids)."""
    return (source is not None and not str(source).startswith(HF_PREFIX)
            and store_paths(Path(source)) is not None)


def is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``datasets``' ``save_to_disk``."""
    return path.is_dir() and any((path / name).is_file()
                                 for name in ("dataset_info.json", "dataset_dict.json"))


def read_hf_dataset(source: str, limit: int, text_key: str = "text") -> FileDocuments:
    """The ``text_key`` column of a saved dataset folder or ``hf:NAME[:SPLIT]`` from the
    local cache (offline: a dataset not cached is an error, never a download)."""
    datasets = import_extra("datasets", f"--data {source}")
    try:
        dataset = _load_hf(datasets, source)
    except ConfigError:
        raise
    except Exception as error:
        raise ConfigError(f"--data {source}: the datasets package cannot load it "
                          f"({str(error)[:300]}); nothing is downloaded: save it with "
                          "save_to_disk or load it once online") from None
    if text_key not in dataset.column_names:
        raise ConfigError(f"--data {source}: no column {text_key!r} (columns "
                          f"{dataset.column_names[:8]}); name it with --text-key")
    return _column_documents((row[text_key] for row in dataset), source, limit)


def _load_hf(datasets: Any, source: str) -> Any:
    if source.startswith(HF_PREFIX):
        name, _, split = source[len(HF_PREFIX):].partition(":")
        datasets.config.HF_HUB_OFFLINE = True
        datasets.config.HF_DATASETS_OFFLINE = True
        return datasets.load_dataset(name, split=split or "train")
    dataset = datasets.load_from_disk(source)
    if isinstance(dataset, datasets.DatasetDict):
        split = "train" if "train" in dataset else sorted(dataset)[0]
        dataset = dataset[split]
    return dataset


def read_sources(files: list[Path], root: Path, max_bytes: int | None, text_key: str,
                 read: Callable[[Path, int, str], FileDocuments] = read_file
                 ) -> tuple[list[bytes], list[tuple[str, int]], int, bool]:
    """Read ``files`` in order up to ``max_bytes``: (documents, [(name, bytes read)],
    binary files skipped, whether the cap cut the data)."""
    documents: list[bytes] = []
    used: list[tuple[str, int]] = []
    size, skipped = 0, 0
    for path in files:
        if max_bytes is not None and size >= max_bytes:
            return documents, used, skipped, True
        got = read(path, -1 if max_bytes is None else max_bytes - size, text_key)
        if got.binary:
            skipped += 1
            continue
        documents.extend(got.documents)
        used.append((path.relative_to(root).as_posix(), got.nbytes))
        size += got.nbytes
        if got.truncated:
            return documents, used, skipped, True
    return documents, used, skipped, False


@dataclass(frozen=True)
class Corpus:
    """The text read, where from (``origin``, ``files`` in reading order, ``file_bytes`` read
    from each), whether ``max_bytes`` cut it short, where each document ends in ``data``
    (a plain file is one document, a JSON-lines record or a row another), and how many binary
    files were skipped."""

    data: bytes = field(repr=False)
    files: tuple[str, ...]
    origin: str
    truncated: bool
    file_bytes: tuple[int, ...] = ()
    document_ends: tuple[int, ...] = ()
    skipped: int = 0

    def documents(self) -> list[bytes]:
        """The documents, in order."""
        ends = self.document_ends or (len(self.data),)
        return [self.data[a:b] for a, b in zip((0, *ends[:-1]), ends)]




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


def user_files(source: Path) -> tuple[Path, list[Path]]:
    """(root, files) a user's file or folder names: every non-hidden file, sorted by path."""
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


def is_hf_source(source: str | Path | None) -> bool:
    """Whether the source is a ``datasets`` dataset (``hf:NAME`` or a saved folder)."""
    return source is not None and (str(source).startswith(HF_PREFIX)
                                   or is_saved_dataset(Path(source)))


def read_corpus(config: DataConfig) -> Corpus:
    """Read the configured source's documents in a fixed order, up to the byte cap (the
    built-in corpus: ``STDLIB_MAX_BYTES`` unless ``max_bytes`` says otherwise)."""
    if is_hf_source(config.source):
        got = read_hf_dataset(str(config.source), -1 if config.max_bytes is None
                              else config.max_bytes, config.text_key)
        documents, used = got.documents, [(str(config.source), got.nbytes)]
        origin, skipped, truncated = f"dataset {config.source}", 0, got.truncated
    else:
        cap = config.max_bytes
        if config.source is None:
            root, files = _stdlib_files(config.stdlib_packages)
            origin = f"Python standard library ({', '.join(config.stdlib_packages)}) in {root}"
            cap = STDLIB_MAX_BYTES if cap is None else cap
        else:
            root, files = user_files(Path(config.source))
            origin = str(config.source)
        documents, used, skipped, truncated = read_sources(files, root, cap, config.text_key)
    data = b"".join(documents)
    if not data and truncated:
        raise ConfigError(f"--max-bytes {cap} ends before the first whole line or document of "
                          f"{origin}; raise it")
    if not data:
        note = f" ({skipped} binary file(s) skipped)" if skipped else ""
        raise ConfigError(f"data source {origin} is empty{note}; give it some text")
    ends = tuple(itertools.accumulate(len(c) for c in documents if c))
    return Corpus(data=data, files=tuple(n for n, _ in used), origin=origin, truncated=truncated,
                  file_bytes=tuple(b for _, b in used), document_ends=ends, skipped=skipped)
