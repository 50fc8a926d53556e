"""`pipeoffload train`: the loop against a single-process reference, DP x PP, checkpoints that
resume bitwise and fail loudly, and runs that end when a rank dies.

Multi-process tests start the real command (cli/launch.py -> gloo); the references run in this
process with Pipeline's local mode (``Topology.local``), which shares no code with gloo.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from patience import PATIENCE, PATIENCE_S

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from pipeoffload.cli.launch import LaunchConfig, launch
from pipeoffload.cli.train import add_train_parser, config_from_args
from pipeoffload.cli.train_options import config_error
from pipeoffload.cli.train_report import render_table
from pipeoffload.core.actions import Kind
from pipeoffload.errors import ConfigError, FieldError
from pipeoffload.parallel import checkpoint as ckpt
from pipeoffload.parallel.checkpoint import CheckpointError
from pipeoffload.parallel.topology import Topology
from pipeoffload.training.data import DataConfig
from pipeoffload.training.model_config import model_preset
from pipeoffload.training.train import TrainConfig
from pipeoffload.training.trainer import train

needs_gloo = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

from test_runtime_support import one_thread  # noqa: E402, F401 - autouse fixture

TINY_ARGS = ["--model", "tiny", "--batch-size", "16", "--log-every", "1", "--p2p-timeout", PATIENCE]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pipeoffload")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["train", *argv])


def tiny_config(**changes) -> TrainConfig:
    """What ``pipeoffload train`` + TINY_ARGS + ``changes`` (TrainConfig fields) asks for."""
    config, _ = config_from_args(parse(TINY_ARGS))
    return dataclasses.replace(config, **changes)


def run_inline(config: TrainConfig):
    return train(config, Topology.local(config.pp))


def run_cli(argv: list[str], cwd: Path, timeout_s: float = PATIENCE_S) -> tuple[dict, str]:
    """Run the command in fresh processes; its last stdout line is the --json object."""
    png = [] if "--png" in argv else ["--no-png"]
    proc = subprocess.run([sys.executable, "-m", "pipeoffload.cli", "train",
                           *TINY_ARGS, "--json", *argv, *png], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def relative_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def stage_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every model and optimizer tensor of a checkpoint, by stage and name (a sharded
    optimizer's shards joined, as a resume reads them)."""
    manifest = ckpt.read_manifest(folder)
    stages = sorted({int(n.split("_")[1].split(".")[0]) for n in manifest.files
                     if n.startswith("stage_")})
    found = {}
    for stage in stages:
        saved = ckpt.load_stage(manifest, stage, None)
        for key, value in saved["model"].items():
            found[f"stage {stage}:{key}"] = value
        for index, state in saved["optimizer"]["state"].items():
            for key, value in state.items():
                found[f"stage {stage}:opt{index}.{key}"] = value
    return found


def test_cli_defaults_are_train_config_defaults_and_overrides_apply() -> None:
    config, report = config_from_args(parse([]))
    assert config == TrainConfig(data=DataConfig(seq_len=128, batch_size=16))
    assert (config.pp, config.schedule, config.model) == (4, "po-f", model_preset("small"))
    assert report.png and not report.json
    config, report = config_from_args(parse(
        ["--model", "tiny", "--layers", "6", "--dim", "64", "--seq-len", "48", "--dp", "2",
         "--resume", "--checkpoint-dir", "x", "--grad-clip", "0", "--no-png"]))
    assert (config.model.n_layers, config.model.dim, config.model.max_seq_len) == (6, 64, 48)
    assert (config.data.seq_len, config.dp, config.resume, config.grad_clip) == (48, 2,
                                                                                 "latest", None)
    assert report.png is None
    with pytest.raises(ConfigError, match="a multiple of 32"):  # dp=2 x 16 microbatches
        config_from_args(parse(["--pp", "8", "--dp", "2"]))


