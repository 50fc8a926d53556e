"""benchmarks/gpu_multi.sh: skips cleanly without enough GPUs, and its worker runs end to end on
gloo with two CPU processes (the checks a multi-GPU session runs, known to work before one
does: exactness over three steps of zbv, interleaved-1f1b and dualpipe, a tied Hugging Face
model, a reserved host pool that never grows inside a step)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_multi.sh"
needs_shell = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                 reason="needs bash and coreutils' timeout")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=900)


@needs_shell
def test_gpu_multi_skips_cleanly_with_fewer_gpus_than_processes() -> None:
    import torch

    done = _run("--nproc", str(max(2, torch.cuda.device_count() + 1)))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gpu_multi: SKIPPED:" in done.stdout and "need one each" in done.stdout


@needs_shell
@pytest.mark.slow
def test_gpu_multi_runs_on_two_gloo_processes() -> None:
    done = _run("--device", "cpu", "--nproc", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT: ok: 2 processes on cpu" in done.stdout
    for name in ("zbv p=2 3 steps exact: ok", "interleaved-1f1b p=2 3 steps exact: ok",
                 "dualpipe p=2 3 steps exact: ok",
                 "zbv offloaded p=2, rank 1: no host allocation in a step: ok"):
        assert f"[rank 0] CHECK {name}" in done.stdout or f"[rank 1] CHECK {name}" in done.stdout
