"""Published H100 training runs, and the fit of the Hopper presets' two sustained efficiencies
(hardware.py, Note [Hopper calibration]) on two of them.

Sources, each with the file and commit its numbers are read from:
- NVIDIA's dgxc-benchmarking v24.11.1 (commit 35a9aec), nemo_megatron/README_175b.md, the BF16
  table of GPT-3 175B on 128 to 2048 H100s, and nemo_megatron/gpt3_175b_hydra.yaml, its
  configuration (DGXC_2024);
- Megatron-LM's README, weak-scaling table (images/model_table.png, added in f2e5db402c, as
  shipped in core_r0.8.0, baf94af3c6): nine GPT models from 1.7B to 462B (MEGATRON_CORE_2024);
- Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4 (LLAMA3_2024).
The 128-GPU GPT-3 row and the README's 1.7B row fit the two constants (``calibrate_hopper``);
every other row is held out.
"""

from __future__ import annotations

import dataclasses

from pipeoffload.planner.costing import step_model_flops
from pipeoffload.planner.hardware import (
    H100_FLASH_ATTENTION_FLOPS,
    H100_GEMM_BURST_FLOPS,
    Hardware,
    hardware_preset,
)
from pipeoffload.planner.published_run import PublishedRun, predict, priced_as
from pipeoffload.planner.transformer import MlpKind, Recompute, TransformerSpec

#: The dense 16-bit peak the H100 rows' MFU is quoted against (H100 SXM datasheet).
H100_PEAK_FLOPS = 989e12

# dgxc-benchmarking v24.11.1 (35a9aec): nemo_megatron/gpt3_175b_hydra.yaml runs GPT-3 175B
# (96 layers, hidden 12288, 96 heads, ffn 49152, seq 2048, hidden and attention dropout 0.1,
# GPT2BPETokenizer padded to make_vocab_size_divisible_by 128 x TP 4: 50688) with TP 4, PP 8,
# virtual pipeline 12 (one layer per stage), micro batch 1, global batch 16 per node, no
# activation recompute, sequence parallelism, ub_tp_comm_overlap (Transformer Engine's
# userbuffers), overlap_p2p_comm, distributed_fused_adam with overlap_grad_sync and
# overlap_param_sync; launch.sh sets NVTE_FUSED_ATTN=0 (Transformer Engine runs the
# flash-attn package) and fp8 false for BF16. README_175b.md's BF16 table: seconds per step on
# 128 / 256 / 512 / 1024 / 2048 H100s (global batch 256 .. 4096). NeMo's GPT ties its output
# layer to the embedding (share_embeddings_and_output_weights, NeMo's default).
_GPT3_175B_NEMO = TransformerSpec(num_layers=96, hidden=12288, heads=96, kv_heads=96,
                                  ffn_hidden=49152, vocab=50688, seq_len=2048, mlp=MlpKind.GELU,
                                  dropout=True, bias=True, tied_embeddings=True,
                                  name="gpt3-175b-nemo")


def _dgxc(gpus: int, step_s: float) -> PublishedRun:
    batch = 2 * gpus
    return PublishedRun(
        source="NVIDIA dgxc 2024", row=f"GPT-3 175B on {gpus} H100", spec=_GPT3_175B_NEMO,
        citation=f"NVIDIA/dgxc-benchmarking v24.11.1 (35a9aec), nemo_megatron/README_175b.md, "
                 f"BF16: {gpus} H100s, global batch {batch}, {step_s} s per step; "
                 f"gpt3_175b_hydra.yaml: TP4 PP8 VP12 MBS1",
        hardware="h100-80gb", tp=4, pp=8, dp=gpus // 32, schedule="interleaved-1f1b",
        chunks=12, micro_batch=1, global_batch=batch, recompute=Recompute.NONE,
        measured_mfu=step_model_flops(_GPT3_175B_NEMO, batch) / (step_s * gpus
                                                                  * H100_PEAK_FLOPS),
        held_out=gpus != 128, **priced_as("megatron-core", sharded=True))


DGXC_2024: tuple[PublishedRun, ...] = tuple(
    _dgxc(gpus, step) for gpus, step in ((128, 8.91), (256, 8.95), (512, 9.09), (1024, 9.01),
                                         (2048, 9.02)))

# Megatron-LM README, weak scaling (Megatron-Core r0.8.0; images/model_table.png added in
# f2e5db402c, 2024-07-15): GPT models with vocabulary 131072 and sequence 4096 on H100s, MFU
# against 989 TFLOP/s (408.8 TFLOP/s per GPU is its 41%; Megatron's num_floating_point_operations
# at baf94af3c6 counts the full attention square, as ours does), with --overlap-grad-reduce
# --overlap-param-gather (the distributed optimizer) and --tp-comm-overlap. Not published, and so
# assumed: without pipelining one microbatch per step (the whole 4 sequences of a replica:
# Megatron reduces gradients during the last microbatch's backward, so with 4 microbatches the
# 32B row's exchange would be exposed and the row 15 points slower than measured); with
# pipelining one sequence per microbatch and one layer per virtual stage, as NVIDIA's own
# GPT-3 configuration above runs; no recompute, flash attention, Megatron's defaults for what
# the README does not set (GeLU with f = 4h, learned positions, biases, dropout 0.1); the
# output layer untied (the 1.7B name counts it: 1.48B with it tied).


