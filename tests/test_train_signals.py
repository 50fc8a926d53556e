"""Stopping a run on a scheduler's signal (training/signals.py Note: [stopping on a signal]):
every rank finishes the same step, the checkpoint is written and resumes bitwise, the exit
status is 128 + the signal; the launcher forwards SIGTERM / SIGHUP, and workers whose launcher
was SIGKILLed stop by themselves. Real processes where the point is processes."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from terminal import AS_FROM_A_TERMINAL, UNDER_NOHUP, signals_at
from test_runtime_support import one_thread  # noqa: F401 - autouse fixture
from test_train import _children, _is_zombie, needs_gloo, stage_tensors
from test_train import tiny_config as tiny_batch16

from pipeoffload.cli.launch import LaunchConfig, launch
from pipeoffload.parallel import checkpoint as ckpt
from pipeoffload.parallel.topology import Topology
from pipeoffload.training.signals import (
    StopRequest,
    recording_signals,
    stop_on_signals,
    stop_status,
)
from pipeoffload.training.trainer import train

linux = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")


def tiny_config(**changes):
    config = tiny_batch16(pp=2, microbatches=2, measure_baseline=False, grad_clip=None)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, batch_size=4))
    return dataclasses.replace(config, **changes)


def test_a_stop_signal_sets_the_request_and_the_handlers_come_back() -> None:
    with signals_at(signal.SIG_DFL, signal.SIGTERM, signal.SIGHUP):
        with stop_on_signals() as stop:
            assert not stop
            os.kill(os.getpid(), signal.SIGHUP)
            os.kill(os.getpid(), signal.SIGTERM)  # a second request changes nothing
            time.sleep(0.01)  # handlers run between bytecodes of the main thread
            assert (stop.signum, stop.reason) == (signal.SIGHUP, "received SIGHUP")
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
    assert stop_status(signal.SIGTERM) == 143 and stop_status(signal.SIGHUP) == 129


def test_a_signal_ignored_at_the_start_stays_ignored_as_under_nohup() -> None:
    with signals_at(signal.SIG_IGN, signal.SIGHUP), signals_at(signal.SIG_DFL, signal.SIGTERM):
        received: list[int] = []
        with stop_on_signals() as stop, recording_signals(received):
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.01)  # handlers run between bytecodes of the main thread
            assert not stop and received == []
            os.kill(os.getpid(), signal.SIGTERM)  # what is not ignored still stops the run
            time.sleep(0.01)
            assert received == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        with stop_on_signals() as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
            assert stop.signum == signal.SIGTERM


def test_a_stopped_run_saves_its_step_and_resumes_bitwise(tmp_path: Path) -> None:
    stop = StopRequest()

    def request_at_step_2(log) -> None:  # read with the next step's gather: stops after 3
        if log.step == 2:
            stop.request(signal.SIGTERM)

    root = tmp_path / "ck"
    config = tiny_config(steps=5, checkpoint_dir=str(root))
    stopped = train(config, Topology.local(2), on_step=request_at_step_2, stop=stop)
    assert (stopped.stopped_by, stopped.end_step, len(stopped.losses)) == (signal.SIGTERM, 3, 3)
    assert stopped.checkpoint == str(root / "step_00000003") and stopped.simulation is None
    resumed = train(dataclasses.replace(config, resume="auto"), Topology.local(2))
    straight = train(dataclasses.replace(config, checkpoint_dir=str(tmp_path / "s")),
                     Topology.local(2))
    assert stopped.losses + resumed.losses == straight.losses
    a, b = stage_tensors(Path(resumed.checkpoint)), stage_tensors(Path(straight.checkpoint))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # Asked before the first step: nothing is trained or saved.
    early = StopRequest()
    early.request(signal.SIGHUP)
    none = train(dataclasses.replace(config, checkpoint_dir=str(tmp_path / "e")),
                 Topology.local(2), stop=early)
    assert (none.losses, none.checkpoint, none.stopped_by) == ((), None, signal.SIGHUP)


CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    rank = int(os.environ["RANK"])
    mode = sys.argv[1]
    got = []
    signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
    signal.signal(signal.SIGHUP, lambda s, f: got.append(s))
    Path(sys.argv[2], f"ready{rank}").touch()
    if mode == "self-stop":  # as if the scheduler signalled the workers, not the launcher
        got.append(signal.SIGTERM)
    if mode == "fail" and rank == 1:
        sys.exit(3)
    while not got:
        time.sleep(0.01)
    sys.exit(128 + got[0])
""")


