"""The planner's step-time model against published measurements nobody here wrote (issue 21):
one test per source. Each prices the exact published configuration with the planner's own
Evaluator; benchmarks/planner_published.py prints the same rows with their sources."""

from __future__ import annotations

import functools

import pytest

from pipeoffload.planner.hardware import HBM_EFFICIENCY
from pipeoffload.planner.published import (
    KORTHIKANTI_2022,
    LLAMA3_2024,
    MEGATRON_CORE_2024,
    NARAYANAN_2021,
    TABLE4,
    PublishedRun,
    calibrate_hbm_efficiency,
    layer_prediction,
    megatron_gpt,
    narayanan_mfu,
    predict,
)
from pipeoffload.planner.transformer import Recompute

#: Issue 21's bar, in MFU points.
BAR = 3.0
#: Issue rows the model misses by more than the bar today, with the largest miss accepted
#: (docs/planner-model.md, "What the model still misses": after round 3's sourced terms,
#: Narayanan's 529.6B run is 0.1 point over, with no sourced term left for it). A regression
#: past this fails; every other issue row must stay within the bar.
KNOWN_OVER = {
    "Narayanan 2021 529.6B (full)": 3.3,
}


@functools.cache
def _plan(run: PublishedRun):  # -> Plan; each run is simulated once per test session
    return predict(run)


def _errors(runs: tuple[PublishedRun, ...]) -> dict[str, float]:
    return {run.label: 100 * (_plan(run).mfu - run.measured_mfu) for run in runs}


def _check_bar(errors: dict[str, float]) -> None:
    for label, error in errors.items():
        assert abs(error) <= KNOWN_OVER.get(label, BAR), f"{label}: {error:+.1f} MFU points"


def test_narayanan_2021_table1_within_the_bar() -> None:
    """Narayanan et al. 2021, Table 1 (the issue's seven rows): full recompute, no sequence
    parallelism, blocking TP and pipeline transfers, DDP as examples/sc21 runs it."""
    errors = _errors(tuple(run for run in NARAYANAN_2021 if not run.held_out))
    assert len(errors) == 7
    _check_bar(errors)
    # their TFLOP/s convert to the MFU column (96 vs 72 FLOP counts)
    assert narayanan_mfu(137, megatron_gpt("1.7B", 24, 2304, 24)) == pytest.approx(0.335,
                                                                                   abs=5e-4)


def test_korthikanti_2022_tables_3_and_5_and_the_2240_gpu_run() -> None:
    """Korthikanti et al. 2022: selective recompute with sequence parallelism and the full
    recompute baseline without it, 22B to 1T, and MT-NLG 530B on 2240 GPUs with its published
    interleaved schedule (v = 3, not plain 1F1B)."""
    errors = _errors(KORTHIKANTI_2022)
    assert len(errors) == 10
    _check_bar(errors)
    on_2240 = [run for run in KORTHIKANTI_2022 if run.dp == 8]
    assert all(run.schedule == "interleaved-1f1b" and run.chunks == 3 for run in on_2240)
    # selective recompute is faster than full on every model, as measured
    for selective, full in zip(KORTHIKANTI_2022[::2], KORTHIKANTI_2022[1::2]):
        assert selective.recompute is Recompute.SELECTIVE and full.recompute is Recompute.FULL
        assert _plan(selective).step_time < _plan(full).step_time


def test_korthikanti_2022_table4_layer_times_within_ten_percent() -> None:
    """The 22B layer of Table 4: the four checked times within 10%; the three others are what
    the A100 preset's one fitted constant (HBM_EFFICIENCY) was chosen on."""
    for row in TABLE4:
        error = layer_prediction(row) / row.measured_s - 1
        assert abs(error) <= (0.10 if row.checked else 0.02), f"{row.name}: {error:+.1%}"
    assert sum(row.checked for row in TABLE4) == 4
    assert calibrate_hbm_efficiency() == pytest.approx(HBM_EFFICIENCY, abs=0.011)


def test_held_out_runs_are_predicted_and_reported() -> None:
    """Held-out runs (not used to choose anything) are predicted without error; their misses
    are reported by the benchmark, not bounded here, except that the model must not fall
    behind a measurement by more than the bar (it is optimistic, never pessimistic, today)."""
    held = tuple(run for run in NARAYANAN_2021 + LLAMA3_2024 + MEGATRON_CORE_2024
                 if run.held_out)
    assert len(held) == 7
    for label, error in _errors(held).items():
        assert error > -BAR, f"{label}: {error:+.1f}"


def test_megatron_core_2024_h100_rows_show_the_hopper_presets_optimistic() -> None:
    """Megatron-LM's README weak-scaling rows without pipelining and with at most TP2
    (Megatron-Core r0.8.0 on H100, BF16): the MFU convention is ours (408.8 TFLOP/s per GPU is
    the table's 41% of 989), and the H100 preset predicts them 5-10 points high even with the
    least optimistic microbatch size (docs/planner-model.md, "What the model still misses").
    If a later change brings them within the bar, move them out of this test's range."""
    assert MEGATRON_CORE_2024[0].measured_mfu == pytest.approx(0.413, abs=5e-4)
    assert all(run.micro_batch == 1 and run.pp == 1 and run.tp <= 2 and run.held_out
               for run in MEGATRON_CORE_2024)
    for label, error in _errors(MEGATRON_CORE_2024).items():
        assert 5.0 < error < 10.0, f"{label}: {error:+.1f}"
