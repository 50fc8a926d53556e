"""Published training runs the planner's step-time model is checked against.

Each run is a measured MFU that nobody here wrote, the exact configuration it ran (from the
paper and the scripts its authors published) and how the framework behaved (sequence
parallelism, overlap, gradient precision). ``predict`` prices it with the planner's own
``Evaluator`` (costing, the simulator, the optimizer step), so a row checks the same code that
``pipeoffload plan`` runs. ``benchmarks/planner_published.py`` prints them all;
docs/planner-model.md says which rows chose the one fitted constant (TABLE4's unchecked rows,
``calibrate_hbm_efficiency``) and which runs were held out (``PublishedRun.held_out``).

Conventions (docs/planner-model.md, "MFU conventions"): MFU counts model FLOPs,
72 B s l h^2 (1 + s / 6h + V / 12 l h) per step for a GPT (Korthikanti et al. 2022, appendix),
against the dense 16-bit datasheet peak. Narayanan et al. 2021 report TFLOP/s per GPU counting
96 B s l h^2 (1 + s / 6h + V / 16 l h), which includes full recompute's second forward; their
MFU is that times 72 (1 + s / 6h + V / 12 l h) / (96 (1 + s / 6h + V / 16 l h)).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from pipeoffload.planner.costing import Framework, MemoryConfig
from pipeoffload.planner.evaluate import Candidate, Evaluator, Plan
from pipeoffload.planner.frameworks import framework_preset
from pipeoffload.planner.hardware import A100_HBM_BYTES_PER_S, Hardware, hardware_preset
from pipeoffload.planner.layer_time import RunConfig, layer_seconds
from pipeoffload.planner.optimizer import OptimizerSpec
from pipeoffload.planner.transformer import MlpKind, Recompute, TransformerSpec

#: Megatron's GPT runs use GPT-2's BPE padded to 51200 at TP8 (Megatron-LM's README of these
#: runs: "All models use a vocabulary size of 51,200 and a sequence length of 2048"); the
#: papers' FLOP formulas use it too.
MEGATRON_VOCAB = 51200


def megatron_gpt(name: str, layers: int, hidden: int, heads: int, *,
                 vocab: int = MEGATRON_VOCAB) -> TransformerSpec:
    """A GPT as Megatron-LM trained it in 2021-22: GeLU, f = 4h, biases, dropout, sequence
    2048, no flash attention (fused scale-mask-softmax), 16-bit, the output layer tied to the
    word embedding (``share_word_embeddings``, whose gradient ``train_step`` all-reduces
    between the first and the last pipeline stage)."""
    return TransformerSpec(num_layers=layers, hidden=hidden, heads=heads, kv_heads=heads,
                           ffn_hidden=4 * hidden, vocab=vocab, seq_len=2048, mlp=MlpKind.GELU,
                           flash_attention=False, dropout=True, bias=True, tied_embeddings=True,
                           name=name)


def narayanan_mfu(tflops_per_gpu: float, spec: TransformerSpec, peak: float = 312e12) -> float:
    """MFU of a throughput Narayanan et al. 2021 report (their 96 B s l h^2 (1 + s/6h +
    V/16lh) count, full recompute included) in the 72 (1 + s/6h + V/12lh) model count."""
    s, h, v, layers = spec.seq_len, spec.hidden, spec.vocab, spec.num_layers
    model = 72 * (1 + s / (6 * h) + v / (12 * layers * h))
    reported = 96 * (1 + s / (6 * h) + v / (16 * layers * h))
    return tflops_per_gpu * 1e12 * model / reported / peak


def priced_as(name: str, *, sharded: bool = False) -> dict[str, object]:
    """A run's framework fields from the named preset (planner/frameworks.py), so that
    ``pipeoffload plan --framework NAME`` prices it the same way."""
    preset = framework_preset(name)
    return {"framework_name": preset.name, "framework": preset.framework,
            "optimizer": preset.with_sharding(sharded)}


@dataclass(frozen=True)
class PublishedRun:
    """One measured run: the model, the layout, the framework's behaviour and the MFU.
    ``framework_name``: the preset of planner/frameworks.py its ``framework`` and
    ``optimizer`` come from (the ablations of benchmarks/planner_published.py change them)."""

    source: str
    row: str
    citation: str
    spec: TransformerSpec
    hardware: str
    tp: int
    pp: int
    dp: int
    schedule: str
    chunks: int
    micro_batch: int
    global_batch: int
    recompute: Recompute
    measured_mfu: float
    framework: Framework = Framework()
    optimizer: OptimizerSpec = OptimizerSpec()
    framework_name: str = "current"
    held_out: bool = False
    notes: tuple[str, ...] = field(default=())

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def label(self) -> str:
        return f"{self.source} {self.row} ({self.recompute.value})"

    def candidate(self) -> Candidate:
        return Candidate(self.schedule, self.dp, self.tp, self.pp, self.chunks, self.micro_batch,
                         self.microbatches, recompute=self.recompute)


def predict(run: PublishedRun, hw: Hardware | None = None,
            spec: TransformerSpec | None = None) -> Plan:
    """The planner's plan for exactly this run (memory budget unbounded: the run did fit), on
    its preset unless ``hw`` is given and for its model unless ``spec`` is (the benchmark's
    ablations take one term out of either)."""
    hw = hw if hw is not None else hardware_preset(run.hardware)
    spec = spec if spec is not None else run.spec
    evaluator = Evaluator(spec, hw, MemoryConfig(optimizer=run.optimizer), math.inf,
                          framework=run.framework)
    return evaluator.evaluate(run.candidate())


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

# Held out on H100: Megatron-LM's README, "Weak Scaling Results" (Megatron-Core r0.8.0, added
# 2024-07-15 in commit f2e5db402c, images/model_table.png): GPT models with vocabulary 131072 and
# sequence 4096 on H100s, MFU against the 989 TFLOP/s dense 16-bit peak (408.8 TFLOP/s per GPU
# is its 41%), data-parallel reduction and parameter gather overlapped (--overlap-grad-reduce
# --overlap-param-gather: the distributed optimizer). Only its rows without pipelining (whose
# interleaving is not published) and with at most two-way tensor parallelism are kept: they ran
# Transformer Engine's --tp-comm-overlap, which also hides the forward's TP collectives, and the
# model prices Megatron's overlap of the backward ones only (pessimistic for TP2 by its few
# exposed collectives of a narrow layer; at TP4 and TP8 the gap would dominate the row). Not
# published, and so assumed: one sequence per microbatch (4 microbatches per step; 2 or 4 would
# raise the prediction), no recompute, flash attention, Megatron's defaults for what the
# README does not set (GeLU with f = 4h, learned positions, biases, dropout 0.1); the output
# layer is untied (the 1.7B name counts it: 1.48B with it tied).


def _megatron_core(row: str, layers: int, hidden: int, heads: int, tp: int, dp: int,
                   global_batch: int, tflops: float) -> PublishedRun:
    spec = TransformerSpec(num_layers=layers, hidden=hidden, heads=heads, kv_heads=heads,
                           ffn_hidden=4 * hidden, vocab=131072, seq_len=4096, mlp=MlpKind.GELU,
                           dropout=True, bias=True, name=f"gpt-{row}")
    return PublishedRun(
        source="Megatron-Core 2024", row=f"{row} on H100", spec=spec,
        citation=f"Megatron-LM README, weak scaling (Megatron-Core r0.8.0), row {row}: TP{tp} "
                 f"PP1 DP{dp}, batch {global_batch}, {tflops} TFLOP/s per GPU",
        hardware="h100-80gb", tp=tp, pp=1, dp=dp, schedule="1f1b", chunks=1, micro_batch=1,
        global_batch=global_batch, recompute=Recompute.NONE, measured_mfu=tflops * 1e12 / 989e12,
        held_out=True, **priced_as("llama3-2024", sharded=True),
        notes=("microbatch size, recompute, dropout and attention kernel assumed (not "
               "published)",))


MEGATRON_CORE_2024: tuple[PublishedRun, ...] = (
    _megatron_core("1.7B", 24, 2048, 16, 1, 48, 192, 408.8),
    _megatron_core("7.1B", 30, 4096, 32, 2, 48, 192, 465.9),
)

PUBLISHED: tuple[PublishedRun, ...] = (NARAYANAN_2021 + KORTHIKANTI_2022 + LLAMA3_2024
                                       + MEGATRON_CORE_2024)


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
