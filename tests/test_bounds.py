"""Parsing and planning stay near-linear in their input, and what they cannot do in bounded
memory and time is refused with a clear message (issue 25, point 8).

The hostile inputs run in a child process under CPU-time and address-space limits (never a
wall-clock limit: a loaded machine slows the child, it does not make it use more CPU): a fix
that regresses to a range over the largest index, or to per-rank scans, runs out of one of
them instead of passing.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from pipeoffload.core.registry import build_schedule
from pipeoffload.core.schedule import Schedule, loop_placement, v_placement
from pipeoffload.core.text import to_csv_text
from pipeoffload.core.validate import _microbatches_of

ADDRESS_SPACE = 2 << 30


def _simulate_csv(path: Path, *flags: str, cpu_s: int = 60) -> subprocess.CompletedProcess[str]:
    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    return subprocess.run([sys.executable, "-m", "pipeoffload.cli", "simulate", "--from-csv",
                           str(path), "--no-grid", *flags], capture_output=True, text=True,
                          preexec_fn=limited)


@pytest.mark.parametrize("rows,says", [
    (["9999999999999F0"], "stage 0 has no actions"),
    (["0F9999999999999"], "missing forward 0F0"),
    (["0F0,0B0", "1F9999999999999"], "missing forward 0F1"),
    (["0F0,0I0,0W0,0F99999999999999,0I99999999999999,0W99999999999999"], "missing forward 0F1"),
])
def test_a_huge_index_in_one_cell_is_refused_without_work_on_its_scale(tmp_path, rows, says):
    path = tmp_path / "huge.csv"
    path.write_text("\n".join(rows) + "\n")
    done = _simulate_csv(path)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and "Traceback" not in done.stderr


def test_many_ranks_load_and_simulate_in_linear_time(tmp_path):
    """16384 ranks, one microbatch: ~1.5 s of CPU; per-rank scans over every stage (what
    stages_on_rank did) took 38 s."""
    path = tmp_path / "wide.csv"
    path.write_text(to_csv_text(build_schedule("1f1b", 16384, 1)))
    done = _simulate_csv(path, "--json", cpu_s=20)
    assert done.returncode == 0, done.stderr[-2000:]
    assert '"pp": 16384' in done.stdout


@pytest.mark.parametrize("placement", [loop_placement(4, 3), v_placement(5), (0, 1, 1, 0, 2)])
def test_stages_on_rank_lists_each_rank_s_stages_in_order(placement):
    ranks = max(placement) + 1
    schedule = Schedule(tuple(() for _ in range(ranks)), placement, 1)
    for rank in range(ranks):
        assert schedule.stages_on_rank(rank) == tuple(
            s for s, r in enumerate(placement) if r == rank)


@pytest.mark.parametrize("routes", [1, 2, 3])
@pytest.mark.parametrize("microbatches", [3, 4, 7, 10])
def test_the_microbatches_of_a_stage_are_those_whose_route_has_it(routes, microbatches):
    stages = 2 * routes
    split = tuple(tuple(range(2 * i, 2 * i + 2)) for i in range(routes))
    schedule = Schedule(((),), (0,) * stages, microbatches, routes=split if routes > 1 else ())
    for stage in range(stages):
        assert list(_microbatches_of(schedule, stage)) == [
            m for m in range(microbatches) if stage in schedule.route_of(m)]


@pytest.mark.parametrize("flags,says", [
    (["--pp", "512", "--batch-size", "1024"], "stage-microbatches, more than a schedule may"),
    (["--pp", "4", "--dp", "4096", "--batch-size", "32768"], "16384 processes, more than"),
])
def test_train_refuses_work_and_processes_beyond_its_caps_before_any_work(capsys, flags, says):
    pytest.importorskip("torch")
    from pipeoffload.cli.main import main

    assert main(["train", "--model", "tiny", "--steps", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_the_process_cap_follows_the_cores(monkeypatch):
    from pipeoffload.cli import preflight

    monkeypatch.setattr(preflight.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert preflight.local_process_limit() == 3 * preflight.LOCAL_PROCESSES_PER_CPU
    preflight.check_local_processes(3 * preflight.LOCAL_PROCESSES_PER_CPU, 1, 1)
    with pytest.raises(preflight.ConfigError, match="processes, more than train starts"):
        preflight.check_local_processes(3 * preflight.LOCAL_PROCESSES_PER_CPU, 1, 2)