def _when_ready(folder: Path, n: int, then) -> threading.Thread:
    def wait() -> None:
        while len(list(folder.glob("ready*"))) < n:
            time.sleep(0.01)
        then()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_the_launcher_forwards_a_stop_signal_and_returns_its_status(
        tmp_path: Path, capfd, signum: int) -> None:
    _when_ready(tmp_path, 3, lambda: os.kill(os.getpid(), signum))
    with signals_at(signal.SIG_DFL, signum):  # as a terminal gives it (tests/terminal.py)
        rc = launch([sys.executable, "-c", CHILD, "wait", str(tmp_path)],
                    LaunchConfig(nprocs=3, grace_s=60, stop_timeout_s=60))
    err = capfd.readouterr().err
    name = signal.Signals(signum).name
    assert rc == 128 + signum, err
    assert f"launch: stopped by {name} (sent to the launcher): every rank finished" in err


def test_workers_stopping_by_themselves_is_a_stop_and_a_failure_is_not(tmp_path: Path,
                                                                       capfd) -> None:
    argv = [sys.executable, "-c", CHILD]
    assert launch([*argv, "self-stop", str(tmp_path)], LaunchConfig(nprocs=2)) == 143
    assert "launch: stopped by SIGTERM (sent to the workers)" in capfd.readouterr().err
    (tmp_path / "x").mkdir()
    rc = launch([*argv, "fail", str(tmp_path / "x")], LaunchConfig(nprocs=2, grace_s=0.5))
    assert rc == 3
    assert "launch: rank 1" in capfd.readouterr().err


WATCHER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from pipeoffload.training.signals import StopRequest, stop_on_signals, watch_parent
    out = Path(sys.argv[2])
    with stop_on_signals() as stop:
        watch_parent(stop, os.getppid(), death_signal=sys.argv[1] == "death-signal",
                     poll_s=0.05)
        out.with_suffix(".ready").touch()
        while not stop:
            time.sleep(0.01)
        out.write_text(f"{stop.signum} {stop.reason}")
        print("after the parent died", flush=True)  # into /dev/null, not a BrokenPipeError
""")
MIDDLE = textwrap.dedent("""
    import subprocess, sys, time
    subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(3600)
