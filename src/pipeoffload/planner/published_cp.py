"""Published H100 runs with context parallelism, and the fit of the one constant they set
(frameworks.py ``CUDNN_ATTENTION_SPEEDUP``).

Source: NVIDIA's dgxc-benchmarking, the Llama 3 recipes of releases v25.02 (commit 8f5cbb3)
and v24.11.1 (commit 35a9aec), as issue 35 quotes them (it names the release of the 8B row on
8 GPUs, v25.02, and not of the others, so those cite both): READMEs and YAMLs give the
layout (TP / PP / virtual stages / DP / CP), micro batch 1, the global batch, sequence 8192,
BF16, no activation recompute, the distributed optimizer, sequence parallelism, TP-comm and
P2P overlap, and the seconds per step, as issue 35 lists them. Llama 3's tokenizer has 128256
entries and its output layer is not tied (planner/presets.py ``llama3-8b``, ``llama3-70b``).
The step time is the check (within 6%); MFU follows from it with the full-square FLOP count
(costing.step_model_flops), against 989 TFLOP/s.
"""

from __future__ import annotations

import dataclasses

from pipeoffload.planner.costing import step_model_flops
from pipeoffload.planner.frameworks import CUDNN_ATTENTION_SPEEDUP
from pipeoffload.planner.presets import model_preset
from pipeoffload.planner.published_hopper import H100_PEAK_FLOPS
from pipeoffload.planner.published_run import PublishedRun, predict, priced_as
from pipeoffload.planner.transformer import Recompute

#: How close each predicted step time must be to the published one (issue 35).
STEP_TIME_TOLERANCE = 0.06


@dataclasses.dataclass(frozen=True)
class _Row:
    """One row as issue 35 gives it (layout TP / PP / v / DP / CP)."""

    model: str
    gpus: int
    tp: int
    pp: int
    chunks: int
    dp: int
    cp: int
    global_batch: int
    step_s: float
    release: str  # "v25.02" where issue 35 names it, else ""


def _run(row: _Row) -> PublishedRun:
    spec = model_preset(row.model)
    release = ("v25.02 (8f5cbb3)" if row.release == "v25.02"
               else "v25.02 (8f5cbb3) / v24.11.1 (35a9aec)")
    layout = f"TP{row.tp} PP{row.pp}" + (f" VP{row.chunks}" if row.chunks > 1 else "") + \
        f" DP{row.dp} CP{row.cp}"
    return PublishedRun(
        source="NVIDIA dgxc CP", row=f"{spec.name} on {row.gpus} H100", spec=spec,
        citation=f"NVIDIA/dgxc-benchmarking {release}, Llama 3 {spec.name}: "
                 f"{layout}, MBS 1, GBS {row.global_batch}, seq 8192, {row.step_s} s per step",
        hardware="h100-80gb", tp=row.tp, pp=row.pp, dp=row.dp, cp=row.cp,
        schedule="interleaved-1f1b" if row.chunks > 1 else "1f1b", chunks=row.chunks,
        micro_batch=1, global_batch=row.global_batch, recompute=Recompute.NONE,
        measured_mfu=step_model_flops(spec, row.global_batch)
        / (row.step_s * row.gpus * H100_PEAK_FLOPS),
        **priced_as("nemo-2025", sharded=True))


DGXC_CP: tuple[PublishedRun, ...] = tuple(_run(row) for row in (
    _Row("llama3-8b", 8, 1, 1, 1, 4, 2, 128, 12.78, "v25.02"),
    _Row("llama3-8b", 128, 1, 1, 1, 64, 2, 2048, 13.16, ""),
    _Row("llama3-70b", 64, 4, 4, 5, 2, 2, 128, 14.61, ""),
    _Row("llama3-70b", 2048, 4, 4, 5, 64, 2, 4096, 14.84, ""),
))


def step_seconds(run: PublishedRun) -> float:
    """The published seconds per step (from the row's MFU, which was made from it)."""
    return step_model_flops(run.spec, run.global_batch) / (
        run.measured_mfu * run.gpus * H100_PEAK_FLOPS)


def step_error(run: PublishedRun, speedup: float = CUDNN_ATTENTION_SPEEDUP) -> float:
    """Predicted over published step time, minus 1, with cuDNN attention at ``speedup``."""
    framework = dataclasses.replace(run.framework, attention_speedup=speedup)
    plan = predict(dataclasses.replace(run, framework=framework))
    return plan.step_time / step_seconds(run) - 1


def cudnn_error(speedup: float) -> float:
    """Sum of squared step-time errors (percent) of the four rows at ``speedup``."""
    return sum((100 * step_error(run, speedup)) ** 2 for run in DGXC_CP)


def calibrate_cudnn_attention(start: float = 1.62) -> float:
    """The speedup, to 0.01, that minimises ``cudnn_error``: a descent over the 0.01 grid from
    ``start`` (the kernels' own benchmark ratio, frameworks.py)."""
    best = round(start, 2)
    error = cudnn_error(best)
    while True:
        scored = min((cudnn_error(round(best + d, 2)), round(best + d, 2)) for d in (-0.01, 0.01))
        if scored[0] >= error:
            return best
        error, best = scored
