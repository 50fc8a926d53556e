"""`pipeoffload train --config FILE.toml`, the effective settings printed and saved with each
checkpoint, `--metrics` / `--tensorboard`, `--resume auto` and `--keep-last`, and the example
docs/run.toml run as the docs show it."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeoffload.cli import config_file, preflight
from pipeoffload.cli.main import build_parser, main
from pipeoffload.cli.train import config_from_args
from pipeoffload.cli.train_options import train_parser

torch = pytest.importorskip("torch")
tomllib = pytest.importorskip("tomllib")  # Python 3.11+; 3.10 reads --config with tomli

from test_runtime_support import one_thread  # noqa: E402, F401 - autouse fixture

from pipeoffload.parallel import checkpoint as ckpt  # noqa: E402
from pipeoffload.training.metrics import model_flops_per_step  # noqa: E402
from pipeoffload.training.model_config import model_preset  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "run.toml"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    return parser.parse_args(config_file.expand(parser, argv))


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_a_config_file_sets_any_train_flag_and_the_command_line_wins(tmp_path: Path) -> None:
    toml = write(tmp_path / "run.toml", 'pp = 2\nmodel = "tiny"\nbatch_size = 8\n'
                 'checkpoint-dir = "ck"\nno-png = true\ninline = false\nlr = 1e-3\n'
                 'resume = "auto"\n')
    args = parse(["train", "--config", toml, "--pp", "4"])
    assert (args.pp, args.model, args.batch_size, args.lr) == (4, "tiny", 8, 1e-3)
    ck = str(tmp_path / "ck")  # beside the file
    assert (args.checkpoint_dir, args.png, args.inline, args.resume) == (ck, None, False,
                                                                        "auto")
    # Flags before --config win too: the file's settings go first, whatever the order.
    assert parse(["train", "--pp", "1", f"--config={toml}"]).pp == 1
    config, _ = config_from_args(args)
    assert (config.pp, config.resume, config.checkpoint_dir) == (4, "auto", ck)


def test_keys_come_from_the_parser_so_a_flag_added_later_needs_no_code(tmp_path: Path) -> None:
    parser = train_parser()
    parser.add_argument("--brand-new", type=int, default=0)
    parser.add_argument("--brand-new-switch", action="store_true")
    toml = write(tmp_path / "new.toml", "brand-new = 7\nbrand_new_switch = true\n")
    assert config_file.config_tokens(parser, toml) == ["--brand-new=7", "--brand-new-switch"]
    every = set(config_file.setting_actions(parser))
    assert {"pp", "resume", "keep-last", "metrics", "no-png", "brand-new"} <= every
    assert not every & {"help", "config", "worker-config"}


@pytest.mark.parametrize("text, message", [
    ("pipeline = 2\n", r"pipeline is not a setting of this command"),
    ("pp = 0\n", r"pp = 0: must be a whole number in 1\.\.4096"),
    ("pp = 2.5\n", r"pp = 2.5: expected a whole number"),
    ('dtype = "fp8"\n', r"dtype = 'fp8': choose one of fp32, bf16, fp64"),
    ("no-png = 1\n", r"no-png = 1: a switch, write true or false"),
    ("steps = true\n", r"steps = true: expected a value"),
    ("[model]\ndim = 3\n", r"tables \(\[model\]\) are not used"),
    ("pp = [1, 2]\n", r"pp: expected one value"),
    ("pp = \n", r"not valid TOML \(.*line 1"),
    ("kepp-last = 2\n", r"did you mean keep-last"),
])
def test_a_bad_setting_names_the_file_and_the_key(tmp_path: Path, capsys, text: str,
                                                  message: str) -> None:
    toml = write(tmp_path / "bad.toml", text)
    assert main(["train", "--config", toml]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pipeoffload train: error: --config {toml}: "), err
    assert len(err.strip().splitlines()) == 1
    import re

    assert re.search(message, err), err


def test_paths_in_a_config_file_resolve_against_its_folder(tmp_path: Path,
                                                          monkeypatch) -> None:
    """Relative paths in the file against the file's folder, absolute ones as they are, the
    command line's against the current folder; words that are not paths stay words."""
    folder = tmp_path / "runs" / "a"
    folder.mkdir(parents=True)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    toml = write(folder / "run.toml", 'checkpoint-dir = "ck"\nmetrics = "logs/m.jsonl"\n'
                 'data = "../corpus"\ntokenizer = "tok.json"\nmodel = "llama/config.json"\n'
                 f'export-hf = "{tmp_path / "out"}"\npng = "p.svg"\nresume = "auto"\n')
    args = parse(["train", "--config", "../runs/a/run.toml", "--cache-dir", "cache"])
    here = os.path.join("..", "runs", "a")
    assert (args.checkpoint_dir, args.metrics, args.data, args.tokenizer, args.model, args.png) \
        == tuple(os.path.join(here, p) for p in ("ck", "logs/m.jsonl", "../corpus", "tok.json",
                                                  "llama/config.json", "p.svg"))
    assert (args.export_hf, args.resume, args.cache_dir) == (str(tmp_path / "out"), "auto",
                                                             "cache")
    assert parse(["train", "--config", toml]).resume == "auto"
    write(folder / "words.toml", 'model = "tiny"\ndata = "hf:wikitext:train"\n'
          'resume = "ck/step_00000002"\n')
    args = parse(["train", "--config", str(folder / "words.toml")])
    assert (args.model, args.data, args.resume) == ("tiny", "hf:wikitext:train",
                                                    str(folder / "ck" / "step_00000002"))


