"""The step-time terms of issue 21's second and third rounds, one test each, checked against an
independent count: collectives holding SMs while a matmul runs beside them, NCCL's share of a
NIC with one GPU per node, the all-reduce of tied embeddings between the two ends of a pipeline,
and the LayerNorm kernels of Megatron 2021 against 2022's (the DP implementations' copies are
in test_planner_step_model.py, beside the optimizer step's other bytes)."""

from __future__ import annotations

import dataclasses

import pytest

from pipeoffload.errors import ConfigError
from pipeoffload.planner.costing import (
    Framework,
    Layout,
    MemoryConfig,
    dp_seconds,
    embedding_sync_s,
    rank_params,
    stage_costs,
)
from pipeoffload.planner.gemm import layer_gemms
from pipeoffload.planner.hardware import Hardware, hardware_preset
from pipeoffload.planner.layer_time import RunConfig, collective_s, layer_seconds
from pipeoffload.planner.layer_work import NormKernel
from pipeoffload.planner.optimizer import OptimizerSpec, dp_bytes_per_s
from pipeoffload.planner.ratio import p2p_s
from pipeoffload.planner.transformer import MlpKind, Recompute, TransformerSpec, model_params

A100 = hardware_preset("a100-80gb")
NO_SM_SHARING = dataclasses.replace(A100, collective_sms=0)
#: Korthikanti et al. 2022's 22B layer: its collectives hide behind their matmuls at TP8, b 4.
GPT_22B = TransformerSpec(num_layers=48, hidden=6144, heads=64, kv_heads=64, ffn_hidden=24576,
                          vocab=51200, seq_len=2048, mlp=MlpKind.GELU, flash_attention=False,
                          dropout=True, bias=True, name="gpt-22B")


@pytest.mark.parametrize(("sequence_parallel", "tp_overlap", "hidden_in_i", "hidden_in_w"), [
    (True, True, 2, 2),  # the 2 re-gathers behind the input-gradient matmuls, 2 RS behind W
    (False, True, 0, 4),  # 2 all-reduces (an AG's and an RS's bytes each) behind W
    (True, False, 0, 0),  # blocking (Megatron 2021): nothing runs beside them
])
def test_overlapped_collectives_take_their_sms_from_the_matmul(
        sequence_parallel: bool, tp_overlap: bool, hidden_in_i: int, hidden_in_w: int) -> None:
    """Every collective hidden behind a matmul slows it by its duration x collective_sms / SMs
    (24 / 108 on A100: NCCL's channels, one block each); F has no overlapped collective."""
    run = RunConfig(micro_batch=4, tp=8, recompute=Recompute.NONE,
                    sequence_parallel=sequence_parallel, tp_overlap=tp_overlap)
    one = collective_s(GPT_22B, A100, 4, 8)
    gemms = layer_gemms(GPT_22B, 4, 8)
    for gemm in (gemms.qkv, gemms.mlp_in):  # each hides even a whole all-reduce
        assert 2 * one < A100.gemm_s(gemm.weight_gradient())
        assert one < A100.gemm_s(gemm.input_gradient())
    shared, alone = layer_seconds(GPT_22B, A100, run), layer_seconds(GPT_22B, NO_SM_SHARING, run)
    share = 24 / 108
    assert shared.f_s == pytest.approx(alone.f_s)
    assert shared.i_s - alone.i_s == pytest.approx(hidden_in_i * one * share)
    assert shared.w_s - alone.w_s == pytest.approx(hidden_in_w * one * share)


def test_a_collective_longer_than_its_matmul_costs_its_overhang_only() -> None:
    """On slow links the overhang (c - g) exceeds the slowdown (c k / S): nothing is added."""
    slow = dataclasses.replace(A100, intra_node_bytes_per_s=1e9)
    slow_alone = dataclasses.replace(slow, collective_sms=0)
    run = RunConfig(micro_batch=4, tp=8, recompute=Recompute.NONE)
    assert layer_seconds(GPT_22B, slow, run) == layer_seconds(GPT_22B, slow_alone, run)
    assert A100.collective_sm_share == pytest.approx(24 / 108)
    assert dataclasses.replace(A100, sm_count=0).collective_sm_share == 0.0


def test_nccl_reaches_less_of_a_nic_with_one_gpu_per_node() -> None:
    """0.746 of the NIC with one GPU per node (pipeline hops, DP groups of TP8), 0.92 with a
    full node; 0 means no separate figure; fractions above 1 are refused."""
    alone = A100.achieved_bytes_per_s(cross_node=True, one_gpu_per_node=True)
    full = A100.achieved_bytes_per_s(cross_node=True)
    assert (alone, full) == pytest.approx((0.746 * 25e9, 0.92 * 25e9))
    assert A100.achieved_bytes_per_s(cross_node=False, one_gpu_per_node=True) == \
        A100.achieved_bytes_per_s(cross_node=False)
    unset = dataclasses.replace(A100, inter_node_one_gpu_busbw_fraction=0.0)
    assert unset.achieved_bytes_per_s(cross_node=True, one_gpu_per_node=True) == full
    run = RunConfig(micro_batch=1, tp=8)
    assert p2p_s(GPT_22B, A100, run, cross_node=True) == pytest.approx(
        p2p_s(GPT_22B, unset, run, cross_node=True) * 0.92 / 0.746)
    assert dp_bytes_per_s(A100, cross_node=True, gpus_per_node=1) == pytest.approx(alone)
    assert dp_bytes_per_s(A100, cross_node=True, gpus_per_node=4) == pytest.approx(4 * full)
    with pytest.raises(ConfigError, match="inter_node_one_gpu_busbw_fraction"):
        dataclasses.replace(A100, inter_node_one_gpu_busbw_fraction=1.5)
    with pytest.raises(ConfigError, match="collective_sms"):
        dataclasses.replace(A100, collective_sms=2.5)
    assert Hardware.from_json(A100.to_json()) == A100


