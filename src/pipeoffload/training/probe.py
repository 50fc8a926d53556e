"""Measure the local GPU and turn the numbers into a hardware preset (`pipeoffload probe`).

What is measured: the bf16 matmul rate of large square products and of narrower ones (the
GEMM efficiency curve of planner/gemm.py), and pinned-memory copy
bandwidth device-to-host and host-to-device, each alone and both at once (which tells a full
duplex link from a half duplex one). What is not: NVLink / network bandwidth and how many GPUs
share a host link; those come from the preset of the same GPU model (``base``).
torch is imported only inside the functions, so the CLI can say "nothing to probe" without it.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeoffload.errors import READER_WAIT_S, writing_output
from pipeoffload.planner.gemm import Gemm
from pipeoffload.planner.hardware import Hardware, device_preset, hardware_preset

NO_DEVICE_MESSAGE = "no CUDA device; nothing to probe"


@dataclass(frozen=True)
class ProbeConfig:
    """Sizes and the constants that turn measurements into a preset.

    ``layer_efficiency``: scales the measured large-GEMM rate into the preset's
    ``bf16_flops_per_s``; 1.0, since the planner times a layer's memory-bound work, attention
    and communication separately (docs/planner-model.md) and only the matmuls run at this rate.
    ``duplex_threshold``: a link is full duplex when each direction keeps at least
    this fraction of its solo bandwidth while the other runs. ``gemm_widths``: n of the
    (matmul_size x matmul_size) @ (matmul_size x n) products whose rates, over the square's,
    become the preset's GEMM efficiency curve (the intensities a TP shard's matmuls span).
    """

    matmul_size: int = 8192
    matmul_iters: int = 10
    gemm_widths: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096)
    copy_bytes: int = 512 * 2**20
    copy_iters: int = 5
    warmup_iters: int = 2
    layer_efficiency: float = 1.0
    duplex_threshold: float = 0.75


@dataclass(frozen=True)
class ProbeResult:
    """Raw measurements of one GPU (rates per second, bytes in decimal units when printed)."""

    device_name: str
    hbm_bytes: int
    gpu_count: int
    matmul_flops_per_s: float
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    d2h_both_bytes_per_s: float
    h2d_both_bytes_per_s: float
    gemm_rates: tuple[tuple[int, int, int, float], ...] = ()
    """(m, n, k, FLOP/s) of the narrower products."""

    def gemm_points(self) -> tuple[tuple[float, float], ...]:
        """(intensity, rate over the square product's rate, at most 1) by increasing
        intensity: the curve of planner/gemm.py, Note [GEMM efficiency curve]."""
        points = {
            Gemm(m, n, k).intensity: min(1.0, rate / self.matmul_flops_per_s)
            for m, n, k, rate in self.gemm_rates
        }
        return tuple(sorted(points.items()))

    def full_duplex(self, threshold: float) -> bool:
        return (
            self.d2h_both_bytes_per_s >= threshold * self.d2h_bytes_per_s
            and self.h2d_both_bytes_per_s >= threshold * self.h2d_bytes_per_s
        )

    def __str__(self) -> str:
        return "\n".join([
            f"device            {self.device_name} ({self.gpu_count} visible, "
            f"{self.hbm_bytes / 2**30:.1f} GiB)",
            f"bf16 matmul       {self.matmul_flops_per_s / 1e12:.1f} TFLOP/s",
            *(f"  {m} x {k} @ {k} x {n}: {rate / 1e12:.1f} TFLOP/s"
              for m, n, k, rate in self.gemm_rates),
            f"D2H pinned        {self.d2h_bytes_per_s / 1e9:.2f} GB/s alone, "
            f"{self.d2h_both_bytes_per_s / 1e9:.2f} GB/s with H2D running",
            f"H2D pinned        {self.h2d_bytes_per_s / 1e9:.2f} GB/s alone, "
            f"{self.h2d_both_bytes_per_s / 1e9:.2f} GB/s with D2H running",
        ])


def base_preset(device_name: str) -> Hardware:
    """The preset whose link figures a probe of ``device_name`` keeps (H100's if unknown)."""
    return device_preset(device_name) or hardware_preset("h100-80gb")


def to_hardware(
    result: ProbeResult, config: ProbeConfig = ProbeConfig(), base: Hardware | None = None
) -> Hardware:
    """A preset from measurements: compute, memory and host-link figures measured; NVLink,
    network, GPUs per node and per host link from ``base`` (by default the preset of the same
    GPU model), since one process cannot see the cluster it will be part of."""
    base = base if base is not None else base_preset(result.device_name)
    return dataclasses.replace(
        base,
        name="probed-" + "-".join(result.device_name.lower().split()),
        bf16_flops_per_s=result.matmul_flops_per_s * config.layer_efficiency,
        gemm_points=result.gemm_points(),
        hbm_bytes=result.hbm_bytes,
        d2h_bytes_per_s=result.d2h_bytes_per_s,
        h2d_bytes_per_s=result.h2d_bytes_per_s,
        full_duplex=result.full_duplex(config.duplex_threshold),
    )


def _torch() -> Any | None:
    """The torch module, or None when it is not installed."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def cuda_available() -> bool:
    """Whether torch is installed and sees a CUDA device."""
    torch = _torch()
    return torch is not None and torch.cuda.is_available()


def measure_gemm(
    m: int, n: int, k: int, iters: int, *, warmup: int = 2, device: int = 0
) -> float:
    """FLOP/s of (m x k) @ (k x n) bf16 products (2 m n k FLOPs each), timed with CUDA events."""
    import torch

    dev = torch.device("cuda", device)
    a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    for _ in range(warmup):
        torch.matmul(a, b, out=out)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        torch.matmul(a, b, out=out)
    end.record()
    end.synchronize()
    return 2 * m * n * k * iters / (start.elapsed_time(end) / 1e3)


def measure_matmul(
    size: int, iters: int, *, warmup: int = 2, device: int = 0
) -> float:
    """FLOP/s of ``size`` x ``size`` bf16 products (2 size^3 FLOPs each)."""
    return measure_gemm(size, size, size, iters, warmup=warmup, device=device)


def _copy_buffers(torch: Any, nbytes: int, dev: Any) -> tuple[Any, Any]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device_buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    return host, device_buf


def measure_copies(
    nbytes: int, iters: int, *, warmup: int = 2, device: int = 0
) -> tuple[float, float, float, float]:
    """Pinned copy bandwidth in bytes/s: (D2H alone, H2D alone, D2H and H2D while both run),
    each copy on its own side stream as the offloader issues them."""
    import torch

    dev = torch.device("cuda", device)
    d2h_host, d2h_dev = _copy_buffers(torch, nbytes, dev)
    h2d_host, h2d_dev = _copy_buffers(torch, nbytes, dev)
    d2h_stream, h2d_stream = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def d2h() -> None:
        d2h_host.copy_(d2h_dev, non_blocking=True)

    def h2d() -> None:
        h2d_dev.copy_(h2d_host, non_blocking=True)

    def timed(jobs: list[tuple[Any, Any]]) -> list[float]:
        """Run each (stream, copy) ``iters`` times, all streams from one common start."""
        for stream, copy in jobs:
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    copy()
        torch.cuda.synchronize(dev)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        ends = []
        for stream, copy in jobs:
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                for _ in range(iters):
                    copy()
                end = torch.cuda.Event(enable_timing=True)
                end.record(stream)
            ends.append(end)
        torch.cuda.synchronize(dev)
        return [nbytes * iters / (start.elapsed_time(end) / 1e3) for end in ends]

    (d2h_alone,) = timed([(d2h_stream, d2h)])
    (h2d_alone,) = timed([(h2d_stream, h2d)])
    d2h_both, h2d_both = timed([(d2h_stream, d2h), (h2d_stream, h2d)])
    return d2h_alone, h2d_alone, d2h_both, h2d_both


def measure(config: ProbeConfig = ProbeConfig(), *, device: int = 0) -> ProbeResult:
    """Run every measurement on CUDA device ``device`` (raises RuntimeError without one)."""
    torch = _torch()
    if torch is None or not torch.cuda.is_available():
        raise RuntimeError(NO_DEVICE_MESSAGE)
    props = torch.cuda.get_device_properties(device)
    flops = measure_matmul(
        config.matmul_size, config.matmul_iters, warmup=config.warmup_iters, device=device
    )
    size = config.matmul_size
    gemm_rates = tuple(
        (size, n, size, measure_gemm(size, n, size, config.matmul_iters,
                                     warmup=config.warmup_iters, device=device))
        for n in config.gemm_widths
    )
    d2h, h2d, d2h_both, h2d_both = measure_copies(
        config.copy_bytes, config.copy_iters, warmup=config.warmup_iters, device=device
    )
    return ProbeResult(
        device_name=props.name,
        hbm_bytes=int(props.total_memory),
        gpu_count=torch.cuda.device_count(),
        matmul_flops_per_s=flops,
        d2h_bytes_per_s=d2h,
        h2d_bytes_per_s=h2d,
        d2h_both_bytes_per_s=d2h_both,
        h2d_both_bytes_per_s=h2d_both,
        gemm_rates=gemm_rates,
    )


def probe(
    config: ProbeConfig = ProbeConfig(), *, device: int = 0, base: Hardware | None = None
) -> Hardware:
    """Measure CUDA device ``device`` and return it as a preset (see ``to_hardware``)."""
    return to_hardware(measure(config, device=device), config, base)


def run_probe_cli(output_path: str | None, fifo_wait_s: float = READER_WAIT_S) -> int:
    """`pipeoffload probe [--output FILE]`: print the measurements and the preset, save it as
    JSON when asked (an --output FIFO waits ``fifo_wait_s`` for its reader). Without a CUDA
    device there is nothing to measure: an error line on stderr and exit status 1 (a script
    must not take the missing preset for a result)."""
    if not cuda_available():
        print(f"pipeoffload probe: error: {NO_DEVICE_MESSAGE} (run it on the GPU machine; "
              "`pipeoffload plan --hardware` takes the presets a100-80gb, h100-80gb, h200)",
              file=sys.stderr)
        return 1
    config = ProbeConfig()
    try:
        result = measure(config)
    except RuntimeError as exc:
        print(f"pipeoffload probe: error: the measurement failed on the GPU: {exc}",
              file=sys.stderr)
        return 1
    hardware = to_hardware(result, config)
    print(result)
    print(
        f"preset (compute x {config.layer_efficiency} layer efficiency; NVLink, network, GPUs "
        f"per node and per host link from {base_preset(result.device_name).name}):"
    )
    print(hardware.to_json())
    if output_path is not None:
        try:
            with writing_output(output_path, "--output", fifo_wait_s, _note):
                Path(output_path).write_text(hardware.to_json() + "\n")
        except OSError as exc:
            print(f"pipeoffload probe: error: --output {output_path}: cannot write it "
                  f"({exc.strerror})", file=sys.stderr)
            return 1
        print(f"saved to {output_path} (use it wherever a hardware name is accepted)")
    return 0


def _note(text: str) -> None:
    print(f"pipeoffload probe: note: {text}", file=sys.stderr, flush=True)