def test_fetch_on_use_trains_bitwise_like_reload_with_lower_predicted_peaks() -> None:
    base = tiny_config(pp=2, steps=2, microbatches=4, measure_baseline=False)
    reload = run_inline(base)
    fetch = run_inline(dataclasses.replace(base, fetch_on_use=True))
    assert fetch.plan.schedule.has_kind(Kind.FETCH)
    assert not reload.plan.schedule.has_kind(Kind.FETCH)
    assert list(fetch.losses) == list(reload.losses)
    assert fetch.peak_bytes == fetch.predicted_bytes
    assert all(f <= r for f, r in zip(fetch.peak_bytes, reload.peak_bytes))
    assert sum(fetch.peak_bytes) < sum(reload.peak_bytes)
    assert "FETCH-ed activations" in render_table(fetch)
    assert "FETCH" not in render_table(reload)


@needs_gloo
@pytest.mark.slow
def test_pp4_po_f_matches_pp1_and_the_loss_falls(tmp_path: Path) -> None:
    steps = 12
    png = tmp_path / "schedule.png"
    out, _ = run_cli(["--pp", "4", "--layers", "8", "--steps", str(steps), "--microbatches",
                      "8", "--png", str(png)], tmp_path)
    reference = run_inline(tiny_config(pp=1, schedule="1f1b", steps=steps, microbatches=8,
                                       model=dataclasses.replace(model_preset("tiny"),
                                                                 n_layers=8)))
    assert (out["schedule"], out["stages"], out["steps"]) == ("po-f", 8, steps)
    assert relative_gap(out["losses"], list(reference.losses)) < 1e-5
    # Small initial weights predict nearly uniform bytes: cross-entropy ln(256) at the start.
    assert abs(out["first_loss"] - math.log(256)) < 0.05
    assert out["last_loss"] < 0.85 * out["first_loss"]
    # On CPU the meter and the simulator count the same bytes (design.md, memory accounting),
    # and full offload must hold less than the same schedule without it.
    assert out["peak_activation_bytes"] == out["predicted_peak_activation_bytes"]
    without = out["peak_activation_without_offload_bytes"]
    assert without == out["predicted_peak_activation_without_offload_bytes"]
    assert all(a < b for a, b in zip(out["peak_activation_bytes"], without))
    assert out["png"] == str(png) and png.read_bytes()[:4] == b"\x89PNG"
    assert out["tokens_per_s"] > 0


@needs_gloo
@pytest.mark.slow
def test_dp2_pp2_matches_dp1_pp2_across_a_resume(tmp_path: Path) -> None:
    common = ["--pp", "2", "--microbatches", "2", "--no-baseline",
              "--checkpoint-dir", str(tmp_path / "dp2")]
    first, _ = run_cli([*common, "--dp", "2", "--steps", "2"], tmp_path)
    second, _ = run_cli([*common, "--dp", "2", "--steps", "4", "--resume"], tmp_path)
    reference = run_inline(tiny_config(pp=2, microbatches=4, steps=4, measure_baseline=False,
                                       checkpoint_dir=str(tmp_path / "ref")))
    assert (first["steps"], second["start_step"], second["steps"]) == (2, 2, 4)
    assert relative_gap(first["losses"] + second["losses"], list(reference.losses)) < 1e-5
    ours, theirs = stage_tensors(Path(second["checkpoint"])), stage_tensors(
        Path(reference.checkpoint))
    assert ours.keys() == theirs.keys() and ours
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-6, msg=key)