""")


@linux
@pytest.mark.parametrize("how", ["death-signal", "polling"])
def test_a_worker_whose_parent_is_killed_stops_by_itself(tmp_path: Path, how: str) -> None:
    out = tmp_path / "stopped.txt"
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE, WATCHER, how, str(out)])
    try:
        while not out.with_suffix(".ready").exists():
            assert middle.poll() is None
            time.sleep(0.02)
        (child,) = (int(c) for c in
                    Path(f"/proc/{middle.pid}/task/{middle.pid}/children").read_text().split())
        middle.kill()
        middle.wait()
        deadline = time.monotonic() + 120  # a bound for a hang, not a speed claim
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert out.read_text().startswith(f"{int(signal.SIGTERM)} ")
        while Path(f"/proc/{child}").exists() and not _is_zombie(child):
            assert time.monotonic() < deadline, "the orphan did not exit"
            time.sleep(0.05)
    finally:
        if middle.poll() is None:
            middle.kill()


TRAIN = ["--model", "tiny", "--pp", "2", "--microbatches", "2", "--batch-size", "4",
         "--steps", "100000", "--no-png", "--no-baseline", "--grad-clip", "0", "--log-every", "1",
         "--p2p-timeout", "120", "--resume", "auto"]


@needs_gloo
@linux
@pytest.mark.slow
def test_sigterm_sighup_sigkill_to_the_launcher_stop_every_worker_and_resume_bitwise(
        tmp_path: Path) -> None:
    """Three runs chained by --resume auto, stopped by SIGTERM to the launcher, SIGHUP to its
    process group and SIGKILL to the launcher; each leaves no worker behind and a checkpoint of
    the step every rank stopped after, and the whole chain equals one uninterrupted run."""
    root, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    argv = [*AS_FROM_A_TERMINAL, sys.executable, "-m", "pipeoffload.cli", "train", *TRAIN,
            "--checkpoint-dir", str(root), "--metrics", str(metrics)]
    done = 0
    for signum, group in ((signal.SIGTERM, False), (signal.SIGHUP, True),
                          (signal.SIGKILL, False)):
        proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            for line in proc.stdout:  # the reporting rank's progress: training runs
                if re.match(r"step +\d+/", line):
                    break
            workers = _children(proc.pid)
            assert sorted(workers) == [0, 1]
            (os.killpg if group else os.kill)(proc.pid, signum)
            _, err = proc.communicate(timeout=300)  # bounds a hang; not a speed claim
        finally:
            if proc.poll() is None:
                proc.kill()
        deadline = time.monotonic() + 180  # the P2P timeout (120 s) and a margin
        while not all(_is_zombie(pid) or not Path(f"/proc/{pid}").exists()
                      for pid in workers.values()):
            assert time.monotonic() < deadline, f"workers left after {signum!r}: {workers}"
            time.sleep(0.1)
        step = ckpt.read_manifest(ckpt.find_checkpoint("latest", root)).step
        assert step > done
        name = signal.Signals(signum).name
        if signum == signal.SIGKILL:
            assert proc.returncode == -signal.SIGKILL
        else:
            assert proc.returncode == stop_status(signum), err[-3000:]
            assert (f"stopped by {name} (received {name}) after step {step} of 100000; "
                    f"checkpoint {root / f'step_{step:08d}'}; continue with --resume auto") in err
            assert f"launch: stopped by {name} (sent to the launcher)" in err
        done = step
    reference = train(tiny_config(steps=done, checkpoint_dir=str(tmp_path / "ref")),
                      Topology.local(2))
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert losses == list(reference.losses)  # exact: three resumes, one run
    ours = stage_tensors(root / f"step_{done:08d}")
    theirs = stage_tensors(Path(reference.checkpoint))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@needs_gloo
@linux
@pytest.mark.slow
def test_a_run_under_nohup_trains_through_sighup_and_stops_on_sigterm(tmp_path: Path) -> None:
    """nohup ignores SIGHUP so that a run outlives its terminal: the launcher and its workers
    (the ignored signal is inherited across exec) train on through a SIGHUP to the process
    group, and a SIGTERM after it stops them as usual (had any process taken the SIGHUP, the
    run would stop by it: the first request wins)."""
    root = tmp_path / "ck"
    argv = [*UNDER_NOHUP, sys.executable, "-m", "pipeoffload.cli", "train", *TRAIN,
            "--checkpoint-dir", str(root)]
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        steps = (int(m.group(1)) for line in proc.stdout
                 if (m := re.match(r"step +(\d+)/", line)))
        first = next(steps, None)
        assert first is not None, proc.stderr.read()[-3000:]
        workers = _children(proc.pid)
        assert sorted(workers) == [0, 1]
        os.killpg(proc.pid, signal.SIGHUP)
        later = next((s for s in steps if s >= first + 2), None)  # training goes on
        assert later is not None, "the run ended after SIGHUP under nohup"
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=300)  # bounds a hang; not a speed claim
    finally:
        if proc.poll() is None:
            proc.kill()
    step = ckpt.read_manifest(ckpt.find_checkpoint("latest", root)).step
    assert proc.returncode == stop_status(signal.SIGTERM), err[-3000:]
    assert (f"stopped by SIGTERM (received SIGTERM) after step {step} of 100000; "
            f"checkpoint {root / f'step_{step:08d}'}") in err
    assert "launch: stopped by SIGTERM (sent to the launcher)" in err
    assert step >= later
