"""Every bad input gets a clear answer: a non-zero exit status and one `error:` line naming the
flag (CLI), or a PipeoffloadError naming the field (Python API); never a traceback, never a
silent default, and for `train`, nothing trained before an input error it could check first.

CLI cases run in-process (``main(argv)``, argparse's SystemExit caught) to keep the suite fast.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
from patience import PATIENCE, PATIENCE_S
from terminal import AS_FROM_A_TERMINAL

from pipeoffload.cli.main import main
from pipeoffload.errors import PipeoffloadError

PLAN = ["plan", "--model", "pipeoffload-42.9b", "--layers", "8", "--hidden", "1024", "--seq",
        "512", "--quiet"]
TRAIN = ["train", "--model", "tiny", "--pp", "2", "--batch-size", "8", "--microbatches", "4",
         "--steps", "1", "--no-png"]

# (argv, what the error line must name). "{tmp}" is a fresh folder with a text file "t.csv",
# a binary file "bin.dat" and a folder "sub"; "/proc" takes no new files, even for root.
SIMULATE_CASES = [
    (["--overlap-f-b", "2"], "--overlap-f-b"),
    (["--overlap-f-b", "nan"], "--overlap-f-b"),
    (["--microbatches", "0"], "--microbatches"),
    (["--microbatches", "-3"], "--microbatches"),
    (["--microbatches", "1e9"], "--microbatches"),
    (["--pp", "0"], "--pp"),
    (["--pp", "100000"], "--pp"),
    (["--pp", "four"], "--pp"),
    (["--chunks", "0"], "--chunks"),
    (["--group-size", "-1"], "--group-size"),
    (["--cost-f", "nan"], "--cost-f"),
    (["--cost-i", "inf"], "--cost-i"),
    (["--cost-w=-1"], "--cost-w"),
    (["--p2p", "nan"], "--p2p"),
    (["--offload-ratio", "nan"], "--offload-ratio"),
    (["--offload-ratio=-0.5"], "--offload-ratio"),
    (["--activation-bytes=-100"], "--activation-bytes"),
    (["--activation-bytes", "0"], "--activation-bytes"),
    (["--ranks-per-link", "0"], "--ranks-per-link"),
    (["--width", "10"], "--width"),
    (["--offload", "fraction:-0.5"], "fraction:-0.5"),
    (["--offload", "fraction:nan"], "fraction:nan"),
    (["--offload", "limit:-1"], "limit:-1"),
    (["--schedule", "po-g"], "po-f"),
    (["--pp", "64", "--microbatches", "65536"], "--microbatches"),
    (["--from-csv", "{tmp}/missing.csv"], "--from-csv"),
    (["--from-csv", "{tmp}/sub"], "--from-csv"),
    (["--from-csv", "{tmp}/bin.dat"], "--from-csv"),
    (["--png", "{tmp}/nowhere/x.png"], "--png"),
    (["--png", "{tmp}/sub.png/"], "--png"),
    (["--png", "/proc/x.png"], "--png"),
    (["--png", "{tmp}/x.jpg"], "--png"),
    (["--csv", "{tmp}/sub"], "--csv"),
    (["--csv", "/proc/x.csv"], "--csv"),
    (["--trace", "{tmp}/nowhere/t.json"], "--trace"),
    (["--trace", "{tmp}/bin.dat/t.json"], "--trace"),
    (["--from-csv", "{tmp}/t.csv", "--chunks", "2"], "--chunks"),
]
PLAN_CASES = [
    (["--gpus", "0"], "--gpus"),
    (["--gpus", "-8"], "--gpus"),
    (["--gpus", "8", "--global-batch", "0"], "--global-batch"),
    (["--gpus", "8", "--memory", "nan"], "--memory"),
    (["--gpus", "8", "--memory", "0"], "--memory"),
    (["--gpus", "8", "--memory", "inf"], "--memory"),
    (["--gpus", "8", "--reserve=-1"], "--reserve"),
    (["--gpus", "8", "--micro-batch-sizes", "0"], "--micro-batch-sizes"),
    (["--gpus", "8", "--micro-batch-sizes", "1,x"], "--micro-batch-sizes"),
    (["--gpus", "8", "--tp", "0"], "--tp"),
    (["--gpus", "8", "--pp", "2,0"], "--pp"),
    (["--gpus", "8", "--top", "0"], "--top"),
    (["--gpus", "8", "--seq", "0"], "--seq"),
    (["--gpus", "8", "--layers", "-2"], "--layers"),
    (["--gpus", "8", "--schedules", "po-g"], "po-f"),
    (["--gpus", "8", "--offload", "half"], "offload"),
    (["--gpus", "8", "--hardware", "{tmp}/bin.dat"], "hardware file"),
    (["--gpus", "8", "--model", "{tmp}/bin.dat"], "model config"),
]
TRAIN_CASES = [
    (["--lr", "nan"], "--lr"),
    (["--lr", "0"], "--lr"),
    (["--p2p-timeout", "0"], "--p2p-timeout"),
    (["--p2p-timeout", "inf"], "--p2p-timeout"),
    (["--weight-decay", "nan"], "--weight-decay"),
    (["--grad-clip=-1"], "--grad-clip"),
    (["--steps", "0"], "--steps"),
    (["--pp", "0"], "--pp"),
    (["--dp", "0"], "--dp"),
    (["--batch-size", "0"], "--batch-size"),
    (["--seq-len", "-1"], "--seq-len"),
    (["--threads", "0"], "--threads"),
    (["--log-every", "0"], "--log-every"),
    (["--warmup-steps=-1"], "--warmup-steps"),
    (["--seed=-1"], "--seed"),
    (["--checkpoint-every", "2"], "--checkpoint-every"),
    (["--checkpoint-dir", "/proc/ck"], "--checkpoint-dir"),
    (["--checkpoint-dir", "{tmp}/t.csv"], "--checkpoint-dir"),
    (["--png", "/proc/x.png"], "--png"),
    (["--png", "{tmp}/nowhere/x.png"], "--png"),
    (["--png", "{tmp}/x.gif"], "--png"),
    (["--data", "{tmp}/missing.txt"], "--data"),
    (["--resume", "{tmp}/missing"], "--resume"),
    (["--resume"], "--checkpoint-dir"),
    (["--schedule", "po-g"], "po-f"),
    (["--batch-size", "6"], "--batch-size"),
    (["--dp", "2", "--inline"], "--inline"),
    (["--decay-steps", "5"], "--decay-steps"),
    (["--chunks", "3"], "stages"),
    (["--heads", "3"], "is not divisible by --heads 3"),
    (["--model", "huge"], "model preset"),
    (["--data", "{tmp}/empty.txt"], "empty"),
    (["--tp", "0"], "--tp"),
    (["--tp", "3"], "--tp"),
    (["--tp", "2", "--inline"], "--inline"),
    (["--dtype", "fp16"], "--dtype"),
    (["--recompute", "some"], "--recompute"),
]
PROBE_CASES = [
    (["--output", "/proc/x.json"], "--output"),
    (["--output", "{tmp}/sub"], "--output"),
]


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    (tmp_path / "t.csv").write_text("0F0,0B0\n")
    (tmp_path / "bin.dat").write_bytes(bytes(range(128, 256)) * 4)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub.png").mkdir()
    (tmp_path / "empty.txt").write_text("")
    return tmp_path


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(code: int, err: str, names: str) -> None:
    assert code != 0, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert lines, err
    assert any(names in line for line in lines), err


def fill(argv: list[str], tmp: Path) -> list[str]:
    return [a.replace("{tmp}", str(tmp)) for a in argv]


@pytest.mark.parametrize("argv, names", SIMULATE_CASES)
def test_simulate_refuses(argv, names, tmp, capsys) -> None:
    code, out, err = run(["simulate", *fill(argv, tmp), "--no-grid"], capsys)
    assert_refused(code, err, names)
    assert out == ""  # refused before any output: nothing simulated, nothing written
    assert not (tmp / "x.png").exists()


@pytest.mark.parametrize("argv, names", PLAN_CASES)
def test_plan_refuses(argv, names, tmp, capsys) -> None:
    code, out, err = run([*PLAN, *fill(argv, tmp)], capsys)
    assert_refused(code, err, names)
    assert out == ""


@pytest.mark.parametrize("argv, names", TRAIN_CASES)
def test_train_refuses_before_training(argv, names, tmp, capsys, no_training,
                                       monkeypatch) -> None:
    monkeypatch.chdir(tmp)
    code, out, err = run([*TRAIN, *fill(argv, tmp)], capsys)
    assert_refused(code, err, names)
    assert no_training == [] and "step " not in out
    assert not (tmp / "pipeoffload-train.png").exists()


def test_train_on_cuda_without_cuda_is_refused_up_front(tmp, capsys, no_training) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, err = run([*TRAIN, "--device", "cuda"], capsys)
    assert_refused(code, err, "--device cuda")
    assert no_training == []


def test_fetch_on_use_without_offload_says_it_has_no_effect(capsys) -> None:
    code, _, err = run(["simulate", "--schedule", "1f1b", "--fetch-on-use", "--json"], capsys)
    assert code == 0 and "note: --fetch-on-use has no effect" in err


@pytest.mark.parametrize("argv, names", PROBE_CASES)
def test_probe_refuses(argv, names, tmp, capsys) -> None:
    code, _, err = run(["probe", *fill(argv, tmp)], capsys)
    assert_refused(code, err, names)


def api_cases() -> list[tuple[str, object]]:
    from pipeoffload import CostModel, HostLink, OffloadPolicy, build_schedule, plan_schedule
    from pipeoffload.cli.launch import LaunchConfig
    from pipeoffload.offload.targets import parse_target
    from pipeoffload.planner.costing import MemoryConfig
    from pipeoffload.planner.search import SearchConfig, SearchSpace

    nan, inf = math.nan, math.inf
    return [
        ("CostModel.f_time", lambda: CostModel(f_time=nan)),
        ("CostModel.i_time", lambda: CostModel(i_time=-1)),
        ("CostModel.w_time", lambda: CostModel(w_time=inf)),
        ("CostModel.p2p_time", lambda: CostModel(p2p_time=nan)),
        ("CostModel.offload_ratio", lambda: CostModel(offload_ratio=nan)),
        ("CostModel.activation_bytes", lambda: CostModel(activation_bytes=-100)),
        ("CostModel.d2h_bytes_per_s", lambda: CostModel(d2h_bytes_per_s=0)),
        ("CostModel.h2d_bytes_per_s", lambda: CostModel(h2d_bytes_per_s=nan)),
        ("CostModel.stage_activation_bytes[1]",
         lambda: CostModel(stage_activation_bytes=(1.0, nan))),
        ("CostModel.stage_time_scale[0]", lambda: CostModel(stage_time_scale=(-1.0,))),
        ("HostLink.ranks_per_link", lambda: HostLink(ranks_per_link=0)),
        ("OffloadPolicy.max_pending_offloads", lambda: OffloadPolicy(max_pending_offloads=-1)),
        ("OffloadPolicy.reload_margin", lambda: OffloadPolicy(reload_margin=nan)),
        ("OffloadPolicy.max_rounds", lambda: OffloadPolicy(max_rounds=0)),
        ("OffloadPolicy.postpone_slack", lambda: OffloadPolicy(postpone_slack=-1)),
        ("OffloadPolicy.stall_tolerance", lambda: OffloadPolicy(stall_tolerance=inf)),
        ("po-f", lambda: build_schedule("pof2", pp=4, microbatches=8)),
        ("fraction:-0.5", lambda: plan_schedule("1f1b", 4, 8, "fraction:-0.5")),
        ("limit:-1", lambda: parse_target("limit:-1")),
        ("SearchConfig.gpus", lambda: SearchConfig(gpus=0, global_batch=8)),
        ("SearchConfig.budget_bytes",
         lambda: SearchConfig(gpus=8, global_batch=8, budget_bytes=nan)),
        ("SearchSpace.micro_batch_sizes", lambda: SearchSpace(micro_batch_sizes=(0,))),
        ("SearchSpace.tp", lambda: SearchSpace(tp=(2, -1))),
        ("MemoryConfig.reserve_bytes", lambda: MemoryConfig(reserve_bytes=nan)),
        ("LaunchConfig.nprocs", lambda: LaunchConfig(nprocs=0)),
    ]


def test_python_api_refuses_with_the_field_named() -> None:
    cases = api_cases()
    for field, make in cases:
        with pytest.raises(PipeoffloadError) as caught:
            make()
        assert field in str(caught.value), (field, str(caught.value))


def test_train_config_refuses_nonfinite_numbers() -> None:
    pytest.importorskip("torch")
    from pipeoffload.training.train import TrainConfig

    for field, value in (("lr", math.nan), ("p2p_timeout_s", 0.0), ("weight_decay", math.inf),
                         ("grad_clip", math.nan), ("min_lr_ratio", math.nan)):
        with pytest.raises(PipeoffloadError, match=field.split("_s")[0].replace("_", ".?")):
            TrainConfig(**{field: value})


def test_there_are_at_least_60_cases() -> None:
    cli = len(SIMULATE_CASES) + len(PLAN_CASES) + len(TRAIN_CASES) + len(PROBE_CASES)
    assert cli + len(api_cases()) >= 60


def test_a_resume_at_or_past_steps_is_refused_before_training(tmp, capsys) -> None:
    pytest.importorskip("torch")
    # One real (one-process) run makes a checkpoint at step 1.
    argv = ["train", "--model", "tiny", "--pp", "1", "--batch-size", "4", "--microbatches",
            "2", "--no-png", "--no-baseline", "--checkpoint-dir", str(tmp / "ck")]
    code, out, err = run([*argv, "--steps", "1"], capsys)
    assert code == 0, err
    assert "one process" in out and "checkpoints in" in out  # the start-up line
    code, out, err = run([*argv, "--steps", "1", "--resume"], capsys)
    assert_refused(code, err, "--steps 1")
    assert "step " not in out
    (tmp / "ck" / "step_00000005").mkdir()  # a save that never finished
    code, out, err = run([*argv, "--steps", "2", "--resume"], capsys)
    assert code == 0, err
    assert "resuming from" in out and "skipping newer step_00000005" in out


def test_simulate_warns_when_offload_lowers_no_peak(capsys) -> None:
    # 1f1b's peak is its warm-up; the longest-lived 10% moved out are not resident there.
    argv = ["simulate", "--schedule", "1f1b", "--offload-ratio", "0.5", "--json"]
    code, out, err = run([*argv, "--offload", "fraction:0.1"], capsys)
    result = json.loads(out)
    assert code == 0 and result["offloaded_fraction"] > 0
    assert result["peak_activation"] == result["peak_activation_without_offload"]
    assert "note: the plan copies activations to host memory but lowers no rank's peak" in err
    code, out, err = run([*argv, "--offload", "all"], capsys)
    assert code == 0 and "lowers no rank's peak" not in err


def test_train_warns_when_offload_lowers_no_peak(capsys, no_training) -> None:
    argv = [*TRAIN, "--schedule", "1f1b"]
    code, _, err = run([*argv, "--offload", "fraction:0.01"], capsys)
    assert code == 0 and no_training
    assert "note: the plan copies activations to host memory but lowers no rank's peak" in err
    code, _, err = run([*argv, "--offload", "all"], capsys)
    assert code == 0 and "lowers no rank's peak" not in err


def test_ctrl_c_in_train_names_the_latest_checkpoint(tmp, capsys, monkeypatch) -> None:
    from pipeoffload.cli import train as train_cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_cli, "_self_launch", interrupted)
    monkeypatch.setattr(train_cli, "run_worker", interrupted)
    monkeypatch.chdir(tmp)
    code, _, err = run([*TRAIN, "--checkpoint-dir", str(tmp / "ck")], capsys)
    assert code == 130 and "Traceback" not in err
    assert "error: interrupted (Ctrl-C); no complete checkpoint in" in err
    code, _, err = run([*TRAIN], capsys)
    assert code == 130 and "no checkpoint was saved (no --checkpoint-dir)" in err
    done = tmp / "ck" / "step_00000007"
    done.mkdir(parents=True)
    (done / "manifest.json").write_text("{}")
    (tmp / "ck" / "step_00000009").mkdir()  # no manifest: not a checkpoint
    from pipeoffload.cli.preflight import run_command

    args = train_cli.argparse.Namespace(checkpoint_dir=str(tmp / "ck"))
    assert run_command("train", interrupted, args, train_cli.interrupt_note) == 130
    assert f"the latest complete checkpoint is {done}" in capsys.readouterr().err


def test_png_without_matplotlib_is_skipped_with_a_note(tmp, capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    code, out, err = run(["simulate", "--png", str(tmp / "x.png"), "--no-grid"], capsys)
    assert code == 0
    assert "note: matplotlib is not installed, so" in err and "wrote png" not in out
    assert not (tmp / "x.png").exists()


def test_the_reference_model_trains_without_the_optional_extras(tmp) -> None:
    """A minimal install (torch only) trains: no module on the reference model's path imports
    transformers or matplotlib. Run in fresh processes (children included), where an import
    made by another test cannot hide one."""
    import os
    import subprocess

    blocker = tmp / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\nfor name in ('transformers', 'matplotlib', 'numpy'):\n"
        "    sys.modules[name] = None  # `import name` fails, as where it is not installed\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(blocker), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run(
        [sys.executable, "-m", "pipeoffload.cli", "train", "--model", "tiny", "--pp", "2",
         "--steps", "1", "--p2p-timeout", PATIENCE],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=PATIENCE_S)
    assert proc.returncode == 0, proc.stderr
    assert "note: matplotlib is not installed" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_png_named_svg_is_svg(tmp, capsys) -> None:
    pytest.importorskip("matplotlib")
    code, _, _ = run(["simulate", "--pp", "2", "--png", str(tmp / "x.svg"), "--no-grid"], capsys)
    assert code == 0
    assert (tmp / "x.svg").read_text().lstrip().startswith("<?xml")


def test_grid_width_from_the_flag_or_columns(capsys, monkeypatch) -> None:
    def widest(argv: list[str]) -> int:
        code, out, _ = run(["simulate", "--pp", "4", *argv], capsys)
        assert code == 0
        grid = out[out.index("\npo-f:"):].split("\n\n")[0]  # the picture, to its blank line
        return max(len(line) for line in grid.splitlines())

    monkeypatch.delenv("COLUMNS", raising=False)
    default = widest([])
    assert 70 < default <= 120
    assert widest(["--width", "60"]) <= 60
    monkeypatch.setenv("COLUMNS", "70")
    assert widest([]) <= 70
    assert widest(["--width", "50"]) <= 50
    monkeypatch.setenv("COLUMNS", "junk")
    assert widest([]) == default


def test_real_processes_answer_without_a_traceback(tmp) -> None:
    """The installed command and the worker entry point, as users and torchrun start them."""
    import subprocess

    cases = [
        (["pipeoffload", "simulate", "--cost-f", "nan"], "--cost-f"),
        (["pipeoffload", "simulate", "--from-csv", str(tmp / "bin.dat")], "--from-csv"),
        ([sys.executable, "-m", "pipeoffload.cli", "train", "--lr", "nan"], "--lr"),
    ]
    for argv, names in cases:
        proc = subprocess.run(argv, cwd=tmp, capture_output=True, text=True, timeout=PATIENCE_S)
        assert_refused(proc.returncode, proc.stderr, names)
    version = subprocess.run(["pipeoffload", "--version"], capture_output=True, text=True,
                             timeout=PATIENCE_S)
    assert version.returncode == 0 and version.stdout.startswith("pipeoffload ")


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX process groups")
def test_ctrl_c_stops_every_rank_and_names_the_latest_checkpoint(tmp) -> None:
    pytest.importorskip("torch")
    import os
    import signal
    import subprocess

    proc = subprocess.Popen(
        [*AS_FROM_A_TERMINAL,  # SIGINT as a terminal gives it, not as inherited
         *("pipeoffload", "train", "--model", "tiny", "--pp", "2", "--batch-size", "8",
           "--microbatches", "4", "--steps", "400", "--log-every", "1", "--no-png",
           "--p2p-timeout", PATIENCE, "--checkpoint-every", "1"),
         "--checkpoint-dir", str(tmp / "ck")],
        cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)  # its own process group, as a terminal's foreground job
    try:
        for line in proc.stdout:
            if re.match(r"step +2/", line):  # step 1's checkpoint is complete by now
                break
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends
        _, err = proc.communicate(timeout=PATIENCE_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "error: interrupted (Ctrl-C); the latest complete checkpoint is" in err, err[-3000:]


def test_every_flag_of_every_subcommand_has_help_text() -> None:
    import argparse

    from pipeoffload.cli.main import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {flag.option_strings[0]}" for name, sub in commands.choices.items()
               for flag in sub._actions if flag.option_strings and not flag.help]
    assert missing == []


def test_workers_do_not_recheck_the_default_picture_path(monkeypatch, capsys) -> None:
    # A user's --no-png must hold in the workers too (a read-only working folder is fine).
    pytest.importorskip("torch")
    from pipeoffload.cli import launch as launch_module

    seen: list[list[str]] = []
    monkeypatch.setattr(launch_module, "launch", lambda argv, config: seen.append(argv) or 0)
    code, _, err = run([*TRAIN], capsys)
    assert code == 0, err
    (argv,) = seen
    assert argv[argv.index("train") + 1] == "--no-png"
