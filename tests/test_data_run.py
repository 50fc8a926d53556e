"""Training on real data end to end: one `pipeoffload train` over 2 gloo processes reads a folder
of every file kind through a BPE tokenizer (binaries skipped, the token cache filled by the
up-front check and memory-mapped by the ranks); a pre-tokenised store trains, stops mid-epoch
and resumes bitwise; resuming with other data is refused before any process starts."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")

from test_data_sources import mixed_folder

from pipeoffload.errors import ConfigError
from pipeoffload.parallel.topology import Topology
from pipeoffload.training.data import TextDataset
from pipeoffload.training.data_config import DataConfig
from pipeoffload.training.model_config import model_preset
from pipeoffload.training.run_checks import check_run
from pipeoffload.training.token_store import write_store
from pipeoffload.training.train import TrainConfig
from pipeoffload.training.trainer import train

pytestmark = [pytest.mark.torch, pytest.mark.slow]


def bpe_tokenizer(folder: Path, text: list[str]) -> Path:
    from tokenizers import models, pre_tokenizers, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_a_folder_of_every_kind_trains_on_two_processes_through_the_token_cache(tmp_path):
    data = tmp_path / "data"
    documents = mixed_folder(data)
    (data / "long.txt").write_text("the quick brown fox jumps over the lazy dog. " * 300)
    tok = bpe_tokenizer(tmp_path / "tok", [d.decode() for d in documents] * 10)
    cache = tmp_path / "cache"
    argv = ["train", "--model", "tiny", "--pp", "2", "--steps", "3", "--data", str(data),
            "--tokenizer", str(tok), "--cache-dir", str(cache), "--seq-len", "16",
            "--batch-size", "4", "--eval-fraction", "0", "--no-png", "--no-baseline",
            "--p2p-timeout", "60", "--json"]
    proc = subprocess.run([sys.executable, "-m", "pipeoffload.cli", *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["losses"]) == 3 and all(x == x for x in result["losses"])
    assert "2 binary file(s) skipped; end-of-document id 0 between documents" in proc.stderr
    for name in ("b.JSONL", "c.jsonl.gz", "e.txt.gz", "f.jsonl.zst", "g.parquet"):
        assert name in proc.stderr
    stores = list((cache / "tokens").iterdir())
    assert len(stores) == 1  # the check tokenised once; both ranks memory-mapped it
    header = json.loads((stores[0] / "tokens.json").read_text())
    assert header["eos"] == 0 and header["documents"] == len(documents) + 1


def cached_hub_dataset(hf_home: Path, repo_id: str, rows: list[str]) -> None:
    """``repo_id`` in ``hf_home``'s datasets cache as ``load_dataset(repo_id)`` online leaves it
    (``<owner>___<name>/default/0.0.0/<hash>/<name>-train.arrow``), written offline by the
    library's own JSON builder."""
    from datasets.packaged_modules.json.json import Json

    hf_home.mkdir()
    data = hf_home / "rows.jsonl"
    data.write_text("".join(json.dumps({"text": row}) + "\n" for row in rows))
    builder = Json(cache_dir=str(hf_home / "datasets"), dataset_name=repo_id.split("/")[1],
                   data_files={"train": str(data)}, hash="0123abcd", config_id="default")
    builder.repo_id = repo_id  # the hub name: a data file not in the repo is refused by __init__
    builder._cache_dir = builder._build_cache_dir()
    builder.download_and_prepare()


def test_a_saved_dataset_and_a_cached_hub_name_train_on_two_processes(tmp_path):
    """`--data DATASET_FOLDER` (save_to_disk) and `--data hf:OWNER/NAME` (the local cache, with
    downloads off) each train 3 steps on 2 gloo processes; one Python process runs both
    commands, so their start-up is paid once."""
    datasets = pytest.importorskip("datasets")
    rows = [f"row {i}: the quick brown fox jumps over the lazy dog. " * 3 for i in range(40)]
    datasets.Dataset.from_dict({"body": rows}).save_to_disk(tmp_path / "saved")
    cached_hub_dataset(tmp_path / "hf", "pipeoffload-test/tiny", rows)
    common = ["--model", "tiny", "--pp", "2", "--steps", "3", "--seq-len", "16",
              "--batch-size", "4", "--eval-fraction", "0", "--no-png", "--no-baseline",
              "--p2p-timeout", "60", "--json"]
    runs = [["train", "--data", str(tmp_path / "saved"), "--text-key", "body", *common],
            ["train", "--data", "hf:pipeoffload-test/tiny", *common]]
    script = ("import sys\nfrom pipeoffload.cli.main import main\n"
              f"sys.exit(max(main(argv) for argv in {runs!r}))\n")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 2, proc.stdout[-4000:]
    for result in results:
        assert len(result["losses"]) == 3 and all(x == x for x in result["losses"])
    # the same rows through both sources: the same tokens, the same training
    assert results[0]["losses"] == results[1]["losses"]


def store_config(source: Path, **changes) -> TrainConfig:
    data = DataConfig(source=source, seq_len=16, batch_size=4, eval_fraction=0.1)
    config = TrainConfig(model=model_preset("tiny"), data=data, pp=2, microbatches=2, steps=4,
                         measure_baseline=False, grad_clip=None)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=500))
    return dataclasses.replace(config, **changes)


def test_a_streamed_store_resumes_mid_epoch_bitwise_and_other_data_is_refused(tmp_path):
    import random

    rng = random.Random(0)
    docs = [[rng.randrange(2, 500) for _ in range(rng.randrange(20, 90))] for _ in range(80)]
    store = write_store(tmp_path / "store", docs, eos=1, vocab_size=500)
    config = store_config(store, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2)
    assert TextDataset.from_config(config.data).num_train_windows > 4 * 4 * 2  # mid-epoch
    straight = train(config, Topology.local(2))
    (tmp_path / "ck" / "step_00000004").rename(tmp_path / "later")
    resumed = train(dataclasses.replace(config, resume="auto"), Topology.local(2))
    assert resumed.losses == straight.losses[2:]
    other = write_store(tmp_path / "other", docs[::-1], eos=1, vocab_size=500)
    with pytest.raises(ConfigError, match="saved with data_identity="):
        check_run(store_config(other, checkpoint_dir=str(tmp_path / "ck"), resume="auto",
                               steps=6), 1)


def test_a_missing_hf_extra_is_found_before_any_process_starts(tmp_path, monkeypatch):
    """Without transformers, --model PATH is refused by the up-front check (one error), not by
    every rank after the processes start."""
    from pipeoffload.errors import IntegrationError

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_act": "silu"}))
    config = TrainConfig(data=DataConfig(seq_len=16, batch_size=4), pp=2, microbatches=2,
                         steps=1, hf_model=str(tmp_path / "m"), measure_baseline=False)
    for name in [m for m in sys.modules if m.startswith(("transformers", "pipeoffload.hf",
                                                         "pipeoffload.integrations.hf"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(IntegrationError, match=r"pip install 'pipeoffload\[hf\]'"):
        check_run(config, 2)