@pytest.mark.parametrize(("pp", "dp"), [(1, 1), (2, 1), (2, 4), (16, 1)])
def test_tied_embeddings_are_kept_once_per_rank_and_all_reduced_across_the_pipeline(
        pp: int, dp: int) -> None:
    """One rank: the head reuses the embedding (V h / t fewer parameters on it). Two ranks: the
    last keeps a copy and Megatron all-reduces the two gradients each step, V h / t x grad bytes
    each way, over NVLink inside a node (TP2 x PP2) or one NIC per GPU across nodes (TP2 x
    PP16), after the DP exchange."""
    tied = dataclasses.replace(GPT_22B, tied_embeddings=True)
    tp, optimizer = 2, OptimizerSpec(grad_bytes=4)
    layout = Layout(dp=dp, tp=tp, pp=pp, run=RunConfig(micro_batch=1, tp=tp))
    placement = tuple(range(pp))
    pieces = {spec: stage_costs(spec, A100, layout) for spec in (GPT_22B, tied)}
    table = GPT_22B.vocab * GPT_22B.hidden / tp
    first_rank = [rank_params(pieces[spec], placement)[0] for spec in (GPT_22B, tied)]
    assert first_rank[0] - first_rank[1] == pytest.approx(table if pp == 1 else 0.0)
    assert model_params(GPT_22B) - model_params(tied) == GPT_22B.vocab * GPT_22B.hidden
    sync = embedding_sync_s(tied, A100, placement, layout, optimizer)
    link = A100.achieved_bytes_per_s(cross_node=tp * pp > 8, one_gpu_per_node=True)
    assert sync == pytest.approx(0.0 if pp == 1 else table * 4 / link)
    assert embedding_sync_s(GPT_22B, A100, placement, layout, optimizer) == 0.0
    memory = MemoryConfig(optimizer=optimizer)
    untied_dp = dp_seconds(GPT_22B, A100, pieces[GPT_22B], placement, layout, memory)
    tied_dp = dp_seconds(tied, A100, pieces[tied], placement, layout, memory)
    if pp > 1:  # the same parameters per rank: the sync is all that differs
        assert tied_dp - untied_dp == pytest.approx(sync)


def test_the_heads_backward_all_reduce_blocks_without_overlap() -> None:
    """Megatron 2021 all-reduces the head's input gradient synchronously (the conjugate of
    copy_to_tensor_model_parallel_region): 2 collectives' worth in I, nothing hidden in W;
    2022's asynchronous all-reduce hides it behind the head's weight-gradient matmul."""
    from pipeoffload.planner.layer_time import head_seconds

    overlap = RunConfig(micro_batch=1, tp=8, recompute=Recompute.FULL, sequence_parallel=False)
    blocking = dataclasses.replace(overlap, tp_overlap=False)
    one = collective_s(GPT_22B, A100, 1, 8)
    hidden, blocked = head_seconds(GPT_22B, A100, overlap), head_seconds(GPT_22B, A100, blocking)
    assert blocked.f_s == pytest.approx(hidden.f_s)
    assert blocked.i_s - hidden.i_s == pytest.approx(2 * one)
    assert hidden.w_s - blocked.w_s == pytest.approx(2 * one * 24 / 108)  # hid, holding SMs


def test_megatron_2021_norm_kernels_slow_the_layer_by_their_measured_ratio() -> None:
    """Round 3: Megatron 2021 ran apex's FusedLayerNorm, 2022 the persistent kernel (Note [norm
    kernels]); the layer's F and I grow by exactly the norms' extra time at apex PR #1037's
    measured ratios, and a Framework hands its kernel to every RunConfig it makes."""
    run = Framework(sequence_parallel=False, tp_overlap=False).run(4, 8, Recompute.NONE)
    old = Framework(sequence_parallel=False, tp_overlap=False, norm_kernel="apex").run(
        4, 8, Recompute.NONE)
    assert (run.norm_kernel, old.norm_kernel) == (NormKernel.PERSISTENT, NormKernel.APEX)
    new_s, old_s = layer_seconds(GPT_22B, A100, run), layer_seconds(GPT_22B, A100, old)
    rows = 4 * 2048 * 6144  # residual stream, whole on every GPU without sequence parallelism
    assert old_s.f_s - new_s.f_s == pytest.approx(
        A100.memory_s(2 * 4 * rows * (0.0751 / 0.0535 - 1)))
    assert old_s.i_s - new_s.i_s == pytest.approx(
        A100.memory_s(2 * 6 * rows * (0.1762 / 0.0866 - 1), 2))
    assert old_s.w_s == new_s.w_s
    with pytest.raises(ConfigError, match="norm kernel"):
        RunConfig(norm_kernel="triton")
