"""The `pipeoffload` command: simulate's JSON contract, files it writes, and its errors."""

import json

import pytest

from pipeoffload.cli.main import main
from pipeoffload.core.text import read_csv
from pipeoffload.core.validate import validate

CONTRACT = {"schedule", "pp", "chunks", "stages", "microbatches", "makespan", "bubble_rate",
            "peak_activation", "offloaded_fraction", "stall_time"}


def run_json(capsys, *argv):
    assert main(["simulate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_simulate_json_has_the_contract_keys(capsys):
    out = run_json(capsys, "--schedule", "1F1B", "--pp", "4", "--microbatches", "8")
    assert CONTRACT <= out.keys()
    assert out["schedule"] == "1f1b" and out["pp"] == 4 and out["stages"] == 4
    assert out["bubble_rate"] == pytest.approx(3 / 11)
    assert out["peak_activation"] == [4, 3, 2, 1]
    assert out["offloaded_fraction"] == 0 and out["stall_time"] == 0


def test_po_f_offloads_and_lowers_the_peak(capsys):
    out = run_json(capsys, "--schedule", "po-f", "--pp", "8", "--offload-ratio", "0.5")
    assert out["chunks"] == 2 and out["microbatches"] == 32
    assert out["offloaded_fraction"] > 0.8
    assert max(out["peak_activation"]) <= 1.5 < max(out["peak_activation_without_offload"])


def test_csv_round_trip_through_the_cli(tmp_path, capsys):
    path = tmp_path / "zbv.csv"
    assert main(["simulate", "--schedule", "ZBVZeroBubble", "--pp", "4", "--csv", str(path),
                 "--no-grid"]) == 0
    direct = capsys.readouterr().out
    assert f"wrote csv: {path}" in direct
    validate(read_csv(path))
    again = run_json(capsys, "--from-csv", str(path))
    built = run_json(capsys, "--schedule", "zbv", "--pp", "4")
    assert again["makespan"] == built["makespan"]
    assert again["peak_activation"] == built["peak_activation"]


def test_a_planned_csv_runs_as_planned_and_fetch_on_use_reaches_the_papers_cut(tmp_path, capsys):
    path = tmp_path / "gi.csv"
    flags = ["--schedule", "grouped-interleaved", "--pp", "8", "--chunks", "2",
             "--group-size", "4", "--offload", "chunks:1", "--offload-ratio", "0.25"]
    planned = run_json(capsys, *flags, "--fetch-on-use", "--csv", str(path))
    reloaded = run_json(capsys, *flags)
    # p=8, v=2, g=4: chunk 0 read back on use leaves the g = 4 chunk-1 activations (2 M_a);
    # reloaded, it counts whole while backpropagated (and one copy is in flight): 3 M_a.
    assert planned["peak_activation"][0] == 2.0 and reloaded["peak_activation"][0] == 3.0
    assert "FETCH" in path.read_text()
    again = run_json(capsys, "--from-csv", str(path), "--offload-ratio", "0.25")
    assert again["peak_activation"] == planned["peak_activation"]
    assert again["makespan"] == planned["makespan"]
    bare = run_json(capsys, "--from-csv", str(path), "--offload", "none")
    assert bare["peak_activation"] == planned["peak_activation_without_offload"]


def test_png_and_trace_are_written(tmp_path, capsys):
    png, trace = tmp_path / "s.png", tmp_path / "s.json"
    assert main(["simulate", "--schedule", "po-h", "--pp", "4", "--offload-ratio", "0.25",
                 "--png", str(png), "--trace", str(trace), "--no-grid"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("OFFLOAD") or "OFFLOAD" in json.dumps(e)
               for e in events)


def test_human_output_has_table_and_grid(capsys):
    assert main(["simulate", "--schedule", "v-half", "--pp", "4"]) == 0
    out = capsys.readouterr().out
    assert "bubble" in out and "rank 3" in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--schedule", "nope"], "unknown schedule"),
        (["--schedule", "zbv", "--chunks", "3"], "chunks"),
        (["--schedule", "1f1b", "--offload", "half"], "offload target"),
        (["--from-csv", "missing.csv"], "--from-csv missing.csv: does not exist"),
        (["--from-csv", "x.csv", "--group-size", "2"], "--group-size has no effect"),
    ],
)
def test_errors_exit_2_with_a_message(capsys, argv, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.csv").write_text("0F0,0B0\n")
    assert main(["simulate", *argv]) == 2
    assert message in capsys.readouterr().err


def test_schedules_lists_one_name_per_line(capsys):
    assert main(["schedules"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert {"gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "v-half", "v-min",
            "grouped-interleaved", "po-h", "po-f"} <= set(names)


def test_probe_without_gpu_says_so_and_fails(capsys):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present; the GPU path is exercised by benchmarks/gpu_offload.py")
    assert main(["probe"]) == 1
    assert "error: no CUDA device" in capsys.readouterr().err


def test_every_train_config_field_has_its_option_or_is_set_by_none():
    """A FieldError the command line prints names the option; only these fields have none."""
    import dataclasses

    from pipeoffload.cli.train_options import field_flags, train_parser
    from pipeoffload.training.train import TrainConfig

    flags = field_flags()
    options = {o for a in train_parser()._actions for o in a.option_strings}
    assert set(flags.values()) <= options
    unset = {f.name for f in dataclasses.fields(TrainConfig)} - set(flags)
    assert unset == {"model", "data", "min_lr_ratio", "betas"}
    assert (flags["p2p_timeout_s"], flags["hf_model"], flags["data.seq_len"],
            flags["model.n_heads"]) == ("--p2p-timeout", "--model", "--seq-len", "--heads")


def test_a_train_config_error_names_the_option(capsys):
    assert main(["train", "--model", "tiny", "--keep-last", "2", "--no-png"]) == 2
    assert capsys.readouterr().err == ("pipeoffload train: error: --keep-last 2 needs "
                                       "--checkpoint-dir and N >= 1\n")
