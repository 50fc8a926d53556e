"""TP priced honestly: matmul efficiency by GEMM shape (roofline and wave quantization), NCCL's
achieved bus bandwidth, and the exposed part of Megatron's tensor-parallel collectives. The
checks against Megatron's measured runs are in tests/test_planner_published.py."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeoffload.errors import ConfigError
from pipeoffload.planner.gemm import (
    Gemm,
    curve_fraction,
    layer_gemms,
    reference_intensity,
    roofline_points,
    wave_efficiency,
)
from pipeoffload.planner.hardware import Hardware, hardware_preset
from pipeoffload.planner.layer_time import collective_s, layer_compute_s, layer_seconds
from pipeoffload.planner.optimizer import OptimizerSpec, dp_s, dp_traffic
from pipeoffload.planner.ratio import RunConfig, layer_cost, p2p_s
from pipeoffload.planner.transformer import (
    FlopCount,
    MlpKind,
    Recompute,
    TransformerSpec,
    layer_flops,
)
from pipeoffload.training.probe import ProbeConfig, ProbeResult, to_hardware

A100 = hardware_preset("a100-80gb")
#: The roofline alone (no wave quantization), for the curve's own checks.
ROOF = dataclasses.replace(A100, sm_count=0)
#: The model before issue 21: one matmul rate, nothing but matmuls and collectives timed.
FLAT = dataclasses.replace(A100, gemm_ridge_flops_per_byte=0.0, sm_count=0, hbm_bytes_per_s=0.0,
                           attention_flops_per_s=0.0, kernel_launch_s=0.0)
GPT_2K = TransformerSpec(num_layers=4, hidden=2048, heads=16, kv_heads=16, ffn_hidden=8192,
                         vocab=32000, seq_len=2048, mlp=MlpKind.GELU, name="gpt-2k")

dims = st.integers(min_value=1, max_value=1 << 16)


@given(dims, dims, dims)
def test_gemm_intensity_is_the_same_for_forward_and_both_gradients(m, n, k) -> None:
    """Y = X W (m, n, k), dX = dY W^T (m, k, n) and dW = X^T dY (k, n, m) share one intensity,
    so one efficiency prices a linear layer's F, I and W."""
    forward = Gemm(m, n, k).intensity
    assert Gemm(m, k, n).intensity == pytest.approx(forward)
    assert Gemm(k, n, m).intensity == pytest.approx(forward)


@settings(max_examples=50)
@given(st.floats(min_value=0.1, max_value=1e5), st.floats(min_value=1.0, max_value=4.0))
def test_default_curve_is_a_rounded_roofline(intensity: float, factor: float) -> None:
    points = roofline_points(A100.gemm_ridge_flops_per_byte)
    low, high = curve_fraction(points, intensity), curve_fraction(points, intensity * factor)
    assert 0 < low <= high <= 1  # never faster than a large GEMM, monotone in intensity
    if intensity * factor <= points[0][0]:  # memory-bound: rate proportional to intensity
        assert high == pytest.approx(low * factor)


def test_default_curve_values() -> None:
    points = roofline_points(A100.gemm_ridge_flops_per_byte)
    assert curve_fraction(points, reference_intensity()) == 1.0
    ridge = A100.gemm_ridge_flops_per_byte  # 153 FLOP/byte: half-way between the two roofs
    assert curve_fraction(points, ridge) == pytest.approx(2 ** -0.5, abs=0.02)  # sampled
    # TP8 shards of an h = 2048 layer are narrow enough to cost; unsharded ones are not.
    tp1 = [ROOF.gemm_fraction(g) for g in layer_gemms(GPT_2K, 1, 1).all()]
    tp8 = [ROOF.gemm_fraction(g) for g in layer_gemms(GPT_2K, 1, 8).all()]
    assert min(tp1) > 0.97 and max(tp8) < 0.97 and min(tp8) < 0.8
    assert all(FLAT.gemm_fraction(g) == 1.0 for g in layer_gemms(GPT_2K, 1, 8).all())


@pytest.mark.parametrize(("m", "n", "efficiency"), [
    (256 * 9, 128 * 12, 1.0),  # 108 tiles: one full wave of 108 SMs
    (256 * 10, 128 * 11, 110 / 216),  # 110 tiles: a second wave with 2 blocks in it
    (256, 128, 1 / 108),  # one tile on 108 SMs
])
def test_wave_quantization_follows_the_tile_count(m: int, n: int, efficiency: float) -> None:
    """NVIDIA's matrix multiplication guide, section 3: tiles run in waves of one per SM."""
    assert wave_efficiency(Gemm(m, n, 4096), 108) == pytest.approx(efficiency)
    assert wave_efficiency(Gemm(m, n, 4096), 0) == 1.0
    assert A100.gemm_fraction(Gemm(m, n, 4096)) == pytest.approx(
        ROOF.gemm_fraction(Gemm(m, n, 4096)) * efficiency)


