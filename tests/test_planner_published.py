"""The planner's step-time model against published measurements nobody here wrote (issue 21):
one test per source. Each prices the exact published configuration with the planner's own
Evaluator; benchmarks/planner_published.py prints the same rows with their sources."""

from __future__ import annotations

import functools

import pytest

from pipeoffload.planner.frameworks import CUDNN_ATTENTION_SPEEDUP
from pipeoffload.planner.hardware import (
    HBM_EFFICIENCY,
    HOPPER_ATTENTION_EFFICIENCY,
    HOPPER_GEMM_EFFICIENCY,
)
from pipeoffload.planner.published import (
    DGXC_2024,
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
from pipeoffload.planner.published_cp import (
    DGXC_CP,
    STEP_TIME_TOLERANCE,
    calibrate_cudnn_attention,
    step_seconds,
)
from pipeoffload.planner.published_hopper import HOPPER_FIT_ROWS, calibrate_hopper
from pipeoffload.planner.transformer import Recompute

#: Issue 21's bar, in MFU points.
BAR = 3.0
#: Issue rows the model misses by more than the bar today, with the largest miss accepted
#: (docs/planner-model.md, "What the model still misses": after round 3's sourced terms,
#: Narayanan's 529.6B run is 0.1 point over, with no sourced term left for it). A regression
#: past this fails; every other issue row must stay within the bar.
KNOWN_OVER = {
    "Narayanan 2021 529.6B (full)": 3.3,
    # Megatron-LM README rows held out from the Hopper fit, whose microbatch size and
    # interleaving are not published (docs/planner-model.md, "Hopper"): the assumption of
    # published_hopper.py prices them this far off; other choices move them by up to 10 points.
    "Megatron-Core 2024 7.1B on H100 (none)": 3.8,
    "Megatron-Core 2024 16B on H100 (none)": 4.8,
    "Megatron-Core 2024 70B on H100 (none)": 3.6,
    "Megatron-Core 2024 177B on H100 (none)": 3.7,
    "Megatron-Core 2024 462B on H100 (none)": 5.0,
    "Llama 3 2024 405B on 8192 H100 (none)": 3.9,
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
    """Held-out runs (not used to choose anything) are predicted without error and none falls
    behind its measurement by more than the bar (or its known miss)."""
    held = tuple(run for run in NARAYANAN_2021 + DGXC_2024 + MEGATRON_CORE_2024 + LLAMA3_2024
                 if run.held_out)
    assert len(held) == 3 + 4 + 8 + 2
    for label, error in _errors(held).items():
        assert error > -KNOWN_OVER.get(label, BAR), f"{label}: {error:+.1f}"


def test_dgxc_2024_gpt3_175b_on_128_to_2048_h100s_within_the_bar() -> None:
    """NVIDIA's dgxc-benchmarking v24.11.1, GPT-3 175B in BF16 (TP4 PP8 VP12, micro batch 1,
    no recompute, distributed optimizer): the 128-GPU row fits the Hopper efficiencies, the four
    larger ones are held out; every row within the bar."""
    assert [run.held_out for run in DGXC_2024] == [False, True, True, True, True]
    # its README's 49.93% (their FLOPs rounded to 2.20e15 per sequence; unrounded 50.03%)
    assert DGXC_2024[0].measured_mfu == pytest.approx(0.4993, abs=1.5e-3)
    errors = _errors(DGXC_2024)
    assert len(errors) == 5 and all(abs(error) <= BAR for error in errors.values()), errors


def test_megatron_core_2024_readme_rows() -> None:
    """Megatron-LM's README weak-scaling rows (Megatron-Core r0.8.0 on H100, BF16; MFU in our
    convention: 408.8 TFLOP/s per GPU is its 41% of 989): the 1.7B row fits the Hopper
    efficiencies; the eight others are held out, within the bar or their known miss."""
    assert MEGATRON_CORE_2024[0].measured_mfu == pytest.approx(0.413, abs=5e-4)
    assert [run.held_out for run in MEGATRON_CORE_2024] == [False] + [True] * 8
    errors = _errors(MEGATRON_CORE_2024)
    _check_bar(errors)
    assert sum(abs(error) <= BAR for error in errors.values()) >= 4


def test_llama3_2024_405b_rows() -> None:
    """Dubey et al. 2024's two rows without context parallelism, held out."""
    _check_bar(_errors(LLAMA3_2024))


def test_hopper_efficiencies_are_the_fit_of_their_rows() -> None:
    """HOPPER_GEMM_EFFICIENCY and HOPPER_ATTENTION_EFFICIENCY minimise the fit rows' error on
    the 0.01 grid (no neighbour is better), and the descent reaches them from elsewhere."""
    constants = (HOPPER_GEMM_EFFICIENCY, HOPPER_ATTENTION_EFFICIENCY)
    assert calibrate_hopper(start=constants) == constants
    assert calibrate_hopper(start=(0.96, 0.52)) == constants
    assert {run.row for run in HOPPER_FIT_ROWS} == {"GPT-3 175B on 128 H100", "1.7B on H100"}


def test_dgxc_llama3_context_parallel_rows_within_six_percent_of_their_step_times() -> None:
    """Issue 35: NVIDIA's dgxc-benchmarking Llama 3 8B and 70B at 8192 tokens with CP2 (BF16,
    no recompute, distributed optimizer, priced as nemo-2025): every predicted step time
    within 6% of the published one; cuDNN attention's speedup is the fit of these four rows
    (no neighbour on the 0.01 grid is better, and the descent reaches it from the kernels'
    own benchmark ratio)."""
    assert [(run.tp, run.pp, run.chunks, run.dp, run.cp) for run in DGXC_CP] == [
        (1, 1, 1, 4, 2), (1, 1, 1, 64, 2), (4, 4, 5, 2, 2), (4, 4, 5, 64, 2)]
    assert [round(step_seconds(run), 6) for run in DGXC_CP] == [12.78, 13.16, 14.61, 14.84]
    errors = {run.label: _plan(run).step_time / step_seconds(run) - 1 for run in DGXC_CP}
    assert all(abs(error) <= STEP_TIME_TOLERANCE for error in errors.values()), errors
    assert calibrate_cudnn_attention(start=CUDNN_ATTENTION_SPEEDUP) == CUDNN_ATTENTION_SPEEDUP
    assert calibrate_cudnn_attention() == CUDNN_ATTENTION_SPEEDUP
