"""benchmarks/gpu_check.sh runs end to end on CPU (shortened; the CUDA tests skip), prints its
table and its memory CHECK lines, and fails when fed a deliberately wrong prediction, so the
script a GPU session runs is known to work, and to be able to fail, before a GPU sees it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from patience import PATIENCE_S

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.sh"
needs_shell = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                 reason="needs bash and coreutils' timeout")


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "GPU_CHECK_LIMIT_S": str(int(PATIENCE_S))}  # its per-step limit: a hang guard here
    return subprocess.run(["bash", str(SCRIPT), "--device", "cpu", "--log-dir", str(tmp_path),
                           *args], env=env, capture_output=True, text=True,
                          timeout=4 * PATIENCE_S)


def _rows(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    assert "| step | status | seconds | result |" in lines
    return [[cell.strip() for cell in line.split("|")[1:-1]] for line in lines
            if line.startswith("| ") and "| step |" not in line]


@needs_shell
def test_gpu_check_runs_on_cpu_and_compares_memory(tmp_path: Path) -> None:
    done = _run(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _rows(done.stdout)
    assert [row[0] for row in rows] == [
        "cuda tests", "cuda tests, sanitizer", "host-ahead stress", "gpu_offload po-f"]
    assert all(row[1] == "ok" for row in rows)
    assert "RELOAD and FETCH bitwise True" in rows[2][3]
    assert "po-f step" in rows[3][3] and "po-f+fetch step" in rows[3][3]
    assert "5/5 memory checks ok" in rows[3][3] and "12/12 memory checks ok" in rows[2][3]
    assert "skipped" in rows[0][3]  # no CUDA here: the CUDA tests say so
    offload_log = (tmp_path / "gpu_offload_po-f.log").read_text()
    assert "CHECK p=4 h=64 s=32 po-f+fetch host pool: ok" in offload_log


@needs_shell
def test_gpu_check_fails_on_a_wrong_prediction(tmp_path: Path) -> None:
    done = _run(tmp_path, "--predict-scale", "0.5", "--memory-only")
    assert done.returncode != 0
    rows = {row[0]: row for row in _rows(done.stdout)}
    assert sorted(rows) == ["gpu_offload po-f", "host-ahead stress"]
    for row in rows.values():
        assert row[1].startswith("FAILED"), row
        assert "memory check(s) FAILED" in row[3]
