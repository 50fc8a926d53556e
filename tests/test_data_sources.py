"""Data sources read as what they are (training/sources.py, token_store.py, token_cache.py):
binaries skipped, compressed and columnar files decoded, hostile JSON lines refused by line,
pre-tokenised stores memory-mapped, the token cache hit, EOS between documents, the held-out
split by whole documents, and an exact mid-epoch resume from a streamed store."""

from __future__ import annotations

import gzip
import itertools
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pipeoffload.errors import ConfigError
from pipeoffload.training import sources, token_cache
from pipeoffload.training.data import (
    BYTE_EOS,
    DataConfig,
    TextDataset,
    byte_store,
    load_corpus,
    load_tokens,
    split_documents,
)
from pipeoffload.training.token_store import open_store, write_store

pytestmark = pytest.mark.torch

PNG = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(range(256))


def jsonl(records: list[object]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def mixed_folder(root: Path) -> list[bytes]:
    """A folder of every file kind; returns the documents it holds, in reading order."""
    (root / "__pycache__").mkdir(parents=True)
    (root / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\xa7\r\r\n\0\0\0\0" + PNG)
    (root / "a.txt").write_text("plain text, one document\n")
    (root / "b.JSONL").write_bytes(jsonl([{"text": "upper-case suffix"}, {"text": "two"}]))
    (root / "c.jsonl.gz").write_bytes(gzip.compress(jsonl([{"text": "gzipped line"}])))
    (root / "d.png").write_bytes(PNG)
    (root / "e.txt.gz").write_bytes(gzip.compress(b"gzipped text file"))
    documents = [b"plain text, one document\n", b"upper-case suffix", b"two", b"gzipped line",
                 b"gzipped text file"]
    zstandard = pytest.importorskip("zstandard")
    (root / "f.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(jsonl([{"text": "zstd line"}])))
    documents.append(b"zstd line")
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pyarrow.table({"text": ["parquet row 1", "parquet row 2"], "n": [1, 2]}),
                   root / "g.parquet", row_group_size=1)
    documents += [b"parquet row 1", b"parquet row 2"]
    return documents


def test_each_file_kind_is_read_as_what_it_is(tmp_path: Path) -> None:
    documents = mixed_folder(tmp_path)
    corpus = load_corpus(DataConfig(source=tmp_path))
    assert corpus.documents() == documents
    assert corpus.skipped == 2 and "d.png" not in corpus.files
    assert not any(name.endswith(".pyc") for name in corpus.files)
    store = byte_store(corpus)
    assert bytes(store.tokens.tolist()) == bytes([BYTE_EOS]).join(documents)
    assert store.ends[-1] == len(store) and len(store.ends) == len(documents)


def test_binary_only_sources_and_missing_extras_are_clear(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "x.png").write_bytes(PNG)
    with pytest.raises(ConfigError, match=r"is empty \(1 binary file\(s\) skipped\)"):
        load_corpus(DataConfig(source=tmp_path))
    (tmp_path / "y.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ConfigError, match="y.jsonl.gz: cannot be decompressed"):
        load_corpus(DataConfig(source=tmp_path / "y.jsonl.gz"))
    (tmp_path / "z.jsonl.zst").write_bytes(b"whatever")
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(ConfigError, match=r"needs zstandard.*pipeoffload\[zstd\]"):
        load_corpus(DataConfig(source=tmp_path / "z.jsonl.zst"))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    with pytest.raises(ConfigError, match=r"needs pyarrow.parquet.*pipeoffload\[parquet\]"):
        load_corpus(DataConfig(source=tmp_path / "t.parquet"))


@pytest.mark.parametrize(("line", "says"), [
    (b'{"text": "a\\ud800b"}', "lone surrogate"),
    (b'{"text": "x", "n": ' + b"9" * 5000 + b"}", "not a JSON object"),
    (b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    (b'{"body": "no text"}', 'no "text" string'),
    (b"\xff\xfe not utf-8", "not a JSON object"),
])
def test_hostile_json_lines_name_the_line(tmp_path: Path, line: bytes, says: str) -> None:
    path = tmp_path / "d.JSONL"
    path.write_bytes(b'{"text": "fine"}\n\n' + line + b"\n")
    with pytest.raises(ConfigError, match=f"d.JSONL:3: .*{says}"):
        load_corpus(DataConfig(source=path))


def test_a_json_line_past_the_bound_is_refused_unread(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sources, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "long.jsonl"
    path.write_bytes(jsonl([{"text": "ok"}, {"text": "x" * 50_000}]))
    reads: list[int] = []

    class Spy:
        def __init__(self, f):
            self.f = f

        def readline(self, size: int = -1) -> bytes:
            reads.append(size)
            return self.f.readline(size)

    with path.open("rb") as f, pytest.raises(ConfigError, match="long.jsonl:2: .*longer than"):
        sources.read_jsonl_stream(Spy(f), path, -1)  # type: ignore[arg-type]
    assert reads == [1001, 1001]  # never more than the bound (+1) in memory
    capped = load_corpus(DataConfig(source=path, max_bytes=100))
    assert capped.documents() == [b"ok"] and capped.truncated
    with pytest.raises(ConfigError, match="--max-bytes 5 ends before the first whole line"):
        load_corpus(DataConfig(source=path, max_bytes=5))


def test_a_saved_dataset_is_read_and_an_uncached_name_is_not_downloaded(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"body": ["row one", "row two"]}).save_to_disk(tmp_path / "ds")
    corpus = load_corpus(DataConfig(source=tmp_path / "ds", text_key="body"))
    assert corpus.documents() == [b"row one", b"row two"]
    with pytest.raises(ConfigError, match="no column 'text'"):
        load_corpus(DataConfig(source=tmp_path / "ds"))
    with pytest.raises(ConfigError, match="nothing is downloaded"):
        load_corpus(DataConfig(source="hf:pipeoffload-test/no-such-dataset-anywhere"))


def test_token_store_round_trip_and_foreign_binaries(tmp_path: Path) -> None:
    docs = [[5, 6, 7], [], [8], [70_000 % 65_536, 9]]
    write_store(tmp_path / "s", docs, eos=1, vocab_size=65_536)
    store = open_store(tmp_path / "s")
    assert store.tokens.dtype == torch.uint16 and store.eos == 1
    assert store.tokens.tolist() == [5, 6, 7, 1, 8, 1, 4464, 9] and store.ends == (4, 6, 8)
    big = write_store(tmp_path / "b", [[70_000, 2]], eos=None, vocab_size=70_001)
    assert open_store(big).tokens.dtype == torch.uint32
    bare = tmp_path / "nano.bin"
    bare.write_bytes(torch.tensor([3, 4, 5], dtype=torch.int16).numpy().tobytes())
    with pytest.raises(ConfigError, match=r"needs a header .*nano.json"):
        open_store(bare)
    (tmp_path / "nano.json").write_text('{"dtype": "uint16"}')
    foreign = open_store(bare)
    assert foreign.tokens.tolist() == [3, 4, 5] and foreign.ends == (3,)
    assert foreign.vocab_size == 6 and len(foreign.identity) == 64
    (tmp_path / "s" / "tokens.bin").write_bytes(b"\0" * 6)
    with pytest.raises(ConfigError, match="says 8 tokens but .* holds 3"):
        open_store(tmp_path / "s")


def word_tokenizer(folder: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    words = ["[UNK]", "<|endoftext|>", "a", "b", "c", "d"]
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_the_token_cache_tokenises_once_with_eos_between_documents(tmp_path: Path,
                                                                    monkeypatch) -> None:
    tok = word_tokenizer(tmp_path / "tok")
    (tmp_path / "d.jsonl").write_bytes(jsonl([{"text": "a b"}, {"text": "c"}, {"text": "d a"}]))
    config = DataConfig(source=tmp_path / "d.jsonl", tokenizer=str(tok),
                        cache_dir=str(tmp_path / "cache"))
    key = token_cache.cache_key(config)
    store = load_tokens(config)
    assert (tmp_path / "cache" / "tokens" / key / "tokens.bin").is_file()
    assert store.tokens.tolist() == [2, 3, 1, 4, 1, 5, 2] and store.eos == 1
    monkeypatch.setattr(token_cache, "write_tokens", lambda *a: pytest.fail("tokenised again"))
    again = load_tokens(config)
    assert again.identity == store.identity and again.tokens.tolist() == store.tokens.tolist()
    (tmp_path / "d.jsonl").write_bytes(jsonl([{"text": "b"}]))  # other data: another key
    assert token_cache.cache_key(config) != key


def test_a_cached_run_reports_its_data_from_the_store_without_reading_the_text(
        tmp_path: Path, monkeypatch) -> None:
    """The data line of a run whose tokens are cached is the one reading the text gives
    (files, bytes, binary files skipped, the cut), taken from the store's header."""
    from pipeoffload.cli import notes
    from pipeoffload.training import data as data_module

    tok = word_tokenizer(tmp_path / "tok")
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_bytes(jsonl([{"text": "a b"}, {"text": "c"}]))
    (data / "b.txt").write_text("d a b c " * 20)
    (data / "0.png").write_bytes(PNG)  # read first: skipped before the cap too
    for cap in (None, 40):
        config = DataConfig(source=data, tokenizer=str(tok), cache_dir=str(tmp_path / "cache"),
                            max_bytes=cap)
        assert token_cache.cached_report(config) is None  # nothing cached yet
        read = notes.data_line(config)
        load_tokens(config)
        monkeypatch.setattr(data_module, "load_corpus",
                            lambda _: pytest.fail("the text read again"))
        assert notes.data_line(config) == read
        assert "1 binary file(s) skipped" in read and ("cut at" in read) == (cap is not None)
        monkeypatch.undo()


def test_held_out_split_takes_whole_documents_by_seed() -> None:
    docs = [bytes([65 + i % 26]) * (10 + i) for i in range(40)]
    data = b"".join(docs)
    from pipeoffload.training.data import Corpus

    ends = tuple(sum(len(d) for d in docs[: i + 1]) for i in range(len(docs)))
    store = byte_store(Corpus(data=data, files=("m",), origin="m", truncated=False,
                              document_ends=ends))
    spans = list(zip((0, *store.ends[:-1]), store.ends))
    for seed in (0, 1):
        train, held = split_documents(store, 0.1, seed)
        held_tokens = sum(b - a for a, b in held)
        assert 0.1 * len(store) <= held_tokens < 0.1 * len(store) + max(b - a for a, b in spans)
        for a, b in held:  # every held-out range is a run of whole documents
            assert a in (0, *store.ends) and b in store.ends
        covered = sorted(train + held)
        assert covered[0][0] == 0 and covered[-1][1] == len(store)
        assert all(x[1] == y[0] for x, y in zip(covered, covered[1:]))
    assert split_documents(store, 0.1, 0)[1] != split_documents(store, 0.1, 1)[1]


def readable_split(ends: tuple[int, ...], eval_fraction: float, seed: int
                   ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """[held-out split] as it reads (data.py): documents drawn in a seeded order until they
    hold the target, never every document; each split's documents merged into runs."""
    import math
    import random

    target = math.floor(ends[-1] * eval_fraction)
    spans = list(zip((0, *ends[:-1]), ends))
    order = list(range(len(spans)))
    random.Random(f"{seed}:held-out").shuffle(order)
    held: set[int] = set()
    size = 0
    for d in order[:-1]:
        if size >= target:
            break
        held.add(d)
        size += spans[d][1] - spans[d][0]

    def runs(chosen: list[tuple[int, int]]) -> list[tuple[int, int]]:
        merged: list[tuple[int, int]] = []
        for a, b in chosen:
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        return merged

    return (runs([s for d, s in enumerate(spans) if d not in held]),
            runs([s for d, s in enumerate(spans) if d in held]))


@pytest.mark.parametrize("documents", [2, 3, 17, 400])
def test_the_held_out_split_equals_its_readable_rule(documents: int) -> None:
    """split_documents (work in the held documents only) against the rule it shortcuts, over
    document sizes from one token up and fractions up to nearly all of the data."""
    import random

    from pipeoffload.training.token_store import TokenStore

    rng = random.Random(documents)
    for trial in range(20):
        sizes = [rng.choice((1, 2, rng.randrange(1, 500))) for _ in range(documents)]
        ends = tuple(itertools.accumulate(sizes))
        store = TokenStore(torch.zeros(ends[-1], dtype=torch.uint16), ends, None, 2, "t", "x")
        for fraction in (0.01, 0.05, 0.3, 0.9, 0.99):
            assert split_documents(store, fraction, trial) == readable_split(
                ends, fraction, trial), (sizes, fraction)


def test_resume_mid_epoch_from_a_memory_mapped_store_is_exact(tmp_path: Path) -> None:
    import random

    rng = random.Random(3)
    docs = [[rng.randrange(2, 1000) for _ in range(rng.randrange(5, 60))] for _ in range(60)]
    write_store(tmp_path / "s", docs, eos=1, vocab_size=1000)
    config = DataConfig(source=tmp_path / "s", seq_len=16, batch_size=4, eval_fraction=0.1)
    first = TextDataset.from_config(config)
    per_epoch = first.num_train_windows // 4
    batches = [next(first) for _ in range(per_epoch + 3)]
    resumed = TextDataset.from_config(config)
    middle = per_epoch // 2
    replay = TextDataset.from_config(config)
    for _ in range(middle):
        next(replay)
    resumed.load_state_dict(replay.state_dict())
    for expected in batches[middle:]:
        got = next(resumed)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    other = DataConfig(source=tmp_path / "s", seq_len=16, batch_size=4, eval_fraction=0.2)
    with pytest.raises(ConfigError, match="saved with data_identity="):
        TextDataset.from_config(other).load_state_dict(replay.state_dict())


def test_pipeoffload_tokenize_writes_the_store_the_cache_would(tmp_path: Path, capsys) -> None:
    from pipeoffload.cli.main import main

    tok = word_tokenizer(tmp_path / "tok")
    (tmp_path / "d.jsonl").write_bytes(jsonl([{"body": "a b"}, {"body": "c d"}]))
    argv = ["tokenize", str(tmp_path / "d.jsonl"), str(tmp_path / "out"), "--tokenizer",
            str(tok), "--text-key", "body"]
    assert main(argv) == 0
    assert "wrote 5 tokens in 2 documents" in capsys.readouterr().out
    store = open_store(tmp_path / "out")
    assert store.tokens.tolist() == [2, 3, 1, 4, 5] and store.ends == (3, 5)
    assert len(TextDataset.from_config(DataConfig(source=tmp_path / "out", seq_len=2,
                                                  batch_size=2, eval_fraction=0)).train) == 5
    assert main(argv) == 2  # OUT is not empty now
    assert "is not empty" in capsys.readouterr().err
