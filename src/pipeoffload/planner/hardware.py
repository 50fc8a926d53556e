"""Hardware presets: how fast a GPU computes and how fast it reaches host memory and its peers.

Figures are *achievable* rates for whole transformer layers and pinned-memory copies, not
datasheet peaks; each preset's sources are listed beside its numbers below and in
docs/planner-model.md. ``pipeoffload probe`` measures the local GPU and saves a preset as JSON
(``Hardware.to_json`` / ``Hardware.from_json`` / ``load_hardware``). The ``Hardware`` record
itself is in hardware_spec.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pipeoffload.errors import ConfigError
from pipeoffload.planner.hardware_spec import Hardware

__all__ = ["A100_HBM_BYTES_PER_S", "H100_FLASH_ATTENTION_FLOPS", "H100_GEMM_BURST_FLOPS",
           "HBM_EFFICIENCY", "HOPPER_ATTENTION_EFFICIENCY", "HOPPER_GEMM_EFFICIENCY", "Hardware",
           "device_preset", "hardware_names", "hardware_preset", "load_hardware"]

_MIB = 2**20


def _preset(**kwargs: Any) -> Hardware:
    return Hardware(**kwargs)


_TB = 1e12

# Sources (docs/planner-model.md, "Hardware presets", has the full reasoning):
# - bf16_flops_per_s: measured Maximum Achievable Matmul FLOPS, BF16 (S. Bekman,
#   stas00/ml-engineering, compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS
#   comparison table"): A100 SXM 271.2, H100 SXM 794.5 TFLOP/s. H200: the H100 SXM's (same die,
#   clocks and 700 W); an 8192^3 bf16 product measured 769-798 TFLOP/s on an H200
#   (docs/planner-model.md).
# - peak_flops_per_s: datasheet dense 16-bit, A100 312, H100 SXM / H200 989 TFLOP/s.
# - hbm_bytes_per_s: HBM_EFFICIENCY of the datasheet bandwidth (A100 80GB 2.039, H100 SXM 3.35,
#   H200 4.8 TB/s). HBM_EFFICIENCY is the one fitted constant: what Megatron's memory-bound
#   kernels achieve on a 22B layer (Korthikanti et al. 2022, Table 4, the three times without
#   sequence parallelism; published.calibrate_hbm_efficiency). A bare device-to-device copy
#   does better (4.3 of 4.8 TB/s, 0.9, measured on an H200): small and
#   strided kernels, fp32 statistics and RNG-bound dropout run below a copy's rate. The same
#   fraction on H100 / H200 [assumption].
# - attention_flops_per_s: FlashAttention-2 (Dao 2023, section 4.1): on A100 forward up to 73%
#   and backward up to 63% of 312 TFLOP/s; with the backward's 2.5x the forward's FLOPs that is
#   0.65 x 312 = 203 TFLOP/s together [derived]. On H100 "up to 335 TFLOP/s" forward and
#   backward together (FA2 without Hopper instructions; FlashAttention-3 is faster).
# - kernel_launch_s: 4 us between dependent kernels of an eager framework [assumption: NVIDIA's
#   CUDA Graphs introduction (technical blog, 2019) measures launch overheads of a few us].
# - sm_count: A100 108, H100 SXM / H200 132 streaming multiprocessors (NVIDIA's A100 and H100
#   architecture whitepapers).
# - host_bytes_per_node: system memory of NVIDIA's DGX of that GPU, 2 TB each (DGX A100 640GB,
#   DGX H100, DGX H200 datasheets).
# - host link GB/s: the PipeOffload authors' code (docs/method.md section 2); H200 the H100's
#   PCIe 5.
# - Memory: nvidia-smi's total (A100 80GB 81920 MiB, H100 80GB 81559 MiB, H200 143771 MiB).
# - NVLink per direction: A100 NVLink3 300 GB/s, H100/H200 NVLink4 450 GB/s (datasheets).
# - Network: one 200 Gb/s (A100) / 400 Gb/s (H100, H200) NIC per GPU, as in DGX systems.
# - A100s share a PCIe switch in pairs (PipeOffload paper, section 4.2).
# - busbw fractions: nccl-tests' large-message bus bandwidth over the nominal link rate,
#   A100 NVLink 3 ~235 of 300 GB/s; H100 / H200 all-gather and reduce-scatter ~360 of 450
#   [assumption]. Network, A100 (200 Gb/s HDR, one NIC per GPU): NCCL 2.17 all-reduce of 1 GB
#   on Azure NDmv4 (microsoft/mscclpp, docs/performance-ndmv4.md): 2 nodes x 8 GPUs 183.82 GB/s
#   busbw over 8 x 25 GB/s = 0.92; 2 nodes x 1 GPU 18.65 of 25 GB/s = 0.746 (one GPU per node).
#   H100 / H200 (400 Gb/s NDR): "46-48GB/s per NIC" (NCCL's maintainer, NVIDIA/nccl-tests issue
#   #290), 47 of 50 = 0.94; one GPU per node: the A100's ratio 0.746 / 0.92 applied, 0.76
#   [assumption].
# - collective_sms: NCCL's channels, one thread block (one SM) each: 24 on 8 A100s with
#   NVSwitch ("Channel 23/24" in the NCCL log of NVIDIA/nccl-tests issue #100, an HGX A100),
#   16 on 8 H100s ("16 coll channels", NVIDIA/nccl issues #892, an 8 x H800 node, and #1453, an
#   H100 cluster).
# - GEMM ridge: datasheet dense bf16 over HBM bandwidth (A100 80GB 312 TFLOP/s / 2.039 TB/s,
#   H100 SXM 989 / 3.35, H200 989 / 4.8), NVIDIA's ops:byte ratio.
# - Hopper sustained efficiencies (Note [Hopper calibration]): HOPPER_GEMM_EFFICIENCY and
#   HOPPER_ATTENTION_EFFICIENCY of the burst rates above, fitted (published_hopper.py,
#   ``calibrate_hopper``) on NVIDIA's GPT-3 175B run on 128 H100s (dgxc-benchmarking v24.11.1,
#   35a9aec, nemo_megatron/README_175b.md: 8.91 s per step in BF16) and the Megatron-LM README's
#   1.7B row (Megatron-Core r0.8.0, baf94af3c6, images/model_table.png: 408.8 TFLOP/s per GPU).
HBM_EFFICIENCY = 0.70
HOPPER_GEMM_EFFICIENCY = 0.93
HOPPER_ATTENTION_EFFICIENCY = 0.47
# Datasheet figures, each stated once: dense 16-bit peak FLOP/s and HBM bandwidth.
_A100_PEAK_FLOPS = 312e12
_H100_PEAK_FLOPS = 989e12  # H100 SXM and H200
A100_HBM_BYTES_PER_S = 2.039 * _TB
_H100_HBM_TB_PER_S = 3.35
_H200_HBM_TB_PER_S = 4.8
#: H100 SXM burst rates the Hopper efficiencies scale: the best matmul of a shape search (S.
#: Bekman's table) and FlashAttention-2's "up to 335 TFLOP/s" forward and backward.
H100_GEMM_BURST_FLOPS = 794.5e12
H100_FLASH_ATTENTION_FLOPS = 335e12

# Note [Hopper calibration]: against the A100 model, a Hopper run of the same step model came
# out 7-10 MFU points fast on every published H100 run (docs/planner-model.md). Two constants
# scale the burst rates to what a sustained run achieves: matmuls at HOPPER_GEMM_EFFICIENCY
# (an H100 at its 700 W limit clocks below its boost, and cuBLAS's best shape is not every
# shape) and flash attention at HOPPER_ATTENTION_EFFICIENCY (with attention dropout, at the
# runs' 32-128 heads per GPU, below FlashAttention-2's best; the term also carries whatever
# else grows with the sequence length). They were fitted on one row of each of two sources, the
# fully published GPT-3 175B run (GEMM-bound, seq 2048) and the Megatron-LM README's 1.7B row
# (attention-heavy: s / 6h = 0.33), and every other H100 row is held out
# (benchmarks/planner_published.py). H200 shares the die, so it shares them [assumption].
_PRESETS: dict[str, Hardware] = {
    "a100-80gb": _preset(
        name="a100-80gb",
        sm_count=108,
        bf16_flops_per_s=271.2e12,
        peak_flops_per_s=_A100_PEAK_FLOPS,
        hbm_bytes=81920 * _MIB,
        hbm_bytes_per_s=HBM_EFFICIENCY * A100_HBM_BYTES_PER_S,
        attention_flops_per_s=0.65 * _A100_PEAK_FLOPS,
        kernel_launch_s=4e-6,
        d2h_bytes_per_s=15e9,
        h2d_bytes_per_s=15e9,
        intra_node_bytes_per_s=300e9,
        inter_node_bytes_per_s=25e9,
        gpus_per_node=8,
        gpus_per_host_link=2,
        host_bytes_per_node=2 * _TB,
        intra_node_busbw_fraction=0.78,
        inter_node_busbw_fraction=0.92,
        inter_node_one_gpu_busbw_fraction=0.746,
        collective_sms=24,
        gemm_ridge_flops_per_byte=_A100_PEAK_FLOPS / A100_HBM_BYTES_PER_S,
    ),
    "h100-80gb": _preset(
        name="h100-80gb",
        sm_count=132,
        bf16_flops_per_s=HOPPER_GEMM_EFFICIENCY * H100_GEMM_BURST_FLOPS,
        peak_flops_per_s=_H100_PEAK_FLOPS,
        hbm_bytes=81559 * _MIB,
        hbm_bytes_per_s=HBM_EFFICIENCY * _H100_HBM_TB_PER_S * _TB,
        attention_flops_per_s=HOPPER_ATTENTION_EFFICIENCY * H100_FLASH_ATTENTION_FLOPS,
        kernel_launch_s=4e-6,
        d2h_bytes_per_s=21e9,
        h2d_bytes_per_s=21e9,
        intra_node_bytes_per_s=450e9,
        inter_node_bytes_per_s=50e9,
        gpus_per_node=8,
        gpus_per_host_link=1,
        host_bytes_per_node=2 * _TB,
        intra_node_busbw_fraction=0.8,
        inter_node_busbw_fraction=0.94,
        inter_node_one_gpu_busbw_fraction=0.76,
        collective_sms=16,
        gemm_ridge_flops_per_byte=_H100_PEAK_FLOPS / (_H100_HBM_TB_PER_S * _TB),
    ),
}
# The H200: the H100's die, clocks, links and host side with more and faster HBM.
_PRESETS["h200"] = dataclasses.replace(
    _PRESETS["h100-80gb"], name="h200", hbm_bytes=143771 * _MIB,
    hbm_bytes_per_s=HBM_EFFICIENCY * _H200_HBM_TB_PER_S * _TB,
    gemm_ridge_flops_per_byte=_H100_PEAK_FLOPS / (_H200_HBM_TB_PER_S * _TB))


# Blackwell, from NVIDIA's datasheets; nothing here is measured or fitted on a Blackwell run.
# - B200 (HGX / DGX B200, 1000 W): dense FP16/BF16 2.25 PFLOP/s (HGX B200 datasheet: 4.5
#   PFLOP/s with sparsity), 180 GB HBM3e at 8 TB/s (DGX B200: 1,440 GB and 64 TB/s for eight;
#   MLCommons inference v6.0, Nebius nebius_b200_n1.json: "NVIDIA B200-SXM-180GB"), NVLink 5
#   1.8 TB/s (900 GB/s each way), PCIe Gen5 x16 to the host, one ConnectX-7 400 Gb/s NIC per GPU
#   (the same system file: "8x ConnectX-7 IB NDR 400Gb/s"), 2 TB system memory (DGX B200).
# - GB200 (NVL72, 1200 W): dense FP16/BF16 2.5 PFLOP/s (GB200 NVL72 datasheet: 360 PFLOP/s
#   sparse for 72 GPUs), 186 GB HBM3e at 8 TB/s (13.4 TB and 576 TB/s for 72; MLCommons
#   inference v6.1, Crusoe GB200-NVL72_GB200-186GB_aarch64x16_Dynamo.json: "186 GB"), NVLink 5
#   1.8 TB/s across the whole rack (one NVLink domain of 72 GPUs: gpus_per_node = 72), NVLink-C2C
#   to the Grace CPU at 900 GB/s (450 GB/s each way) shared by the superchip's two GPUs, 17 TB of
#   LPDDR5X per rack (the datasheet's "up to 17 TB").
# - SMs: 148 per B200 (not on NVIDIA's datasheets; the SM100 target of tile-ai/TileFoundry PR
#   #76 and CUDA kernels written for it) [secondary source]; GB200's B200 the same
#   [assumption].
# - Achievable rates [assumption, no Blackwell run checked]: matmuls at the H100's measured
#   burst share of its peak (794.5 / 989) times HOPPER_GEMM_EFFICIENCY, flash attention at the
#   H100's (335 / 989) times HOPPER_ATTENTION_EFFICIENCY, memory-bound work at HBM_EFFICIENCY;
#   NCCL's channels, busbw fractions and kernel launch cost the H100's; PCIe 5 host copies at
#   the H100's 21 GB/s; C2C copies at their nominal 450 GB/s each way.
_B200_PEAK_FLOPS = 2.25e15
_GB200_PEAK_FLOPS = 2.5e15
_BLACKWELL_HBM_BYTES_PER_S = 8 * _TB
_GEMM_SHARE = HOPPER_GEMM_EFFICIENCY * H100_GEMM_BURST_FLOPS / _H100_PEAK_FLOPS
_ATTENTION_SHARE = HOPPER_ATTENTION_EFFICIENCY * H100_FLASH_ATTENTION_FLOPS / _H100_PEAK_FLOPS
_PRESETS["b200"] = dataclasses.replace(
    _PRESETS["h100-80gb"], name="b200", sm_count=148,
    bf16_flops_per_s=_GEMM_SHARE * _B200_PEAK_FLOPS, peak_flops_per_s=_B200_PEAK_FLOPS,
    attention_flops_per_s=_ATTENTION_SHARE * _B200_PEAK_FLOPS, hbm_bytes=180e9,
    hbm_bytes_per_s=HBM_EFFICIENCY * _BLACKWELL_HBM_BYTES_PER_S, intra_node_bytes_per_s=900e9,
    gemm_ridge_flops_per_byte=_B200_PEAK_FLOPS / _BLACKWELL_HBM_BYTES_PER_S)
_PRESETS["gb200"] = dataclasses.replace(
    _PRESETS["b200"], name="gb200",
    bf16_flops_per_s=_GEMM_SHARE * _GB200_PEAK_FLOPS, peak_flops_per_s=_GB200_PEAK_FLOPS,
    attention_flops_per_s=_ATTENTION_SHARE * _GB200_PEAK_FLOPS, hbm_bytes=186e9,
    d2h_bytes_per_s=450e9, h2d_bytes_per_s=450e9, gpus_per_host_link=2, gpus_per_node=72,
    host_bytes_per_node=17 * _TB,
    gemm_ridge_flops_per_byte=_GB200_PEAK_FLOPS / _BLACKWELL_HBM_BYTES_PER_S)

_ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "h200-141gb": "h200", "b200-180gb": "b200",
            "gb200-nvl72": "gb200"}
#: The preset of each GPU model, by a marker in its device name (torch.cuda.get_device_name),
#: most specific first: an "H200" name must not be taken for an H100, a "GB200" for a B200.
_DEVICE_MARKERS = (("GB200", "gb200"), ("B200", "b200"), ("H200", "h200"), ("H100", "h100-80gb"),
                   ("A100", "a100-80gb"))


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def hardware_names() -> tuple[str, ...]:
    """Names ``hardware_preset`` accepts (aliases not included)."""
    return tuple(_PRESETS)


def hardware_preset(name: str) -> Hardware:
    """The preset called ``name`` (case-insensitive; "a100", "h100" are aliases)."""
    key = _key(name)
    key = _ALIASES.get(key, key)
    if key not in _PRESETS:
        raise ConfigError(
            f"unknown hardware {name!r}; known presets: {', '.join(_PRESETS)} "
            f"(or a JSON file written by `pipeoffload probe`)"
        )
    return _PRESETS[key]


def device_preset(device_name: str) -> Hardware | None:
    """The preset of the GPU model ``device_name`` names (as torch.cuda.get_device_name gives
    it: "NVIDIA H100 80GB HBM3"), or None for a model without one."""
    name = device_name.upper()
    return next((_PRESETS[key] for marker, key in _DEVICE_MARKERS if marker in name), None)


def load_hardware(name_or_path: str) -> Hardware:
    """A preset by name, or one saved as JSON (a path ending in .json, or any existing file)."""
    path = Path(name_or_path)
    if name_or_path.lower().endswith(".json") or path.is_file():
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read hardware file {name_or_path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"hardware file {name_or_path} is not UTF-8 text (byte "
                              f"{exc.start}: {exc.reason}); pass a probe JSON or a preset "
                              "name") from None
        return Hardware.from_json(text, source=name_or_path)
    return hardware_preset(name_or_path)