def test_n_steps_resume_n_steps_equals_2n_steps_bitwise(tmp_path: Path) -> None:
    base = tiny_config(pp=2, measure_baseline=False)
    straight = run_inline(dataclasses.replace(base, steps=6,
                                              checkpoint_dir=str(tmp_path / "a")))
    half = run_inline(dataclasses.replace(base, steps=3, checkpoint_dir=str(tmp_path / "b")))
    resumed = run_inline(dataclasses.replace(base, steps=6, checkpoint_dir=str(tmp_path / "b"),
                                             resume="latest"))
    assert (half.end_step, resumed.start_step, resumed.end_step) == (3, 3, 6)
    assert half.losses + resumed.losses == straight.losses  # exact float equality
    a, b = stage_tensors(Path(straight.checkpoint)), stage_tensors(Path(resumed.checkpoint))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # The optimizer state moved: a run that forgot it would differ at the first resumed step.
    assert any("exp_avg_sq" in k for k in a)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> tuple[TrainConfig, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    config = tiny_config(pp=2, steps=2, measure_baseline=False, checkpoint_dir=str(root))
    run_inline(config)
    return config, root


def _copy(root: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(root, dest)
    return dest


def test_missing_checkpoint_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    config = tiny_config(pp=2, steps=4, measure_baseline=False,
                         checkpoint_dir=str(tmp_path / "nothing"), resume="latest")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        run_inline(config)
    with pytest.raises(CheckpointError, match="does not exist"):
        run_inline(dataclasses.replace(config, resume=str(tmp_path / "gone" / "step_00000002")))
    # The self-launching command checks before it starts any process.
    args = parse([*TINY_ARGS, "--pp", "2", "--checkpoint-dir", str(tmp_path / "nothing"),
                  "--resume"])
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        args.handler(args)


def test_corrupt_checkpoint_is_an_error(saved_run, tmp_path: Path) -> None:
    config, root = saved_run
    root = _copy(root, tmp_path / "c")
    stage = root / "step_00000002" / "stage_001.pt"
    data = bytearray(stage.read_bytes())
    data[len(data) // 2] ^= 0xFF
    stage.write_bytes(bytes(data))
    resume = dataclasses.replace(config, steps=4, checkpoint_dir=str(root), resume="latest")
    with pytest.raises(CheckpointError, match="stage_001.pt is corrupt"):
        run_inline(resume)
    (root / "step_00000002" / "manifest.json").write_text('{"step": 2, "fil')
    with pytest.raises(CheckpointError, match="manifest.json is unreadable or corrupt"):
        run_inline(resume)


def test_checkpoint_for_another_model_or_a_used_folder_is_refused(saved_run) -> None:
    config, root = saved_run
    other = dataclasses.replace(config.model, dim=64)
    with pytest.raises(CheckpointError, match="another configuration.*model"):
        run_inline(dataclasses.replace(config, model=other, steps=4, resume="latest"))
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        run_inline(dataclasses.replace(config, steps=4))


def test_a_crash_while_saving_leaves_the_previous_checkpoint_intact(
        saved_run, tmp_path: Path, monkeypatch) -> None:
    config, root = saved_run
    root = _copy(root, tmp_path / "crash")
    real_replace = os.replace

    def crash_on_manifest(src, dst):  # the process dies after the stage files, before the end
        if str(dst).endswith("manifest.json"):
            raise KeyboardInterrupt("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", crash_on_manifest)
    with pytest.raises(KeyboardInterrupt):
        run_inline(dataclasses.replace(config, steps=4, checkpoint_dir=str(root),
                                       resume="latest"))
    monkeypatch.undo()
    torn = root / "step_00000004"
    assert (torn / "stage_000.pt").is_file() and not (torn / "manifest.json").exists()
    assert not [p for p in torn.iterdir() if p.name.endswith(".tmp")]
    assert ckpt.find_checkpoint("latest", root) == root / "step_00000002"
    assert ckpt.read_manifest(root / "step_00000002").step == 2
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        ckpt.read_manifest(torn)


def test_launcher_gives_torchrun_env_and_blames_the_failing_rank(capfd, tmp_path) -> None:
    # Each rank prints, then marks it in a file; rank 1 fails only once all three printed, so a
    # slow start (a loaded machine) cannot have the launcher stop a rank before it printed.
    code = ("import os, sys, time, pathlib; e = os.environ; r = int(e['RANK']); "
            "print(e['WORLD_SIZE'], e['LOCAL_RANK'], e['MASTER_ADDR'], e['OMP_NUM_THREADS'], "
            f"flush=True); d = pathlib.Path({str(tmp_path)!r}); (d / str(r)).touch(); "
            "[time.sleep(0.05) for _ in iter(lambda: len(list(d.iterdir())) < 3, False)] "
            "if r == 1 else None; "
            "sys.exit(3) if r == 1 else time.sleep(120 if r == 2 else 0)")
    rc = launch([sys.executable, "-c", code], LaunchConfig(nprocs=3, reporting_rank=0,
                                                            grace_s=0.5, term_timeout_s=2))
    out, err = capfd.readouterr()
    assert rc == 3
    assert sorted(out.splitlines()) == ["3 0 127.0.0.1 1", "[rank 1] 3 1 127.0.0.1 1",
                                        "[rank 2] 3 2 127.0.0.1 1"]
    assert re.search(r"launch: rank 1 \(pid \d+\) exited with code 3; then the launcher "
                     r"stopped rank\(s\) 2", err), err
    assert launch([sys.executable, "-c", "pass"], LaunchConfig(nprocs=2)) == 0


def _children(pid: int) -> dict[int, int]:
    """{RANK: pid} of the processes ``pid`` started (Linux /proc)."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            ranks = [int(e[5:]) for e in env if e.startswith(b"RANK=")]
            if ranks:
                found[ranks[0]] = int(child)
    return found


@needs_gloo
@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_killing_one_rank_ends_the_run_with_an_error_on_every_rank(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeoffload.cli", "train", *TINY_ARGS, "--pp", "3",
         "--schedule", "1f1b", "--microbatches", "4", "--steps", "100000",
         "--no-png"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # rank 2 (the last stage) reports; wait until training runs
            if line.startswith("step "):
                break
        children = _children(proc.pid)
        assert sorted(children) == [0, 1, 2]
        os.kill(children[1], signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=PATIENCE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGKILL  # the launcher reports the killed rank
    # A survivor that ended by itself failed its work: 1 (2 is an input error).
    assert all(code == "1" for code in re.findall(r"rank [02] exited with code (\d+)", stderr))
    assert f"launch: rank 1 (pid {children[1]}) was killed by SIGKILL" in stderr
    # Each survivor says itself what failed: rank 0 prefixed by the launcher, rank 2 (the
    # reporting rank) as is. A receive from rank 1 names it; a collective over the pipeline
    # group (the step's loss or norm) cannot tell which peer died and says so (gather.py
    # peer_failures): which one a survivor is in when rank 1 dies depends on timing.
    failed = r"error: .*(rank 1|a collective failed .*a peer died or failed)"
    assert re.search(r"^\[rank 0\] pipeoffload train: rank 0: " + failed, stderr, re.M), \
        stderr[-3000:]
    assert re.search(r"^pipeoffload train: rank 2: " + failed, stderr, re.M), stderr[-3000:]
    assert all(not Path(f"/proc/{pid}").exists() or _is_zombie(pid)
               for pid in children.values())


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_config_errors_name_the_field_and_the_command_line_its_option() -> None:
    with pytest.raises(FieldError, match="TrainConfig.data.seq_len 64 exceeds") as caught:
        TrainConfig(model=model_preset("tiny"), data=DataConfig(seq_len=64))
    assert caught.value.fields == ("data.seq_len",)
    assert str(config_error(caught.value)) == ("--seq-len 64 exceeds the model's max_seq_len 32; "
                                               "lower --seq-len or raise it")
    with pytest.raises(ConfigError, match="--inline runs one pipeline replica"):
        args = parse([*TINY_ARGS, "--dp", "2", "--inline", "--microbatches", "2"])
        args.handler(args)


def test_dualpipe_is_refused_with_the_schedule_to_use_instead() -> None:
    with pytest.raises(ConfigError, match="use dualpipev"):
        args = parse([*TINY_ARGS, "--pp", "2", "--schedule", "dualpipe", "--microbatches", "4"])
        args.handler(args)
