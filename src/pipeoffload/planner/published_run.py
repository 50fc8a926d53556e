"""A published training run and how the planner prices it (``PublishedRun``, ``predict``).

Each run is a measured MFU that nobody here wrote, the exact configuration it ran (from the
paper and the scripts its authors published) and how the framework behaved (a preset of
planner/frameworks.py). ``predict`` prices it with the planner's own ``Evaluator`` (costing, the
simulator, the optimizer step), so a row checks the same code that ``pipeoffload plan`` runs.
The rows are in published.py (A100) and published_hopper.py (H100).

Conventions (docs/planner-model.md, "MFU conventions"): MFU counts model FLOPs,
72 B s l h^2 (1 + s / 6h + V / 12 l h) per step for a GPT (Korthikanti et al. 2022, appendix),
against the dense 16-bit datasheet peak. Narayanan et al. 2021 report TFLOP/s per GPU counting
96 B s l h^2 (1 + s / 6h + V / 16 l h), which includes full recompute's second forward; their
MFU is that times 72 (1 + s / 6h + V / 12 l h) / (96 (1 + s / 6h + V / 16 l h)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TypedDict

from pipeoffload.planner.costing import Framework, MemoryConfig
from pipeoffload.planner.evaluate import Candidate, Evaluator, Plan
from pipeoffload.planner.frameworks import framework_preset
from pipeoffload.planner.hardware import Hardware, hardware_preset
from pipeoffload.planner.optimizer import OptimizerSpec
from pipeoffload.planner.transformer import MlpKind, Recompute, TransformerSpec

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


class PricedAs(TypedDict):
    """A run's framework fields, from one preset of planner/frameworks.py."""

    framework_name: str
    framework: Framework
    optimizer: OptimizerSpec


def priced_as(name: str, *, sharded: bool = False) -> PricedAs:
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
    cp: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def label(self) -> str:
        return f"{self.source} {self.row} ({self.recompute.value})"

    def candidate(self) -> Candidate:
        return Candidate(self.schedule, self.dp, self.tp, self.pp, self.chunks, self.micro_batch,
                         self.microbatches, recompute=self.recompute, cp=self.cp)


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