def _megatron_core(row: str, layers: int, hidden: int, heads: int, tp: int, pp: int,
                   global_batch: int, tflops: float) -> PublishedRun:
    spec = TransformerSpec(num_layers=layers, hidden=hidden, heads=heads, kv_heads=heads,
                           ffn_hidden=4 * hidden, vocab=131072, seq_len=4096, mlp=MlpKind.GELU,
                           dropout=True, bias=True, name=f"gpt-{row}")
    dp = 48
    chunks = layers // pp if pp > 1 else 1
    return PublishedRun(
        source="Megatron-Core 2024", row=f"{row} on H100", spec=spec,
        citation=f"Megatron-LM README, weak scaling (Megatron-Core r0.8.0, "
                 f"images/model_table.png), row {row}: TP{tp} PP{pp} DP{dp}, batch "
                 f"{global_batch}, {tflops} TFLOP/s per GPU",
        hardware="h100-80gb", tp=tp, pp=pp, dp=dp,
        schedule="interleaved-1f1b" if chunks > 1 else "1f1b", chunks=chunks,
        micro_batch=global_batch // dp if pp == 1 else 1, global_batch=global_batch,
        recompute=Recompute.NONE, measured_mfu=tflops * 1e12 / H100_PEAK_FLOPS,
        held_out=row != "1.7B", **priced_as("megatron-core", sharded=True),
        notes=("microbatch size and interleaving assumed (not published)",))


MEGATRON_CORE_2024: tuple[PublishedRun, ...] = (
    _megatron_core("1.7B", 24, 2048, 16, 1, 1, 192, 408.8),
    _megatron_core("7.1B", 30, 4096, 32, 2, 1, 192, 465.9),
    _megatron_core("16B", 32, 6144, 48, 4, 1, 192, 489.1),
    _megatron_core("32B", 48, 7168, 56, 8, 1, 192, 459.6),
    _megatron_core("70B", 84, 8192, 64, 8, 2, 384, 419.7),
    _megatron_core("119B", 92, 10240, 80, 8, 4, 768, 420.5),
    _megatron_core("177B", 96, 12288, 96, 8, 6, 1152, 432.8),
    _megatron_core("314B", 96, 16384, 128, 8, 8, 1536, 474.4),
    _megatron_core("462B", 112, 18432, 144, 8, 16, 3072, 459.9),
)

# Held out on H100: Llama 3 405B (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4, the
# two rows without context parallelism; 8192 tokens per sequence, 16M tokens per batch, BF16).
# Not published, and so assumed: one sequence per microbatch; 4 interleaved stages per rank
# (two layers each; the end stages one layer, as the paper takes one layer from the first and
# the last stage); no activation recompute; flash attention; the gradient reduction overlapped
# and the optimizer sharded (their FSDP).
_LLAMA3_405B = TransformerSpec(num_layers=126, hidden=16384, heads=128, kv_heads=8,
                               ffn_hidden=53248, vocab=128256, seq_len=8192, mlp=MlpKind.SWIGLU,
                               name="llama3-405b")
LLAMA3_2024: tuple[PublishedRun, ...] = tuple(
    PublishedRun(
        source="Llama 3 2024", row=f"405B on {gpus} H100", spec=_LLAMA3_405B,
        citation=f"Dubey et al. 2024, Table 4, {gpus} GPUs TP8 CP1 PP16 DP{gpus // 128}: "
                 f"{tflops} TFLOP/s, BF16 MFU {mfu:.0%}",
        hardware="h100-80gb", tp=8, pp=16, dp=gpus // 128, schedule="interleaved-1f1b",
        chunks=4, micro_batch=1, global_batch=2048, recompute=Recompute.NONE,
        measured_mfu=mfu, held_out=True, **priced_as("llama3-2024", sharded=True),
        notes=("microbatch size, interleaving and attention kernel assumed (not published)",
               "Meta's MFU counts its own FLOPs; ours counts the full s x s attention square"))
    for gpus, tflops, mfu in ((8192, 430, 0.43), (16384, 400, 0.41)))

#: The rows the Hopper efficiencies are fitted on (every other H100 row is held out).
HOPPER_FIT_ROWS: tuple[PublishedRun, ...] = tuple(
    run for run in DGXC_2024 + MEGATRON_CORE_2024 if not run.held_out)


def hopper_preset(gemm: float, attention: float, base: Hardware | None = None) -> Hardware:
    """The H100 preset with its matmul and flash-attention rates at these shares of the burst
    rates (hardware.py, Note [Hopper calibration])."""
    base = base if base is not None else hardware_preset("h100-80gb")
    return dataclasses.replace(base, bf16_flops_per_s=gemm * H100_GEMM_BURST_FLOPS,
                               attention_flops_per_s=attention * H100_FLASH_ATTENTION_FLOPS)


def hopper_error(gemm: float, attention: float) -> float:
    """Sum of squared MFU errors (points) of the fit rows at these efficiencies."""
    hw = hopper_preset(gemm, attention)
    return sum((100 * (predict(run, hw).mfu - run.measured_mfu)) ** 2
               for run in HOPPER_FIT_ROWS)


def calibrate_hopper(start: tuple[float, float] = (1.0, 1.0)) -> tuple[float, float]:
    """The (GEMM, attention) efficiencies, to 0.01, that minimise ``hopper_error``: a descent
    over the 0.01 grid from ``start``, one step to the best of the eight neighbours at a time
    (the error is smooth and has one minimum in the range, tests/test_planner_published.py)."""
    best = (round(start[0], 2), round(start[1], 2))
    error = hopper_error(*best)
    while True:
        steps = [(round(best[0] + dg, 2), round(best[1] + da, 2))
                 for dg in (-0.01, 0.0, 0.01) for da in (-0.01, 0.0, 0.01) if dg or da]
        scored = min((hopper_error(*point), point) for point in steps)
        if scored[0] >= error:
            return best
        error, best = scored
