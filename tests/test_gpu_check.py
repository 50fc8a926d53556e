"""benchmarks/gpu_check.sh runs end to end on CPU (shortened; the CUDA tests skip) and prints
its table, so the script a GPU session runs is known to work before a GPU sees it."""

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


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                    reason="needs bash and coreutils' timeout")
def test_gpu_check_runs_on_cpu_and_prints_its_table(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "GPU_CHECK_LIMIT_S": str(int(PATIENCE_S))}  # its per-step limit: a hang guard here
    done = subprocess.run(["bash", str(SCRIPT), "--device", "cpu", "--log-dir", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=4 * PATIENCE_S)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "| step | status | seconds | result |" in lines
    rows = [line for line in lines if line.startswith("| ") and "| step |" not in line]
    assert [row.split("|")[1].strip() for row in rows] == [
        "cuda tests", "cuda tests, sanitizer", "host-ahead stress", "gpu_offload po-f"]
    assert all(row.split("|")[2].strip() == "ok" for row in rows)
    assert "RELOAD and FETCH bitwise True" in rows[2]
    assert "po-f step" in rows[3] and "po-f+fetch step" in rows[3]
    assert "skipped" in rows[0]  # no CUDA here: the CUDA tests say so
