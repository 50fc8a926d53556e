"""The step-time terms issue 21 added, each checked against an independent count: memory-bound
bytes listed kernel by kernel, activation bytes against Korthikanti et al. 2022's closed forms,
the optimizer step's bytes, the DP exchange's bandwidth and overlap, blocking pipeline
transfers, and the pinned host memory offload needs."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pipeoffload.errors import ConfigError
from pipeoffload.planner.costing import (
    Framework,
    Layout,
    MemoryConfig,
    cost_model,
    dp_seconds,
    stage_costs,
)
from pipeoffload.planner.evaluate import Candidate, Evaluator, plan_memory
from pipeoffload.planner.hardware import hardware_preset
from pipeoffload.planner.host_memory import host_peak_bytes, node_host_bytes
from pipeoffload.planner.layer_time import RunConfig, collective_s
from pipeoffload.planner.layer_work import layer_memory_work
from pipeoffload.planner.optimizer import (
    DP_COPY_BYTES,
    OptimizerSpec,
    dp_bytes_per_s,
    dp_traffic,
    optimizer_step_bytes,
    state_bytes,
)
from pipeoffload.planner.ratio import p2p_s
from pipeoffload.planner.search import SearchConfig, SearchSpace, configurations
from pipeoffload.planner.transformer import (
    MlpKind,
    Recompute,
    TransformerSpec,
    layer_activation_bytes,
    recompute_flops,
)

A100 = hardware_preset("a100-80gb")
B, S, H, A, F = 2, 16, 32, 4, 128
GPT = TransformerSpec(num_layers=4, hidden=H, heads=A, kv_heads=A, ffn_hidden=F, vocab=64,
                      seq_len=S, mlp=MlpKind.GELU, flash_attention=False, dropout=True,
                      bias=True, name="gpt")


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_memory_bound_bytes_list_megatrons_kernels(tp: int, sequence_parallel: bool) -> None:
    """The unfused GPT layer, kernel by kernel (layer_work.py's table), e = 2 bytes, masks 1."""
    e = 2
    rows = B * S * H / (tp if sequence_parallel else 1)  # residual stream on one GPU
    qkv, ctx, mlp, scores = B * S * 3 * H / tp, B * S * H / tp, B * S * F / tp, B * A / tp * S * S
    forward = [2 * e * rows, 2 * e * rows,  # two norms
               (3 * e + 1) * rows, (3 * e + 1) * rows,  # two bias-dropout-adds
               2 * e * qkv,  # QKV bias add
               2 * e * scores, (2 * e + 1) * scores,  # softmax, attention dropout
               2 * e * ctx,  # context permute
               2 * e * mlp]  # bias-GeLU
    backward = [3 * e * rows, 3 * e * rows, (2 * e + 1) * rows, (2 * e + 1) * rows,
                3 * e * rows, 3 * e * rows,  # residual joins
                3 * e * scores, (2 * e + 1) * scores, 2 * e * ctx, 3 * e * mlp]
    weight = [e * qkv, e * mlp, e * rows, e * rows]  # bias gradients
    work = layer_memory_work(GPT, B, tp, sequence_parallel=sequence_parallel)
    assert work.f.nbytes == pytest.approx(sum(forward))
    assert work.i.nbytes == pytest.approx(sum(backward))
    assert work.w.nbytes == pytest.approx(sum(weight))
    assert (work.f.kernels, work.i.kernels, work.w.kernels) == (
        len(forward), len(backward) + 2, len(weight))  # each norm backward is 2 kernels
    # Megatron 2021's FusedLayerNorm: the persistent kernel's bytes at apex PR #1037's measured
    # time ratios (forward 0.0751 / 0.0535 ms, backward 0.1762 / 0.0866 ms), 3 backward kernels
    old = layer_memory_work(GPT, B, tp, sequence_parallel=sequence_parallel, norm_kernel="apex")
    assert old.f.nbytes - work.f.nbytes == pytest.approx(2 * 2 * e * rows * (0.0751 / 0.0535 - 1))
    assert old.i.nbytes - work.i.nbytes == pytest.approx(2 * 3 * e * rows * (0.1762 / 0.0866 - 1))
    assert (old.f.kernels, old.i.kernels) == (work.f.kernels, work.i.kernels + 2)
    full = layer_memory_work(GPT, B, tp, sequence_parallel=sequence_parallel,
                             recompute=Recompute.FULL)
    assert full.i.nbytes == pytest.approx(sum(backward) + sum(forward))
    selective = layer_memory_work(GPT, B, tp, sequence_parallel=sequence_parallel,
                                  recompute=Recompute.SELECTIVE)
    assert selective.i.nbytes == pytest.approx(sum(backward) + (4 * e + 1) * scores)


def test_flash_swiglu_layer_has_no_score_traffic() -> None:
    llama = dataclasses.replace(GPT, mlp=MlpKind.SWIGLU, flash_attention=True, dropout=False,
                                bias=False, kv_heads=2)
    work = layer_memory_work(llama, B, 2)
    rows, mlp = B * S * H / 2, B * S * F / 2
    assert work.f.nbytes == pytest.approx(2 * 4 * rows + 2 * 6 * rows + 6 * mlp)
    assert work.i.nbytes == pytest.approx(2 * 6 * rows + 2 * 6 * rows + 10 * mlp)
    assert work.w.nbytes == 0
    assert layer_memory_work(llama, B, 2, recompute=Recompute.SELECTIVE) == work


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_activation_bytes_follow_korthikanti_closed_forms(tp: int) -> None:
    """Section 4.2: s b h (10 + 24 / t) + 5 a s^2 b / t without sequence parallelism, 34 s b h / t
    with it and selective recompute, 2 s b h (/ t with SP) under full recompute."""
    sbh, as2b = S * B * H, A * S * S * B
    assert layer_activation_bytes(GPT, B, "none", tp=tp, sequence_parallel=False) == \
        pytest.approx(sbh * (10 + 24 / tp) + 5 * as2b / tp)
    assert layer_activation_bytes(GPT, B, "selective", tp=tp) == pytest.approx(34 * sbh / tp)
    assert layer_activation_bytes(GPT, B, "selective", tp=tp, sequence_parallel=False) == \
        pytest.approx(sbh * (10 + 24 / tp))
    assert layer_activation_bytes(GPT, B, "full", tp=tp, sequence_parallel=False) == 2 * sbh
    assert layer_activation_bytes(GPT, B, "full", tp=tp) == pytest.approx(2 * sbh / tp)


def test_selective_recompute_reruns_the_attention_core_only_without_flash() -> None:
    core = 4 * B * S * S * H
    assert recompute_flops(GPT, B, "selective", tp=2) == pytest.approx(core / 2)
    assert recompute_flops(dataclasses.replace(GPT, flash_attention=True), B, "selective") == 0
    assert recompute_flops(GPT, B, "selective", count="model") == 0


@pytest.mark.parametrize(("grad_bytes", "sharded", "dp", "per_param"), [
    (4, False, 1, 8 + 4 + 28 + 6 + 4),  # unscale, norm, Adam, copy back, zero the fp32 grads
    (2, False, 4, 6 + 8 + 4 + 28 + 6 + 2),  # 16-bit gradients copied to fp32 first
    (4, True, 4, (8 + 4 + 28 + 6) / 4 + 4),  # a sharded optimizer updates 1 / dp
])
def test_optimizer_step_bytes(grad_bytes: int, sharded: bool, dp: int, per_param: float) -> None:
    spec = OptimizerSpec(grad_bytes=grad_bytes, sharded=sharded)
    assert optimizer_step_bytes(1e6, spec, dp=dp) == pytest.approx(1e6 * per_param)
    # the DP implementation's copies (DP_COPY_BYTES) run on every parameter the rank holds
    for name, copies in DP_COPY_BYTES.items():
        with_copies = dataclasses.replace(spec, dp_copy_bytes=copies)
        assert optimizer_step_bytes(1e6, with_copies, dp=dp) - \
            optimizer_step_bytes(1e6, spec, dp=dp) == pytest.approx(1e6 * copies), name


def test_dp_copy_bytes_follow_each_implementations_copies() -> None:
    """PyTorch DDP copies 16-bit gradients into buckets and back (2 x 4 bytes); Megatron 2021's
    local DDP flattens, divides and copies back (3 x 4); Megatron 2022 divides its fp32 buffer in
    place (4 + 4)."""
    assert DP_COPY_BYTES == {"torch-ddp-fp16": 2 * (2 + 2), "megatron-local-2021": 3 * (2 + 2),
                             "megatron-local-2022": 4 + 4}
    with pytest.raises(ConfigError, match="dp_copy_bytes"):
        OptimizerSpec(dp_copy_bytes=-1)


def test_dp_exchange_runs_at_the_nics_of_its_nodes_and_overlaps_when_asked() -> None:
    nic = A100.achieved_bytes_per_s(cross_node=True)
    alone = A100.achieved_bytes_per_s(cross_node=True, one_gpu_per_node=True)
    assert alone < nic  # NCCL drives one GPU's NIC less well than a full node's
    assert dp_bytes_per_s(A100, cross_node=True, gpus_per_node=1) == pytest.approx(alone)
    assert dp_bytes_per_s(A100, cross_node=True, gpus_per_node=4) == pytest.approx(4 * nic)
    nvlink = A100.achieved_bytes_per_s(cross_node=False)
    assert dp_bytes_per_s(A100, cross_node=False) == nvlink
    fast_nics = dataclasses.replace(A100, inter_node_bytes_per_s=100e9)
    assert dp_bytes_per_s(fast_nics, cross_node=True, gpus_per_node=8) == nvlink  # capped
    layout = Layout(dp=4, tp=2, pp=2, run=RunConfig(tp=2))  # 4 GPUs per replica: 2 per node
    pieces = stage_costs(GPT, A100, layout)
    placement = (0, 1)
    after = dp_seconds(GPT, A100, pieces, placement, layout, MemoryConfig())
    params = [sum(p.params.total for s, p in enumerate(pieces) if placement[s] == r)
              for r in (0, 1)]
    expected = [dp_traffic(GPT, n, OptimizerSpec(), dp=4).total / (2 * nic) for n in params]
    assert after == pytest.approx(max(expected))
    overlapped = dp_seconds(GPT, A100, pieces, placement, layout,
                            MemoryConfig(optimizer=OptimizerSpec(overlap_grad_reduce=True)))
    backward = [sum(p.i_s + p.w_s for s, p in enumerate(pieces) if placement[s] == r)
                for r in (0, 1)]
    assert overlapped == pytest.approx(max(max(0.0, t - b) for t, b in zip(expected, backward)))


def test_blocking_pipeline_transfers_wait_after_each_pass() -> None:
    """Megatron's pre-2023 schedules wait for each send / receive: F and the backward of every
    stage grow by one transfer (and, without sequence parallelism, the TP all-gather of the
    scattered activation); the simulator then adds no latency of its own."""
    run = RunConfig(tp=2, sequence_parallel=False)
    plain = stage_costs(GPT, A100, Layout(1, 2, 2, 1, run))
    blocking = stage_costs(GPT, A100, Layout(1, 2, 2, 1, dataclasses.replace(
        run, p2p_blocking=True)))
    exchange = p2p_s(GPT, A100, run, cross_node=False) + collective_s(GPT, A100, 1, 2)
    for a, b in zip(plain, blocking):
        assert (b.f_s - a.f_s, b.i_s - a.i_s, b.w_s - a.w_s) == pytest.approx(
            (exchange, exchange, 0.0))
    assert Framework(p2p_blocking=True).run(1, 2, Recompute.LGD).p2p_blocking


def test_host_memory_is_the_peak_of_offloaded_activations() -> None:
    """What the pinned pool holds: each offloaded activation from its copy out's start to its
    copy back's end, in the same bytes as device memory; a node sums its GPUs."""
    hw = dataclasses.replace(A100, name="test", gpus_per_host_link=1)
    evaluator = Evaluator(GPT, hw, MemoryConfig(), math.inf)
    candidate = Candidate("1f1b", 1, 1, 4, 1, 1, 8, offload="all")
    plan = evaluator.evaluate(candidate)
    costs = cost_model(evaluator.pieces(candidate), GPT, hw, evaluator.layout(candidate))
    result = plan_memory(evaluator.schedule(candidate, 8), costs, "all").result
    timeline = result.timeline[0]
    sizes = result.costs.stage_activation_bytes
    spans = {}
    for timed in timeline:
        stage, kind, mb = timed.action
        if kind.value == "OFFLOAD":
            spans[(stage, mb)] = [timed.start, None]
        elif kind.value == "RELOAD":
            spans[(stage, mb)][1] = timed.end
    level = [sum(sizes[s] for (s, _), (a, b) in spans.items() if a <= t < b)
             for t in sorted(a for a, _ in spans.values())]
    assert host_peak_bytes(result)[0] == pytest.approx(max(level))
    assert plan.host_bytes == pytest.approx(max(host_peak_bytes(result)))
    assert plan.host_bytes > 0
    assert node_host_bytes([4.0, 3.0, 2.0, 1.0], tp=1, pp=4, gpus_per_node=2) == 7.0
    assert node_host_bytes([4.0, 3.0], tp=2, pp=2, gpus_per_node=8) == 2 * (2 * 4.0 + 2 * 3.0)


def test_tp_groups_divide_a_node() -> None:
    """TP6 on 8-GPU nodes would straddle two nodes at NVLink prices: not searched."""
    spec = dataclasses.replace(GPT, heads=12, kv_heads=12, hidden=96, num_layers=12)
    tps = {group[0].tp for group in configurations(
        spec, A100, SearchConfig(gpus=24, global_batch=24), SearchSpace())}
    assert tps == {1, 2, 4}


def test_zero3_is_priced_as_zero1_term_by_term() -> None:
    """``fsdp`` (plan --zero 3, optimizer.py Note [zero 3 terms]) implies the sharded state and
    gives ZeRO-1's memory, DP bytes and optimizer-step bytes; without ``sharded`` it is a
    ConfigError."""
    from pipeoffload.planner.frameworks import framework_preset

    spec = GPT
    zero1 = framework_preset("current").with_sharding(True)
    zero3 = framework_preset("current").with_sharding(False, fsdp=True)
    assert zero3.sharded and zero3.fsdp and not zero1.fsdp
    params, dp = 1.3e9, 8
    assert state_bytes(spec, params, zero3, dp=dp) == state_bytes(spec, params, zero1, dp=dp)
    assert state_bytes(spec, params, zero3, dp=dp).optimizer == params * 12 / dp
    assert dp_traffic(spec, params, zero3, dp=dp) == dp_traffic(spec, params, zero1, dp=dp)
    assert optimizer_step_bytes(params, zero3, dp=dp) == optimizer_step_bytes(params, zero1,
                                                                              dp=dp)
    with pytest.raises(ConfigError, match="fsdp"):
        OptimizerSpec(fsdp=True)
