"""Published training runs the planner's step-time model is checked against.

The A100 runs of Megatron-LM's papers (Narayanan et al. 2021, Korthikanti et al. 2022) and
Table 4's per-layer times are here, the H100 runs in published_hopper.py, ``PublishedRun`` and
``predict`` in published_run.py. ``benchmarks/planner_published.py`` prints them all;
docs/planner-model.md says which rows chose the fitted constants (TABLE4's unchecked rows,
``calibrate_hbm_efficiency``; published_hopper.py's ``calibrate_hopper``) and which runs were held
out (``PublishedRun.held_out``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeoffload.planner.hardware import A100_HBM_BYTES_PER_S, Hardware, hardware_preset
from pipeoffload.planner.layer_time import RunConfig, layer_seconds
from pipeoffload.planner.published_cp import DGXC_CP
from pipeoffload.planner.published_hopper import DGXC_2024, LLAMA3_2024, MEGATRON_CORE_2024
from pipeoffload.planner.published_run import (
    MEGATRON_VOCAB,
    PublishedRun,
    megatron_gpt,
    narayanan_mfu,
    predict,
    priced_as,
)
from pipeoffload.planner.transformer import Recompute

__all__ = ["DGXC_2024", "KORTHIKANTI_2022", "LLAMA3_2024", "MEGATRON_CORE_2024",
           "MEGATRON_VOCAB", "NARAYANAN_2021", "PUBLISHED", "DGXC_CP", "TABLE4", "LayerTime",
           "PublishedRun", "calibrate_hbm_efficiency", "layer_prediction", "megatron_gpt",
           "narayanan_mfu", "predict", "priced_as"]


# Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM", SC21), Table 1; layouts and microbatch sizes from Megatron-LM's
# examples/sc21/run_table_1.sh (DDP=torch up to 18B: PyTorch DDP overlaps the gradient
# all-reduce with the backward; DDP=local beyond: after the pipeline), --fp16, full recompute
# (--checkpoint-activations), no sequence parallelism (2022), blocking TP all-reduces in the
# backward and blocking pipeline transfers, Megatron's copy of apex's FusedLayerNorm (the
# persistent kernel came in October 2021; layer_work.py, Note [norm kernels]).


def _narayanan(row: str, layers: int, hidden: int, heads: int, tp: int, pp: int, dp: int,
               micro_batch: int, global_batch: int, tflops: float, *, chunks: int = 1,
               held_out: bool = False) -> PublishedRun:
    spec = megatron_gpt(f"gpt-{row}", layers, hidden, heads)
    schedule = "1f1b" if chunks == 1 else "interleaved-1f1b"
    return PublishedRun(
        source="Narayanan 2021", row=row,
        citation=f"Narayanan et al. 2021, Table 1, row {row}: {tflops:g} TFLOP/s per GPU; "
                 f"Megatron-LM examples/sc21/run_table_1.sh",
        spec=spec, hardware="a100-80gb", tp=tp, pp=pp, dp=dp, schedule=schedule,
        chunks=chunks, micro_batch=micro_batch, global_batch=global_batch,
        recompute=Recompute.FULL, measured_mfu=narayanan_mfu(tflops, spec),
        held_out=held_out,
        **priced_as("megatron-2021-torch-ddp" if pp == 1 else "megatron-2021"))


NARAYANAN_2021: tuple[PublishedRun, ...] = (
    _narayanan("1.7B", 24, 2304, 24, 1, 1, 32, 16, 512, 137),
    _narayanan("3.6B", 30, 3072, 32, 2, 1, 32, 16, 512, 138, held_out=True),
    _narayanan("7.5B", 36, 4096, 32, 4, 1, 32, 16, 512, 142),
    _narayanan("18.4B", 40, 6144, 48, 8, 1, 32, 8, 1024, 135),
    _narayanan("39.1B", 48, 8192, 64, 8, 2, 32, 4, 1536, 138),
    _narayanan("76.1B", 60, 10240, 80, 8, 4, 32, 2, 1792, 140, chunks=3, held_out=True),
    _narayanan("145.6B", 80, 12288, 96, 8, 8, 24, 2, 2304, 148, chunks=2),
    _narayanan("310.1B", 96, 16384, 128, 8, 16, 15, 1, 2160, 155, chunks=2, held_out=True),
    _narayanan("529.6B", 105, 20480, 128, 8, 35, 9, 1, 2520, 163, chunks=3),
    _narayanan("1008B", 128, 25600, 160, 8, 64, 6, 1, 3072, 163),
)

# Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
# Table 3 (layouts, data parallel 1), Table 5 (MFU) and section 6 (530B on 2240 GPUs, 54.2% /
# 42.1%); three interleaving stages for 175B and 530B. Present work = selective recompute with
# sequence parallelism; the baseline = full recompute without it. Megatron-LM 2022: --fp16,
# asynchronous TP communication, blocking pipeline transfers, gradient-accumulation fusion
# into fp32 main grads, the gradient all-reduce after the pipeline.


def _korthikanti(row: str, layers: int, hidden: int, heads: int, pp: int, dp: int,
                 micro_batch: int, global_batch: int, chunks: int,
                 mfu: tuple[float, float], citation: str) -> tuple[PublishedRun, ...]:
    spec = megatron_gpt(f"gpt-{row}", layers, hidden, heads)
    schedule = "1f1b" if chunks == 1 else "interleaved-1f1b"
    runs = []
    for recompute, measured, framework in ((Recompute.SELECTIVE, mfu[0], "megatron-2022"),
                                           (Recompute.FULL, mfu[1], "megatron-2022-no-sp")):
        runs.append(PublishedRun(
            source="Korthikanti 2022", row=row, citation=citation, spec=spec,
            hardware="a100-80gb", tp=8, pp=pp, dp=dp, schedule=schedule, chunks=chunks,
            micro_batch=micro_batch, global_batch=global_batch, recompute=recompute,
            measured_mfu=measured, **priced_as(framework)))
    return tuple(runs)


KORTHIKANTI_2022: tuple[PublishedRun, ...] = (
    *_korthikanti("22B", 48, 6144, 64, 1, 1, 4, 4, 1, (0.415, 0.321),
                  "Korthikanti et al. 2022, Table 3 and Table 5, row 22B"),
    *_korthikanti("175B", 96, 12288, 96, 8, 1, 1, 64, 3, (0.514, 0.390),
                  "Korthikanti et al. 2022, Table 3 and Table 5, row 175B (GPT-3)"),
    *_korthikanti("530B", 105, 20480, 128, 35, 1, 1, 280, 3, (0.560, 0.432),
                  "Korthikanti et al. 2022, Table 3 and Table 5, row 530B (MT-NLG)"),
    *_korthikanti("1T", 128, 25600, 160, 64, 1, 1, 512, 1, (0.563, 0.426),
                  "Korthikanti et al. 2022, Table 3 and Table 5, row 1T"),
    *_korthikanti("530B on 2240 GPUs", 105, 20480, 128, 35, 8, 1, 2240, 3, (0.542, 0.421),
                  "Korthikanti et al. 2022, abstract and section 6: MT-NLG 530B on 2240 "
                  "A100s, TP8 x PP35 x DP8"),
)

PUBLISHED: tuple[PublishedRun, ...] = (NARAYANAN_2021 + KORTHIKANTI_2022 + DGXC_2024
                                       + MEGATRON_CORE_2024 + LLAMA3_2024 + DGXC_CP)


@dataclass(frozen=True)
class LayerTime:
    """One measured time of Korthikanti et al. 2022's Table 4: a 22B layer (h 6144, 64 heads,
    s 2048, microbatch 4) on 8 A100s with TP8, forward only or forward and backward."""

    name: str
    recompute: Recompute
    sequence_parallel: bool
    with_backward: bool
    measured_s: float
    checked: bool  # a time the model is checked against; the others fit HBM_EFFICIENCY


TABLE4_SPEC = megatron_gpt("gpt-22B", 48, 6144, 64)
TABLE4: tuple[LayerTime, ...] = (
    LayerTime("baseline, forward", Recompute.NONE, False, False, 7.7e-3, False),
    LayerTime("baseline, forward + backward", Recompute.NONE, False, True, 19.6e-3, False),
    LayerTime("selective recompute", Recompute.SELECTIVE, False, True, 20.9e-3, False),
    LayerTime("sequence parallel, forward", Recompute.NONE, True, False, 7.2e-3, True),
    LayerTime("sequence parallel, forward + backward", Recompute.NONE, True, True, 19.0e-3,
              True),
    LayerTime("selective + sequence parallel", Recompute.SELECTIVE, True, True, 20.3e-3, True),
    LayerTime("full recompute (baseline)", Recompute.FULL, False, True, 27.2e-3, True),
)


def layer_prediction(row: LayerTime, hw: Hardware | None = None) -> float:
    """Seconds the planner gives one Table 4 layer (Megatron 2022: asynchronous TP
    communication, gradient-accumulation fusion)."""
    hw = hw if hw is not None else hardware_preset("a100-80gb")
    run = RunConfig(micro_batch=4, tp=8, recompute=row.recompute,
                    sequence_parallel=row.sequence_parallel)
    seconds = layer_seconds(TABLE4_SPEC, hw, run)
    return seconds.f_s + (seconds.i_s + seconds.w_s if row.with_backward else 0.0)


def calibrate_hbm_efficiency(base: Hardware | None = None) -> float:
    """The share of the A100's datasheet bandwidth that memory-bound work achieves, chosen to
    fit Table 4's three unchecked times (least squares of relative errors, to 0.01): the one
    constant of the A100 preset fitted to a measurement (docs/planner-model.md)."""
    base = base if base is not None else hardware_preset("a100-80gb")
    rows = [row for row in TABLE4 if not row.checked]

    def error(fraction: float) -> float:
        hw = dataclasses.replace(base, hbm_bytes_per_s=fraction * A100_HBM_BYTES_PER_S)
        return sum((layer_prediction(row, hw) / row.measured_s - 1) ** 2 for row in rows)

    return min((step / 100 for step in range(30, 101)), key=error)