@pytest.mark.parametrize("text, flag, words", [
    ('checkpoint-dir = "afile"\n', None, "checkpoint-dir {folder}/afile: is a file; name a "
     "folder"),
    ('data = "missing"\n', None, "data {folder}/missing: does not exist"),
    ('model = "missing.json"\n', None, "model {folder}/missing.json: not a model preset"),
    ('checkpoint-dir = "ck"\nmetrics = "ck/m.jsonl"\n', None,
     "metrics {folder}/ck/m.jsonl would be written into the folder of --config "
     "{folder}/run.toml: checkpoint-dir {folder}/ck"),
    ('data = "missing"\n', ["--data", "gone"], "--data gone: does not exist"),
])
def test_a_bad_path_in_a_config_file_names_the_file_and_the_key(
        tmp_path: Path, capsys, no_training, text: str, flag: list[str] | None,
        words: str) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "afile").write_text("x")
    (folder / "ck").mkdir()
    toml = write(folder / "run.toml", text + 'model = "tiny"\n' * ("model" not in text))
    assert main(["train", "--config", toml, "--no-png", *(flag or [])]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    expected = words.format(folder=folder)
    if flag is None:  # set by the file: named by the file and the key
        expected = f"pipeoffload train: error: --config {toml}: {expected}"
    else:  # the command line overrides the file: named by its flag
        expected = f"pipeoffload train: error: {expected}"
    assert len(lines) == 1 and lines[0].startswith(expected), err
    assert no_training == []


def test_a_missing_config_file_is_an_input_error(tmp_path: Path, capsys) -> None:
    assert main(["train", "--config", str(tmp_path / "none.toml")]) == 2
    assert "none.toml" in capsys.readouterr().err


@given(st.text())
@settings(max_examples=200, deadline=None)
def test_any_string_round_trips_through_the_toml_writer(text: str) -> None:
    assert tomllib.loads(f"key = {config_file.toml_value(text)}")["key"] == text


@pytest.mark.parametrize("argv", [
    [],
    ["--model", "tiny", "--pp", "2", "--no-png", "--inline", "--resume", "--checkpoint-dir", "c",
     "--lr", "0.0001", "--keep-last", "3", "--data", "."],
    ["--png", "x.svg", "--no-baseline", "--resume", "auto", "--checkpoint-dir", "c",
     "--peak-tflops", "312"],
])
def test_the_saved_settings_read_back_as_the_same_run(tmp_path: Path, argv: list[str]) -> None:
    args = parse(["train", *argv])
    text = config_file.settings_toml(train_parser(), args, "header\nlines")
    toml = write(tmp_path / "settings.toml", text)
    again = parse(["train", "--config", toml])
    for key in vars(args):
        if key not in ("config", "handler", "on_interrupt"):
            value = getattr(args, key)
            # paths are saved absolute: the same files, read back from the settings' folder
            expected = os.path.abspath(value) if preflight.is_path(value) else value
            assert getattr(again, key) == expected, key
    changed = config_file.changed_flags(train_parser(), args)
    assert all(flag in changed for flag in ("--pp 2", "--inline", "--no-png")
               if flag.split()[0] in argv)
    assert "--steps" not in changed


def test_model_flops_are_6n_plus_attention_per_token_on_the_real_model() -> None:
    """The planner's model FLOP count against the real model's parameters (PaLM's formula:
    6 x matmul parameters + 12 x layers x width x sequence, per token)."""
    from pipeoffload.training.split import build_stage_modules

    model = model_preset("tiny")
    seq, batch = 32, 3
    stages = build_stage_modules(model, 1, [0], seed=0)
    matmul = sum(p.numel() for n, p in stages[0].named_parameters()
                 if p.dim() == 2 and "embed" not in n)
    expected = (6 * matmul + 12 * model.n_layers * model.dim * seq) * seq * batch
    assert model_flops_per_step(model, seq, batch) == pytest.approx(expected, rel=1e-12)


def in_folder(cwd: Path, argv: list[str]) -> int:
    """``main(argv)`` run from folder ``cwd``."""
    before = Path.cwd()
    os.chdir(cwd)
    try:
        return main(argv)
    finally:
        os.chdir(before)


def run_example(cwd: Path, *extra: str) -> int:
    """docs/run.toml as the docs run it: copied into the run's folder ``run`` and started from
    its parent, in one process (`--inline`: the same training, quicker than two processes)."""
    (cwd / "run").mkdir(exist_ok=True)
    (cwd / "run" / "run.toml").write_text(EXAMPLE.read_text())
    return in_folder(cwd, ["train", "--config", "run/run.toml", "--inline", *extra])


def test_the_example_config_runs_resumes_keeps_two_and_writes_metrics(tmp_path: Path,
                                                                       capsys) -> None:
    assert run_example(tmp_path, "--steps", "6") == 0
    first = capsys.readouterr()
    assert "settings: --pp 2 " in first.out and "--keep-last 2" in first.out
    # the file's paths resolve against its folder: the outputs land beside it
    assert ("no checkpoint in run/checkpoints yet: starting from scratch (--resume auto)"
            in first.out)
    assert run_example(tmp_path) == 0  # the file's 8 steps: continues from step 6
    second = capsys.readouterr()
    assert "resuming from run/checkpoints/step_00000006 (step 6)" in second.out
    tmp_path = tmp_path / "run"
    root = tmp_path / "checkpoints"
    # beside the step folders only the folder's lock (parallel/checkpoint_lock.py)
    assert sorted(p.name for p in root.iterdir()) == [".pipeoffload.lock", "step_00000006",
                                                      "step_00000008"]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in lines if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 9))
    # The held-out loss each run measures at its end: a line of its own, kept across the resume.
    held_out = [r for r in lines if "eval_loss" in r]
    assert [(set(r), r["step"]) for r in held_out] == [({"step", "eval_loss"}, 6),
                                                        ({"step", "eval_loss"}, 8)]
    assert all(r["eval_loss"] > 0 for r in held_out)
    for record in records:
        assert set(record) >= {"step", "loss", "lr", "grad_norm", "tokens_per_s",
                               "step_time_s", "mfu", "model_flops_per_s",
                               "peak_activation_bytes", "host_pool_bytes", "elapsed_s"}
        assert record["grad_norm"] > 0 and record["mfu"] is None  # CPU: no known peak
        assert len(record["peak_activation_bytes"]) == 2
    # The effective settings are saved with the checkpoint and run the same configuration.
    saved = root / "step_00000008" / "config.toml"
    assert "config.toml" in ckpt.read_manifest(root / "step_00000008").files
    values = tomllib.loads(saved.read_text())
    assert (values["pp"], values["steps"], values["resume"], values["inline"]) == (2, 8, "auto",
                                                                                  True)
    # saved absolute: the saved file names the run's own folders wherever it is read from
    assert (values["checkpoint-dir"], values["metrics"]) == (str(root),
                                                             str(tmp_path / "metrics.jsonl"))
    # Requeued after the end: --resume auto has nothing to train, says so, exits 0.
    assert run_example(tmp_path, "--config", str(saved)) == 2  # one --config only
    assert "given 2 times" in capsys.readouterr().err
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert in_folder(elsewhere, ["train", "--config", str(saved)]) == 0
    assert "nothing to train" in capsys.readouterr().err
    assert list(elsewhere.iterdir()) == []


