"""Byte-level data: sources, batches, determinism, data-parallel sharding, resume, errors."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pipeoffload.errors import ConfigError
from pipeoffload.training.data import (
    Corpus,
    DataConfig,
    TextDataset,
    decode,
    encode,
    load_corpus,
)

pytestmark = pytest.mark.torch

SEQ, BATCH = 8, 4


def random_text(n: int, seed: int = 0) -> bytes:
    # Random bytes make every window distinct, so a window identifies where it came from.
    return random.Random(seed).randbytes(n)


def dataset(
    data: bytes, *, dp_rank: int = 0, dp_size: int = 1, **changes: object
) -> TextDataset:
    config = dataclasses.replace(
        DataConfig(seq_len=SEQ, batch_size=BATCH, eval_fraction=0.0), **changes
    )
    corpus = Corpus(data=data, files=("mem",), origin="test text", truncated=False)
    return TextDataset(corpus, config, dp_rank=dp_rank, dp_size=dp_size)


def windows_of(data: bytes) -> list[bytes]:
    """Every non-overlapping window of SEQ + 1 bytes, in order (the training split's units)."""
    return [data[i * SEQ: i * SEQ + SEQ + 1] for i in range((len(data) - 1) // SEQ)]


def rows(inputs: torch.Tensor, targets: torch.Tensor) -> list[bytes]:
    return [bytes(row.tolist()) + bytes([t[-1].item()]) for row, t in zip(inputs, targets)]


# ---- tokens and batches ----------------------------------------------------------------------


def test_encode_decode_round_trip_bytes() -> None:
    text = "def f(x):\n    return 'héllo' ✓"
    ids = encode(text)
    assert ids.dtype == torch.int64 and ids.tolist() == list(text.encode("utf-8"))
    assert decode(ids) == text
    assert decode([0xFF, 0x41]) == "\ufffdA"


def test_batches_are_shifted_windows_of_the_text() -> None:
    data = random_text(8 * 40 + 1)
    ds = dataset(data)
    inputs, targets = next(ds)
    assert inputs.shape == targets.shape == (BATCH, SEQ)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    all_windows = windows_of(data)
    assert all(row in all_windows for row in rows(inputs, targets))


def test_one_epoch_visits_every_training_window_once() -> None:
    data = random_text(SEQ * 24 + 1)  # 24 windows = 6 batches of 4
    ds = dataset(data)
    seen = [row for _ in range(6) for row in rows(*next(ds))]
    assert sorted(seen) == sorted(windows_of(data))
    assert seen != windows_of(data)  # shuffled
    assert ds.epoch == 1.0
    next_epoch = [row for _ in range(6) for row in rows(*next(ds))]
    assert sorted(next_epoch) == sorted(seen) and next_epoch != seen


def test_order_is_determined_by_the_seed() -> None:
    data = random_text(SEQ * 50 + 1)
    first, again, other = dataset(data), dataset(data), dataset(data, seed=1)
    batches = [next(first) for _ in range(5)]
    for x, y in batches:
        x2, y2 = next(again)
        assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(first.batch_at(2)[0], batches[2][0])  # batch_at does not move the position
    assert first.step == 5
    assert not torch.equal(first.batch_at(0)[0], other.batch_at(0)[0])


@pytest.mark.parametrize("dp_size", [2, 4])
def test_replicas_together_see_the_single_replica_batch(dp_size: int) -> None:
    data = random_text(SEQ * 22 + 5)  # 22 windows: batches cross epoch boundaries
    single = dataset(data)
    replicas = [dataset(data, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    for step in range(12):
        parts = [next(rep) for rep in replicas]
        assert all(p[0].shape == (BATCH // dp_size, SEQ) for p in parts)
        x, y = next(single)
        assert torch.equal(torch.cat([p[0] for p in parts]), x), step
        assert torch.equal(torch.cat([p[1] for p in parts]), y), step


def test_state_round_trip_resumes_with_the_same_batches() -> None:
    data = random_text(SEQ * 30 + 1)
    original = dataset(data)
    for _ in range(9):
        next(original)
    state = original.state_dict()
    expected = [next(original) for _ in range(4)]

    resumed = dataset(data)
    resumed.load_state_dict(state)
    assert resumed.step == 9
    for x, y in expected:
        x2, y2 = next(resumed)
        assert torch.equal(x, x2) and torch.equal(y, y2)

    halves = [dataset(data, dp_rank=r, dp_size=2) for r in range(2)]  # resume on 2 replicas
    for half in halves:
        half.load_state_dict(state)
    x, _ = expected[0]
    assert torch.equal(torch.cat([next(h)[0] for h in halves]), x)


@pytest.mark.parametrize(("changes", "key"), [
    ({"seed": 1}, "seed"), ({"seq_len": 4}, "seq_len"), ({"batch_size": 2}, "batch_size"),
])
def test_state_from_other_data_is_refused(changes: dict, key: str) -> None:
    data = random_text(SEQ * 30 + 1)
    state = dataset(data).state_dict()
    with pytest.raises(ConfigError, match=f"saved with {key}="):
        dataset(data, **changes).load_state_dict(state)
    with pytest.raises(ConfigError, match="saved with data_identity="):
        dataset(random_text(SEQ * 30 + 1, seed=5)).load_state_dict(state)
    with pytest.raises(ConfigError, match="invalid step"):
        dataset(data).load_state_dict({**state, "step": -1})


def test_eval_split_is_the_held_out_tail() -> None:
    data = random_text(1000)
    ds = dataset(data, eval_fraction=0.2)
    n_eval = 200
    assert bytes(ds.eval_tokens.tolist()) == data[-n_eval:]
    assert bytes(ds.train_tokens.tolist()) == data[:-n_eval]
    train_windows = set(windows_of(data[:-n_eval]))
    for _ in range(2 * ds.num_train_windows // BATCH):
        assert all(row in train_windows for row in rows(*next(ds)))
    batches = list(ds.eval_batches())
    assert len(batches) == ds.num_eval_batches == (n_eval - 1) // SEQ // BATCH
    assert [r for b in batches for r in rows(*b)] == windows_of(data[-n_eval:])[: 6 * BATCH]
    halves = [list(dataset(data, eval_fraction=0.2, dp_rank=r, dp_size=2).eval_batches())
              for r in range(2)]
    for whole, a, b in zip(batches, *halves):
        assert torch.equal(torch.cat([a[0], b[0]]), whole[0])


# ---- sources --------------------------------------------------------------------------------


def test_default_source_is_standard_library_python() -> None:
    config = DataConfig(max_bytes=50_000)
    corpus = load_corpus(config)
    assert len(corpus.data) == 50_000 and corpus.truncated
    assert list(corpus.files) == sorted(corpus.files)
    assert all(f.endswith(".py") and f.split("/")[0] in config.stdlib_packages
               for f in corpus.files)
    assert b"def " in corpus.data and b"import " in corpus.data
    assert load_corpus(config) == corpus


def test_folder_source_reads_sorted_visible_files(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_bytes(b"second ")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "z.txt").write_bytes(b"first ")
    (tmp_path / ".hidden").write_bytes(b"secret")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "x").write_bytes(b"secret")
    (tmp_path / "c.md").write_bytes(b"third")
    corpus = load_corpus(DataConfig(source=tmp_path))
    assert corpus.files == ("a/z.txt", "b.txt", "c.md")
    assert corpus.data == b"first second third" and not corpus.truncated
    capped = load_corpus(DataConfig(source=tmp_path, max_bytes=9))
    assert capped.data == b"first sec" and capped.truncated and capped.files == ("a/z.txt", "b.txt")
    exact = load_corpus(DataConfig(source=tmp_path / "c.md", max_bytes=5))
    assert exact.data == b"third" and not exact.truncated


def test_file_source_builds_a_dataset(tmp_path: Path) -> None:
    path = tmp_path / "text.txt"
    path.write_bytes(bytes(random.Random(0).choices(b"abcdefgh \n", k=3000)))
    ds = TextDataset.from_config(DataConfig(source=str(path), seq_len=16, batch_size=4))
    x, y = next(ds)
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert "text.txt" in ds.summary()


# ---- errors ---------------------------------------------------------------------------------


def test_missing_and_empty_sources_are_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_corpus(DataConfig(source=tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ConfigError, match="empty.txt is empty"):
        load_corpus(DataConfig(source=tmp_path / "empty.txt"))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / ".only_hidden").write_bytes(b"x")
    with pytest.raises(ConfigError, match="holds no files"):
        load_corpus(DataConfig(source=folder))
    with pytest.raises(ConfigError, match="none of the standard-library packages"):
        load_corpus(DataConfig(stdlib_packages=("no_such_package_here",)))


def test_too_little_text_is_reported() -> None:
    with pytest.raises(ConfigError, match="make 3 windows .* one batch needs 4"):
        dataset(random_text(SEQ * 3 + 1))
    with pytest.raises(ConfigError, match="fewer than one batch needs"):
        dataset(random_text(SEQ * 30), eval_fraction=0.05)
    dataset(random_text(SEQ * 4 + 1))  # exactly one batch is enough


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"seq_len": 0}, "seq_len and batch_size must be >= 1"),
    ({"eval_fraction": 1.0}, "eval_fraction must be in"),
    ({"max_bytes": 0}, "max_bytes must be >= 1"),
    ({"stdlib_packages": "json"}, "tuple of names"),
    ({"stdlib_packages": ("../etc",)}, "must name standard-library packages"),
])
def test_invalid_data_configs_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        DataConfig(**kwargs)


def test_invalid_sharding_is_refused() -> None:
    data = random_text(SEQ * 30 + 1)
    with pytest.raises(ConfigError, match="does not split evenly over dp_size=3"):
        dataset(data, dp_size=3)
    with pytest.raises(ConfigError, match="dp_rank must be in"):
        dataset(data, dp_rank=2, dp_size=2)
