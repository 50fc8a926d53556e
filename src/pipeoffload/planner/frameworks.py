"""Named training frameworks the planner can price: how each runs a layout (``Framework``), how
its gradients reach the optimizer (``OptimizerSpec``) and whether it has a flash-attention
kernel. ``pipeoffload plan --framework NAME`` picks one; ``published.py``'s runs are priced
under the one their authors ran, so the CLI reproduces every published row.

``current`` is what ``pipeoffload train`` does (the planner's default). The others are the code
behind the published runs (docs/planner-model.md, "Checked against published runs"):
- ``megatron-2021``, ``megatron-2021-torch-ddp``: Megatron-LM of August 2021 (de7dc40f88, the
  examples/sc21 scripts of Narayanan et al. 2021): fp16 with 16-bit gradients, no sequence
  parallelism, blocking TP all-reduces and pipeline transfers, apex's FusedLayerNorm, no flash
  attention; its local DDP (after the pipeline, DDP=local in run_table_1.sh) or PyTorch DDP
  (overlapped with the backward, DDP=torch).
- ``megatron-2022``, ``megatron-2022-no-sp``: Megatron-LM of 2022 (739cb43dae, Korthikanti et
  al. 2022): fp32 main gradients with gradient-accumulation fusion, asynchronous TP
  communication in the backward, blocking pipeline transfers, the persistent LayerNorm, no
  flash attention; with sequence parallelism (their "present work") or without (their
  baseline).
- ``megatron-core``: Megatron-Core r0.8.0 / NeMo 24.11 with Transformer Engine on Hopper
  (Megatron-LM's README weak-scaling rows, NVIDIA's dgxc-benchmarking v24.11.1): sequence
  parallelism, every TP collective pipelined with the matmul beside it (``--tp-comm-overlap``),
  pipeline transfers overlapped, the distributed optimizer reducing gradients during the last
  backward (``--overlap-grad-reduce --overlap-param-gather``), flash attention.
- ``nemo-2025``: NeMo 25.02 (Megatron-Core with Transformer Engine; NVIDIA's dgxc-benchmarking
  v25.02 Llama 3 runs, the planner's context-parallel rows): ``megatron-core`` with Transformer
  Engine's cuDNN fused attention, which it prefers over the flash-attn package on Hopper
  (NeMo's docs, memory_optimizations.rst, NVIDIA/NeMo PR #9188: "Transformer Engine prefers
  cuDNN flash attention on Hopper+ architectures"), at ``CUDNN_ATTENTION_SPEEDUP`` times the
  calibrated FlashAttention-2 rate.
- ``llama3-2024``: Meta's framework for Llama 3 (Dubey et al. 2024), whose details are not
  published: the planner's defaults with fp32 gradients reduced during the last backward
  (their FSDP) [assumption].
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeoffload.errors import ConfigError
from pipeoffload.planner.costing import Framework
from pipeoffload.planner.layer_work import NormKernel
from pipeoffload.planner.optimizer import DP_COPY_BYTES, OptimizerSpec
from pipeoffload.planner.transformer import TransformerSpec


@dataclass(frozen=True)
class FrameworkPreset:
    """One framework: ``framework`` (layer_time.py's overlaps, costing.py's transfers),
    ``optimizer`` (gradient precision, DP overlap and copies; ``sharded`` is the user's choice,
    ``with_sharding``), and ``flash_attention``: False when the framework has no flash kernel
    (the model's attention is then priced unfused), None to keep the model's."""

    name: str
    summary: str
    framework: Framework
    optimizer: OptimizerSpec
    flash_attention: bool | None = None

    def model(self, spec: TransformerSpec) -> TransformerSpec:
        """``spec`` as this framework runs it."""
        if self.flash_attention is None or spec.flash_attention == self.flash_attention:
            return spec
        return dataclasses.replace(spec, flash_attention=self.flash_attention)

    def with_sharding(self, sharded: bool, *, fsdp: bool = False) -> OptimizerSpec:
        """This framework's optimizer, its state sharded over DP (ZeRO-1) or not; ``fsdp``:
        train's ``--zero 3`` (priced as ZeRO-1, optimizer.py Note [zero 3 terms])."""
        return dataclasses.replace(self.optimizer, sharded=sharded or fsdp, fsdp=fsdp)


#: cuDNN fused attention's rate over the Hopper presets' FlashAttention-2 rate (hardware.py,
#: Note [Hopper calibration]), **fitted** (published_cp.calibrate_cudnn_attention) on the four
#: dgxc-benchmarking v25.02 / v24.11.1 Llama 3 rows that use context parallelism. The kernels'
#: own benchmark puts it near 1.62 (FlashAttention-3 paper, Shah et al. 2024, figure 5, H100
#: SXM5, BF16, head dim 128, sequence 8k: cuDNN 600 against FlashAttention-2's 370 TFLOP/s);
#: the fit lands higher because the FlashAttention-2 rate it scales was fitted on runs with
#: attention dropout, which the Llama runs do not have (docs/planner-model.md, "Context
#: parallelism").
CUDNN_ATTENTION_SPEEDUP = 2.0

_MEGATRON_2021 = Framework(sequence_parallel=False, tp_overlap=False, p2p_blocking=True,
                           norm_kernel=NormKernel.APEX)
_MEGATRON_2022 = Framework(sequence_parallel=True, p2p_blocking=True)
_MEGATRON_2022_OPTIMIZER = OptimizerSpec(grad_bytes=4,
                                         dp_copy_bytes=DP_COPY_BYTES["megatron-local-2022"])

FRAMEWORKS: dict[str, FrameworkPreset] = {preset.name: preset for preset in (
    FrameworkPreset(
        "current", "pipeoffload train: sequence parallelism, overlapped backward TP "
        "collectives, transfers posted ahead, the DP exchange after the pipeline",
        Framework(), OptimizerSpec()),
    FrameworkPreset(
        "megatron-2021", "Megatron-LM 2021 (Narayanan et al.), local DDP: fp16 gradients, no "
        "sequence parallelism, blocking TP and pipeline transfers, apex LayerNorm, no flash "
        "attention", _MEGATRON_2021,
        OptimizerSpec(grad_bytes=2, dp_copy_bytes=DP_COPY_BYTES["megatron-local-2021"]),
        flash_attention=False),
    FrameworkPreset(
        "megatron-2021-torch-ddp", "megatron-2021 with PyTorch DDP (the gradient all-reduce "
        "overlapped with the backward)", _MEGATRON_2021,
        OptimizerSpec(grad_bytes=2, overlap_grad_reduce=True,
                      dp_copy_bytes=DP_COPY_BYTES["torch-ddp-fp16"]),
        flash_attention=False),
    FrameworkPreset(
        "megatron-2022", "Megatron-LM 2022 (Korthikanti et al.): sequence parallelism, "
        "asynchronous backward TP collectives, blocking pipeline transfers, fp32 main "
        "gradients, no flash attention", _MEGATRON_2022, _MEGATRON_2022_OPTIMIZER,
        flash_attention=False),
    FrameworkPreset(
        "megatron-2022-no-sp", "megatron-2022 without sequence parallelism (Korthikanti et "
        "al.'s baseline)", dataclasses.replace(_MEGATRON_2022, sequence_parallel=False),
        _MEGATRON_2022_OPTIMIZER, flash_attention=False),
    FrameworkPreset(
        "megatron-core", "Megatron-Core r0.8 / NeMo 24.11 with Transformer Engine: sequence "
        "parallelism, every TP collective overlapped with a matmul (--tp-comm-overlap), "
        "transfers posted ahead, fp32 gradients reduced during the last backward",
        Framework(userbuffers=True), OptimizerSpec(grad_bytes=4, overlap_grad_reduce=True)),
    FrameworkPreset(
        "nemo-2025", "NeMo 25.02 (Megatron-Core, Transformer Engine): megatron-core with "
        "cuDNN fused attention", Framework(userbuffers=True,
                                           attention_speedup=CUDNN_ATTENTION_SPEEDUP),
        OptimizerSpec(grad_bytes=4, overlap_grad_reduce=True)),
    FrameworkPreset(
        "llama3-2024", "Meta's Llama 3 framework as assumed: the planner's defaults with fp32 "
        "gradients reduced during the last backward", Framework(),
        OptimizerSpec(grad_bytes=4, overlap_grad_reduce=True)),
)}


def framework_preset(name: str) -> FrameworkPreset:
    """The preset called ``name`` (ConfigError listing the names otherwise)."""
    try:
        return FRAMEWORKS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown framework {name!r}; known: {', '.join(FRAMEWORKS)}") from None
