"""What `pipeoffload train --model PATH` and its data options accept and refuse, before any
process starts: Hugging Face configs and weights, JSON-lines and folders of text, a local
tokenizer, the planner's command for a config; errors once per torchrun job."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pipeoffload import hf_families
from pipeoffload.cli.notes import data_line
from pipeoffload.cli.train import add_train_parser, config_from_args
from pipeoffload.errors import ConfigError
from pipeoffload.planner.presets import load_model
from pipeoffload.training.data import DataConfig, TextDataset, load_corpus, vocab_needed
from pipeoffload.training.run_checks import check_run

LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64, "hidden_act": "silu", "tie_word_embeddings": True}


def write(path: Path, config: dict) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return str(path)


def parse(argv: list[str]):
    parser = argparse.ArgumentParser(prog="pipeoffload")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    return config_from_args(parser.parse_args(["train", *argv]))[0]


@pytest.fixture
def text(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 3000)
    return path


def checked(argv: list[str]):
    config = parse(argv)
    return check_run(config, config.pp * config.dp * config.tp)


@pytest.mark.parametrize("change,argv,message", [
    ({"model_type": "bert"}, [], "model_type 'bert' is not one pipeoffload splits"),
    ({"vocab_size": 128}, [], "vocab_size 128 is smaller than the data's 256 token ids"),
    ({}, ["--recompute", "lgd"], "lgd needs the reference model's layer structure"),
    ({"attention_dropout": 0.1}, ["--recompute", "full"], "draw other dropout masks"),
    ({"num_key_value_heads": 1, "num_attention_heads": 4}, ["--tp", "2"],
     "must split kv_heads=1"),
    ({"num_hidden_layers": 1}, [], "1 decoder layers cannot fill 4 pipeline stages"),
    ({}, ["--layers", "3"], "--layers shape the reference model"),
])
def test_bad_models_are_refused_up_front(tmp_path, text, change, argv, message):
    cfg = write(tmp_path / "m" / "config.json", {**LLAMA, **change})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        checked(["--model", cfg, "--pp", "2", "--data", str(text), "--seq-len", "16", *argv])


def test_gpt2_shards_by_head_and_its_positions_bound_the_sequence(tmp_path, text):
    cfg = write(tmp_path / "g" / "config.json",
                {"model_type": "gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 4,
                 "n_head": 4, "n_positions": 16, "activation_function": "gelu_new"})
    base = ["--model", cfg, "--pp", "2", "--data", str(text)]
    assert checked([*base, "--tp", "2", "--seq-len", "16"]) is not None  # q, k, v by head
    with pytest.raises(ConfigError, match="must split heads=4 of .* evenly"):
        checked([*base, "--tp", "3", "--seq-len", "16"])
    with pytest.raises(ConfigError, match="--seq-len 32 exceeds .* n_positions 16"):
        checked([*base, "--seq-len", "32"])
    assert parse(base).data.seq_len == 16  # the default fits the model


def test_paths_exports_and_notes(tmp_path, text, capsys):
    cfg = write(tmp_path / "m" / "config.json", LLAMA)
    with pytest.raises(ConfigError, match="not a model preset .* nor an existing file"):
        parse(["--model", str(tmp_path / "missing" / "config.json")])
    with pytest.raises(ConfigError, match="the folder has no config.json"):
        (tmp_path / "empty").mkdir() or parse(["--model", str(tmp_path / "empty")])
    with pytest.raises(ConfigError, match="--export-hf writes a Hugging Face model"):
        parse(["--model", "tiny", "--export-hf", str(tmp_path / "out")])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        checked(["--model", cfg, "--pp", "2", "--data", str(text), "--seq-len", "16", "--export-hf",
                 str(tmp_path / "full")])
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    from pipeoffload.training.hf_model import weights_note

    assert "loaded when you pass the folder" in weights_note(cfg)


def test_weights_are_loaded_by_name_and_checked(tmp_path):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from pipeoffload.training.hf_model import build_hf_stages, resolve_model

    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "model_type"})
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "saved")
    source = resolve_model(str(tmp_path / "saved"))
    assert source.has_weights and "model.embed_tokens.weight" in source.weight_map
    built = build_hf_stages(source, 2, [1], seed=0, dtype=torch.float64,
                            device=torch.device("cpu"))
    assert torch.equal(built.stages[1].lm_head.weight,
                       model.model.embed_tokens.weight.double())  # the tie, from its one copy
    assert torch.equal(built.stages[1].layers[0].mlp.up_proj.weight,
                       model.model.layers[2].mlp.up_proj.weight.double())
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)},
              str(tmp_path / "saved" / "model.safetensors"))
    with pytest.raises(ConfigError, match="weight model.embed_tokens.weight has shape"):
        build_hf_stages(resolve_model(str(tmp_path / "saved")), 2, [0], seed=0,
                        dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="have no model.layers.2.self_attn.q_proj.weight"):
        build_hf_stages(resolve_model(str(tmp_path / "saved")), 2, [1], seed=0,
                        dtype=torch.float32, device=torch.device("cpu"))


def test_jsonl_and_folders_are_read_in_order_and_reported(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_bytes(b"plain text file\n")
    (folder / "sub" / "b.jsonl").write_text(
        '{"text": "first record"}\n\n{"text": "second", "id": 2}\n')
    (folder / ".hidden").write_text("skipped")
    corpus = load_corpus(DataConfig(source=folder))
    assert corpus.files == ("a.txt", "sub/b.jsonl")
    assert corpus.data == b"plain text file\nfirst recordsecond"
    assert corpus.documents() == [b"plain text file\n", b"first record", b"second"]
    assert corpus.file_bytes == (16, (folder / "sub" / "b.jsonl").stat().st_size)
    line = data_line(DataConfig(source=folder))
    assert line.startswith("data: 70 bytes from 2 file(s) of")
    assert "a.txt (16 B), sub/b.jsonl (54 B)" in line
    cut = load_corpus(DataConfig(source=folder, max_bytes=16 + 30))
    assert cut.truncated and cut.documents()[-1] == b"first record"  # whole lines only
    (folder / "sub" / "b.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ConfigError, match=r"b.jsonl:2: the record has no \"text\" string"):
        load_corpus(DataConfig(source=folder))
    (folder / "sub" / "b.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ConfigError, match=r"b.jsonl:2: not a JSON object"):
        load_corpus(DataConfig(source=folder))


def test_a_local_tokenizer_makes_the_tokens(tmp_path, text):
    tokenizers = pytest.importorskip("tokenizers")
    words = ["[UNK]", "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog."]
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    data = DataConfig(source=text, seq_len=8, batch_size=4, tokenizer=str(tmp_path))
    assert vocab_needed(data) == 9
    dataset = TextDataset.from_config(data)
    inputs, target = next(dataset)
    assert inputs.max() < 9 and torch.equal(inputs[:, 1:], target[:, :-1])
    assert dataset.train_tokens[:9].tolist() == [1, 2, 3, 4, 5, 6, 1, 7, 8]
    reference = parse(["--model", "tiny", "--tokenizer", str(tmp_path / "tokenizer.json")])
    assert reference.model.vocab_size == 9  # the reference model takes the tokenizer's size
    small = write(tmp_path / "m" / "config.json", {**LLAMA, "vocab_size": 8})
    with pytest.raises(ConfigError, match="vocab_size 8 is smaller than the data's 9"):
        checked(["--model", small, "--pp", "2", "--data", str(text), "--tokenizer",
                 str(tmp_path), "--seq-len", "8", "--batch-size", "4"])
    with pytest.raises(ConfigError, match="no tokenizer.json there"):
        DataConfig(tokenizer=str(tmp_path / "m")) and vocab_needed(
            DataConfig(tokenizer=str(tmp_path / "m")))


def test_an_unsupported_model_is_one_error_per_torchrun_job(tmp_path):
    cfg = write(tmp_path / "m" / "config.json", {**LLAMA, "model_type": "bert"})
    outputs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": "1", "LOCAL_RANK": str(rank)}
        proc = subprocess.run([sys.executable, "-m", "pipeoffload.cli", "train", "--model", cfg,
                               "--pp", "2"], capture_output=True, text=True, env=env,
                              timeout=300)
        outputs.append((proc.returncode, proc.stderr))
    assert outputs[0][0] == 2 and "error: " in outputs[0][1] and "'bert'" in outputs[0][1]
    assert outputs[1] == (2, "")


def test_the_planner_names_the_config_and_keeps_to_what_train_runs(tmp_path):
    import dataclasses

    from pipeoffload.planner.evaluate import Candidate
    from pipeoffload.planner.train_command import train_command
    from pipeoffload.planner.transformer import Recompute

    folder = tmp_path / "my model"
    cfg = write(folder / "config.json", LLAMA)
    assert load_model(cfg).train_model == cfg
    assert load_model(str(folder)).train_model == str(folder)  # the folder: its weights load
    ours = write(tmp_path / "ours.json", {"num_layers": 4, "hidden": 32, "heads": 4,
                                          "ffn_hidden": 64, "vocab": 256, "seq_len": 32,
                                          "mlp": "swiglu"})
    assert load_model(ours).train_model is None  # not a Hugging Face family: shape flags
    spec = load_model(str(folder))
    plan = Candidate("1f1b", dp=1, tp=2, pp=2, chunks=1, micro_batch=1, microbatches=4,
                     recompute=Recompute.FULL, offload="none")
    command = train_command(plan, spec)
    assert f"--model '{folder}'" in command.argv and "--layers" not in command.argv
    lgd = train_command(dataclasses.replace(plan, recompute=Recompute.LGD), spec)
    assert lgd.argv is None and "full) or nothing" in lgd.refused
    gpt2 = dataclasses.replace(spec, model_type="gpt2")
    assert "--tp 2" in train_command(plan, gpt2).argv  # train shards GPT-2's fused QKV
    assert hf_families.sizes({"n_embd": 8, "n_head": 2})["ffn_hidden"] == 32


def test_export_command_refuses_what_it_cannot_export(tmp_path, capsys):
    import pipeoffload as po
    from pipeoffload.cli.main import main
    from pipeoffload.training.model_config import model_preset
    from pipeoffload.training.split import build_stage_modules

    stages = build_stage_modules(model_preset("tiny"), 1, [0], 0)
    optimizers = {0: torch.optim.AdamW(stages[0].parameters())}
    po.save_checkpoint(tmp_path / "ckpt", 1, stages, optimizers)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 2
    assert "holds no Hugging Face config" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "file").write_text("")
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "used")]) == 2
    assert "DIR " in capsys.readouterr().err
