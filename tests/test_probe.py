"""`pipeoffload probe`: a clear no-op without CUDA; measurements on tiny sizes where CUDA exists."""

from __future__ import annotations

import json
import sys

import pytest

from pipeoffload.planner.hardware import Hardware, hardware_preset
from pipeoffload.training import probe as probe_module
from pipeoffload.training.probe import (
    NO_DEVICE_MESSAGE,
    ProbeConfig,
    ProbeResult,
    base_preset,
    cuda_available,
    measure_copies,
    measure_matmul,
    probe,
    run_probe_cli,
    to_hardware,
)

needs_cuda = pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")


def test_cli_without_cuda_says_so_and_fails(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setattr(probe_module, "cuda_available", lambda: False)
    out = tmp_path / "hw.json"
    assert run_probe_cli(str(out)) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"pipeoffload probe: error: {NO_DEVICE_MESSAGE}")
    assert not out.exists()


def test_without_torch_there_is_nothing_to_probe(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    assert cuda_available() is False
    assert run_probe_cli(None) == 1
    assert NO_DEVICE_MESSAGE in capsys.readouterr().err


@pytest.mark.skipif(cuda_available(), reason="checks the real CPU-only path")
def test_cpu_only_machine(capsys) -> None:
    assert run_probe_cli(None) == 1
    assert NO_DEVICE_MESSAGE in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="no CUDA device"):
        probe()


def fake_result(**changes: float) -> ProbeResult:
    values = dict(
        device_name="NVIDIA A100-SXM4-80GB", hbm_bytes=85_000_000_000, gpu_count=2,
        matmul_flops_per_s=280e12, d2h_bytes_per_s=20e9, h2d_bytes_per_s=24e9,
        d2h_both_bytes_per_s=19e9, h2d_both_bytes_per_s=23e9,
    )
    values.update(changes)
    return ProbeResult(**values)  # type: ignore[arg-type]


def test_measurements_become_a_preset() -> None:
    config = ProbeConfig(layer_efficiency=0.5, duplex_threshold=0.75)
    hw = to_hardware(fake_result(), config)
    a100 = hardware_preset("a100-80gb")
    assert hw.name == "probed-nvidia-a100-sxm4-80gb"
    assert hw.bf16_flops_per_s == pytest.approx(140e12)
    assert (hw.d2h_bytes_per_s, hw.h2d_bytes_per_s, hw.hbm_bytes) == (20e9, 24e9, 85e9)
    assert hw.full_duplex is True
    assert (hw.gpus_per_host_link, hw.intra_node_bytes_per_s, hw.gpus_per_node) == (
        a100.gpus_per_host_link, a100.intra_node_bytes_per_s, a100.gpus_per_node
    )
    # each direction dropping to ~half while the other runs: one shared (half duplex) link
    half = to_hardware(fake_result(d2h_both_bytes_per_s=10e9, h2d_both_bytes_per_s=12e9), config)
    assert half.full_duplex is False
    assert Hardware.from_json(hw.to_json()) == hw


def test_base_preset_by_device_name() -> None:
    assert base_preset("NVIDIA H200").name == "h200"
    assert base_preset("NVIDIA H100 80GB HBM3").name == "h100-80gb"
    assert base_preset("Tesla V100-SXM2-16GB").name == "h100-80gb"


@pytest.mark.gpu
@needs_cuda
def test_measure_tiny_sizes_on_cuda() -> None:
    assert measure_matmul(256, 3, warmup=1) > 0
    assert probe_module.measure_gemm(256, 64, 256, 3, warmup=1) > 0
    rates = measure_copies(1 << 20, 2, warmup=1)
    assert len(rates) == 4 and all(r > 0 for r in rates)


@pytest.mark.gpu
@needs_cuda
def test_cli_on_cuda_writes_a_loadable_preset(monkeypatch, tmp_path, capsys) -> None:
    tiny = ProbeConfig(matmul_size=512, matmul_iters=2, copy_bytes=1 << 20, copy_iters=2)
    monkeypatch.setattr(probe_module, "ProbeConfig", lambda: tiny)
    out = tmp_path / "hw.json"
    assert run_probe_cli(str(out)) == 0
    saved = Hardware.from_json(out.read_text())
    assert saved.name.startswith("probed-")
    assert len(saved.gemm_points) == len(tiny.gemm_widths)  # one point per measured width
    assert json.loads(out.read_text())["d2h_bytes_per_s"] > 0
    assert "bf16 matmul" in capsys.readouterr().out