def test_layer_gemms_cover_the_linear_flops() -> None:
    for mlp in MlpKind:
        spec = dataclasses.replace(GPT_2K, mlp=mlp, kv_heads=4)
        flat = FLAT
        compute = layer_compute_s(spec, flat, 2, 4, FlopCount.HARDWARE)
        flops = layer_flops(spec, 2, tp=4)
        assert compute.f_s == pytest.approx(flops.f / flat.bf16_flops_per_s)
        assert compute.i_s == pytest.approx(flops.i / flat.bf16_flops_per_s)
        assert compute.w_s == pytest.approx(flops.w / flat.bf16_flops_per_s)


def fake_probe(**changes: object) -> ProbeResult:
    values = dict(
        device_name="NVIDIA A100-SXM4-80GB", hbm_bytes=85_000_000_000, gpu_count=1,
        matmul_flops_per_s=280e12, d2h_bytes_per_s=20e9, h2d_bytes_per_s=24e9,
        d2h_both_bytes_per_s=19e9, h2d_both_bytes_per_s=23e9,
        gemm_rates=((8192, 256, 8192, 70e12), (8192, 1024, 8192, 140e12),
                    (8192, 4096, 8192, 290e12)),
    )
    values.update(changes)
    return ProbeResult(**values)  # type: ignore[arg-type]


