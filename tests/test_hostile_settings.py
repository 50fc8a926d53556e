"""Hostile or careless settings files, model configs, weight indices, hardware files and
checkpoints (issue 40, items 6-8, 10, 11, 13, 15, 16): each is one `error:` line naming the
file and the key, refused before any work, never a traceback, a hang or gigabytes read."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from cli_calls import run
from test_runtime_support import one_thread  # noqa: F401 - autouse fixture

from pipeoffload.cli.main import main

LLAMA = dict(vocab_size=256, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
             head_dim=8)
TEXT = "a small text to train a tiny model on, twice over. " * 40
TRAIN = ["train", "--data", "text.txt", "--seq-len", "16", "--batch-size", "4", "--pp", "1",
         "--steps", "1", "--no-png", "--no-baseline"]


def refused(code: int, err: str, *words: str) -> None:
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err
    assert all(word in lines[0] for word in words), err


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A Llama config without hidden_act (transformers' default, silu, applies), trained one
    step with a checkpoint: the config is accepted, and the checkpoint is edited below."""
    root = tmp_path_factory.mktemp("hostile")
    folder = root / "llama"
    transformers.LlamaConfig(**LLAMA).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    del config["hidden_act"]
    (folder / "config.json").write_text(json.dumps(config))
    (root / "text.txt").write_text(TEXT)
    before = Path.cwd()
    os.chdir(root)
    try:
        assert main([*TRAIN, "--model", "llama/config.json", "--checkpoint-dir", "ck"]) == 0
    finally:
        os.chdir(before)
    return root


@pytest.fixture
def here(trained: Path, tmp_path: Path, monkeypatch) -> Path:
    shutil.copytree(trained / "llama", tmp_path / "llama")
    (tmp_path / "text.txt").write_text(TEXT)
    monkeypatch.chdir(tmp_path)
    return tmp_path


CONFIG_CASES = [  # (config.json changes, words of the error line)
    ({"vocab_size": "abc"}, "vocab_size is 'abc'"),
    ({"num_hidden_layers": 4.0}, "num_hidden_layers is 4.0"),
    ({"num_hidden_layers": True}, "num_hidden_layers is True"),
    ({"hidden_size": {"nested": 16}}, "hidden_size is {'nested': 16}"),
    ({"rope_theta": "big"}, "rope_theta is 'big'"),
    ({"rope_scaling": {"rope_type": "weird", "factor": 2.0}}, "rope_type 'weird'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "x"}}, "factor is 'x'"),
    ({"hidden_act": 3}, "hidden_act is 3"),
    ({"vocab_size": 10**8}, "GiB for weights, gradients and AdamW state"),
    ({"vocab_size": 10**12}, "GiB for weights, gradients and AdamW state"),
    ({"num_hidden_layers": 10**6}, "1000000 decoder layers, more than train builds (4096"),
]


@pytest.mark.parametrize("change, words", CONFIG_CASES)
def test_a_bad_model_config_names_its_file_and_key(change, words, here, capsys,
                                                   no_training) -> None:
    config = json.loads((here / "llama" / "config.json").read_text())
    (here / "llama" / "config.json").write_text(json.dumps({**config, **change}))
    code, err = run([*TRAIN, "--model", "llama/config.json"], capsys)
    refused(code, err, "llama/config.json", words)
    assert no_training == []


@pytest.mark.parametrize("entry", ["../outside.safetensors", "/etc/passwd", 7, None,
                                   "link.safetensors"])
def test_a_weight_index_naming_files_outside_its_folder_is_refused_unopened(
        entry, here, capsys, no_training, monkeypatch) -> None:
    (here / "outside.safetensors").write_bytes(b"not to be read")
    os.symlink(here / "outside.safetensors", here / "llama" / "link.safetensors")
    index = {"weight_map": {"model.embed_tokens.weight": entry}}
    (here / "llama" / "model.safetensors.index.json").write_text(json.dumps(index))
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(str(path)) or
                        real_open(path, *a, **k))
    code, err = run([*TRAIN, "--model", "llama"], capsys)
    refused(code, err, "model.safetensors.index.json", "weight_map['model.embed_tokens.weight']")
    assert not any("outside" in path or "passwd" in path for path in opened), opened