def test_a_hugging_face_model_is_counted_at_its_own_shape(tmp_path: Path) -> None:
    """`train --model PATH`'s MFU counts that model (as `plan --model PATH` reads it), not the
    reference model: a Llama config of the reference "tiny" shape counts the same FLOPs, and a
    wider one more."""
    import json as json_module

    from pipeoffload.training.metrics import hf_model_flops_per_step

    tiny = model_preset("tiny")
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
              "num_hidden_layers": tiny.n_layers, "hidden_size": tiny.dim,
              "num_attention_heads": tiny.n_heads, "num_key_value_heads": tiny.n_kv_heads,
              "intermediate_size": tiny.ffn_hidden, "vocab_size": tiny.vocab_size,
              "hidden_act": "silu",
              "max_position_embeddings": tiny.max_seq_len}
    path = tmp_path / "config.json"
    path.write_text(json_module.dumps(config))
    assert hf_model_flops_per_step(str(path), 32, 3) == pytest.approx(
        model_flops_per_step(tiny, 32, 3), rel=1e-12)
    path.write_text(json_module.dumps({**config, "intermediate_size": 4 * tiny.ffn_hidden}))
    assert hf_model_flops_per_step(str(path), 32, 3) > model_flops_per_step(tiny, 32, 3)


def test_metrics_mfu_and_tensorboard(tmp_path: Path, capsys, monkeypatch) -> None:
    from pipeoffload.cli import progress

    monkeypatch.setattr(progress, "tensorboard_writer", lambda log_dir: None)
    base = ["train", "--model", "tiny", "--pp", "2", "--microbatches", "2", "--batch-size", "4",
            "--steps", "2", "--inline", "--no-png", "--no-baseline", "--log-every", "1",
            "--metrics", str(tmp_path / "m.jsonl"), "--peak-tflops", "0.001"]
    assert main([*base, "--tensorboard", str(tmp_path / "tb")]) == 0
    out, err = capsys.readouterr()
    assert "the tensorboard extra is not installed" in err
    assert "MFU " in out and "elapsed 0:00:" in out and "ETA " in out
    record = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)][-1]
    tiny = model_preset("tiny")
    flops = model_flops_per_step(tiny, min(128, tiny.max_seq_len), 4)
    assert record["mfu"] == pytest.approx(flops / record["step_time_s"] / 1e9)


def test_tensorboard_events_are_written_with_the_extra(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    argv = ["train", "--model", "tiny", "--pp", "2", "--microbatches", "2", "--batch-size", "4",
            "--steps", "2", "--inline", "--no-png", "--no-baseline",
            "--tensorboard", str(tmp_path / "tb")]
    assert main(argv) == 0
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2]
    assert "peak_activation_bytes/rank1" in events.Tags()["scalars"]