def test_probed_gemm_rates_replace_the_default_curve() -> None:
    hw = to_hardware(fake_probe(), ProbeConfig())
    assert [round(f, 3) for _, f in hw.gemm_points] == [0.25, 0.5, 1.0]  # capped at 1
    assert hw.gemm_fraction(Gemm(8192, 1024, 8192)) == pytest.approx(0.5)
    assert hw.gemm_fraction(Gemm(4096, 4096, 4096)) != A100.gemm_fraction(Gemm(4096, 4096, 4096))
    assert Hardware.from_json(hw.to_json()) == hw
    assert "8192 x 8192 @ 8192 x 1024: 140.0 TFLOP/s" in str(fake_probe())


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"gemm_points": ((100.0, 0.5), (50.0, 0.9))}, "sorted by increasing intensity"),
        ({"gemm_points": ((100.0, 1.5),)}, r"fraction in \(0, 1\]"),
        ({"gemm_points": (3.0,)}, r"\[intensity, fraction\] pairs"),
        ({"gemm_points": 3.0}, r"\[intensity, fraction\] pairs"),
        ({"intra_node_busbw_fraction": 1.2}, r"must be in \(0, 1\]"),
        ({"gemm_ridge_flops_per_byte": -1.0}, "must be >= 0"),
    ],
)
def test_bad_hardware_fields_are_rejected(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(A100, **changes)


def test_links_run_at_the_achieved_bus_bandwidth() -> None:
    """NVLink at 0.78 of 300 GB/s; a group spanning nodes with every GPU of a node in it at 0.92
    of each NIC; one GPU per node (a pipeline hop, a DP group of TP8) at 0.746 of its NIC."""
    assert A100.link_bytes_per_s(8) == pytest.approx(0.78 * 300e9)
    assert A100.link_bytes_per_s(16) == pytest.approx(0.92 * 25e9)
    nominal = dataclasses.replace(A100, intra_node_busbw_fraction=1.0,
                                  inter_node_busbw_fraction=1.0,
                                  inter_node_one_gpu_busbw_fraction=1.0)
    run = RunConfig(tp=2)
    for cross_node, fraction in ((False, 0.78), (True, 0.746)):
        assert p2p_s(GPT_2K, A100, run, cross_node=cross_node) == pytest.approx(
            p2p_s(GPT_2K, nominal, run, cross_node=cross_node) / fraction)
    traffic = dp_traffic(GPT_2K, 1e9, OptimizerSpec(), dp=4)
    assert dp_s(traffic, A100, cross_node=True) == pytest.approx(
        dp_s(traffic, nominal, cross_node=True) / 0.746)
    assert dp_s(traffic, A100, cross_node=True, gpus_per_node=2) == pytest.approx(
        dp_s(traffic, nominal, cross_node=True, gpus_per_node=2) / 0.92)


@pytest.mark.parametrize("link_scale", [1e-3, 1e3])
def test_exposed_collectives_follow_megatrons_sequence_parallel_pattern(
    link_scale: float,
) -> None:
    """F: 4 collectives exposed; I: 2 exposed + the re-gathers' overhang beyond the QKV and
    MLP-in input-gradient matmuls; W: the reduce-scatters' overhang beyond their weight-gradient
    matmuls. Slow links (1e-3) stick out, fast ones (1e3) hide. Zero-bubble schedules defer W,
    so the reduce-scatters are exposed in I; blocking (2021) code exposes every collective."""
    hw = dataclasses.replace(FLAT, intra_node_bytes_per_s=300e9 * link_scale)
    b, tp = 1, 8
    compute = layer_compute_s(GPT_2K, hw, b, tp, FlopCount.HARDWARE)
    one = collective_s(GPT_2K, hw, b, tp)
    gemms = layer_gemms(GPT_2K, b, tp)
    column = (gemms.qkv, gemms.mlp_in)
    gathers = sum(max(0.0, one - hw.gemm_s(g.input_gradient())) for g in column)
    scatters = sum(max(0.0, one - hw.gemm_s(g.weight_gradient())) for g in column)
    run = RunConfig(b, tp, Recompute.LGD)
    seconds = layer_seconds(GPT_2K, hw, run)
    assert seconds.f_s == pytest.approx(compute.f_s + 4 * one)
    assert seconds.i_s == pytest.approx(compute.i_s + 2 * one + gathers)
    assert seconds.w_s == pytest.approx(compute.w_s + scatters)
    assert (gathers > 0) == (scatters > 0) == (link_scale < 1)
    full = layer_seconds(GPT_2K, hw, dataclasses.replace(run, recompute=Recompute.FULL))
    assert full.i_s == pytest.approx(seconds.i_s + seconds.f_s)  # the forward re-runs
    deferred = layer_seconds(GPT_2K, hw, dataclasses.replace(run, w_deferred=True))
    assert deferred.i_s == pytest.approx(compute.i_s + 4 * one + gathers)
    assert deferred.w_s == pytest.approx(compute.w_s)
    blocking = layer_seconds(GPT_2K, hw, dataclasses.replace(run, tp_overlap=False))
    assert blocking.i_s == pytest.approx(compute.i_s + 6 * one)
    no_sp = layer_seconds(GPT_2K, hw, dataclasses.replace(run, sequence_parallel=False))
    reduces = sum(max(0.0, 2 * one - hw.gemm_s(g.weight_gradient())) for g in column)
    assert (no_sp.f_s, no_sp.i_s, no_sp.w_s) == pytest.approx(
        (compute.f_s + 4 * one, compute.i_s, compute.w_s + reduces))
    assert collective_s(GPT_2K, hw, b, 1) == 0.0


def test_search_picks_a_larger_microbatch_only_when_its_wider_matmuls_pay() -> None:
    """Wider matmuls make b = 4 faster per sequence for a narrow TP8 layer; the search takes it
    with many microbatches (bubble negligible), not with few, and never at one matmul rate; in
    each case the same b as the exhaustive search (its time bound prices b, no rule of thumb)."""
    from pipeoffload.planner.reduced import Extrapolation
    from pipeoffload.planner.search import SearchConfig, SearchSpace, search

    per_sequence = [layer_cost(GPT_2K, A100, RunConfig(b, 8)).chunk_s / b for b in (1, 4)]
    assert per_sequence[1] < per_sequence[0]
    # 64 GPUs, 32 sequences: pp 4 leaves 16 per replica (with DP overlap and the optimizer
    # step timed, pp 1 with b = 4 wins that batch outright, so pp is fixed to ask about b).
    for hw, gpus, global_batch, pp, wanted in ((A100, 16, 512, None, 4),
                                               (A100, 64, 32, (4,), 1),
                                               (FLAT, 16, 512, None, 1)):
        space = SearchSpace(schedules=("1f1b",), tp=(8,), pp=pp, micro_batch_sizes=(1, 4),
                            recompute=("lgd",))
        config = SearchConfig(gpus=gpus, global_batch=global_batch)
        best = search(GPT_2K, hw, config, space).best
        exhaustive = search(GPT_2K, hw, dataclasses.replace(
            config, tolerance=0.0, extrapolation=Extrapolation(enabled=False)), space).best
        assert best is not None and exhaustive is not None
        assert best.candidate.micro_batch == exhaustive.candidate.micro_batch == wanted
        assert best.step_time == pytest.approx(exhaustive.step_time, rel=1e-12)