TOML_CASES = [  # (file contents, words of the error line)
    (b"pp = " + b"1" * 5000 + b"\n", "a value cannot be read"),
    (b"pp = " + b"[" * 50000 + b"]" * 50000 + b"\n", "nested too deeply"),
    (b"pp = " + b"{a=" * 50000 + b"1" + b"}" * 50000 + b"\n", "nested too deeply"),
    (b'keep-last = 2\nkeep_last = 3\n', "'keep-last' and 'keep_last' are the same setting"),
    (b"pp = 1\n" + b"#" * (2 << 20) + b"\n", "more than a settings file may be"),
]


@pytest.mark.parametrize("text, words", TOML_CASES)
def test_a_hostile_settings_file_is_one_error_naming_it(text, words, tmp_path, capsys,
                                                         no_training) -> None:
    (tmp_path / "run.toml").write_bytes(text)
    code, err = run(["train", "--config", str(tmp_path / "run.toml"), "--no-png"], capsys)
    refused(code, err, "--config", "run.toml", words)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("special", ["fifo", "/dev/zero"])
def test_a_settings_file_that_is_a_pipe_or_device_is_refused_unread(special, tmp_path, capsys,
                                                                   no_training) -> None:
    if special == "fifo":
        special = str(tmp_path / "fifo.toml")
        os.mkfifo(special)  # with no writer: opening it would block for ever
    code, err = run(["train", "--config", special, "--no-png"], capsys)
    refused(code, err, f"--config {special}: not a regular file")


def test_a_settings_file_with_a_byte_order_mark_is_read(tmp_path, capsys, no_training,
                                                        monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.toml").write_bytes(b"\xef\xbb\xbfpp = 1\nmodel = \"tiny\"\nsteps = 1\n")
    code, err = run(["train", "--config", "run.toml", "--no-png", "--batch-size", "4",
                     "--microbatches", "2", "--no-baseline"], capsys)
    assert code == 0 and no_training == ["run"], err


@pytest.mark.parametrize("field", ["gpus_per_node", "gpus_per_host_link", "sm_count"])
def test_hardware_counts_beyond_any_machine_are_refused(field, tmp_path, capsys) -> None:
    from pipeoffload.planner.hardware import hardware_preset

    values = json.loads(hardware_preset("h100-80gb").to_json())
    (tmp_path / "h.json").write_text(json.dumps({**values, field: 1e300}))
    code, err = run(["plan", "--model", "gpt3-2.7b", "--gpus", "8", "--hardware",
                     str(tmp_path / "h.json"), "--quiet", "--no-verdict"], capsys)
    refused(code, err, f"{field} must be a whole number up to 65536")


@pytest.mark.parametrize("edit, words", [
    (lambda info: info.pop("stage_to_rank"), "info.stage_to_rank is None"),
    (lambda info: info.update(tp="x"), "info.tp is 'x'"),
    (lambda info: info.update(dtype=5), "info.dtype is 5"),
    (lambda info: info["model"]["hf_config"].update(num_hidden_layers="2"),
     "num_hidden_layers is '2'"),
])
def test_export_of_an_edited_manifest_names_the_key(edit, words, trained, tmp_path,
                                                    capsys) -> None:
    step = tmp_path / "step_00000001"
    shutil.copytree(trained / "ck" / "step_00000001", step)
    body = json.loads((step / "manifest.json").read_text())
    edit(body["info"])
    (step / "manifest.json").write_text(json.dumps(body))
    code, err = run(["export", str(step), str(tmp_path / "out")], capsys)
    refused(code, err, "manifest.json", words)
    assert not (tmp_path / "out").exists()


def test_a_word_level_tokenizer_without_an_unknown_token_is_named(here, capsys,
                                                                  no_training) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"a": 0, "small": 1}))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(here / "words.json"))
    code, err = run([*TRAIN, "--model", "tiny", "--tokenizer", "words.json"], capsys)
    refused(code, err, "--tokenizer words.json cannot encode the data", "unknown token")
