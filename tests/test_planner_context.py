"""Context parallelism in the planner (planner/context.py, Note [context parallelism]): each
term against its formula, the search's CP degrees, and `plan --cp` reporting the configuration
issue 35 names."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from pipeoffload.cli.plan import add_plan_parser
from pipeoffload.errors import ConfigError
from pipeoffload.planner.comm_bytes import p2p_bytes
from pipeoffload.planner.context import check_context, context_spec, kv_gather_bytes
from pipeoffload.planner.costing import Layout, MemoryConfig, rank_state
from pipeoffload.planner.evaluate import Candidate, Evaluator
from pipeoffload.planner.hardware import hardware_preset
from pipeoffload.planner.layer_time import (
    RunConfig,
    attention_core_s,
    context_seconds,
    layer_seconds,
)
from pipeoffload.planner.optimizer import OptimizerSpec
from pipeoffload.planner.presets import model_preset
from pipeoffload.planner.ratio import layer_cost, p2p_s
from pipeoffload.planner.space import SearchSpace, context_degrees
from pipeoffload.planner.train_command import train_command
from pipeoffload.planner.transformer import Recompute, layer_activation_bytes, layer_flops

SPEC = model_preset("llama3-70b")  # seq 8192, 8 KV heads of 128
H100 = hardware_preset("h100-80gb")


@pytest.mark.parametrize("recompute", [Recompute.NONE, Recompute.LGD, Recompute.FULL])
def test_a_cp_rank_holds_its_tokens_and_the_gathered_kv(recompute):
    b, tp, cp = 1, 4, 2
    local = context_spec(SPEC, cp)
    assert local.seq_len == 4096 and context_spec(SPEC, 1) is SPEC
    cost = layer_cost(SPEC, H100, RunConfig(b, tp, recompute, cp=cp))
    own = layer_activation_bytes(local, b, recompute, tp=tp)
    # the other rank's K and V of this rank's heads: 2 b (s / cp) h_kv / t elements, 2 bytes
    gathered = 0 if recompute is Recompute.FULL else 2 * b * 4096 * 8 * 128 / tp * 2
    assert cost.activation_bytes == own + gathered
    whole = layer_cost(SPEC, H100, RunConfig(b, tp, recompute))
    ratio = cost.activation_bytes / whole.activation_bytes
    assert ratio == 0.5 if recompute is Recompute.FULL else 0.5 < ratio < 0.6
    # FLOPs: linear ones scale with the tokens, the balanced causal square with 1/cp too
    assert cost.flops.f == pytest.approx(layer_flops(SPEC, b, tp=tp).f / cp, rel=1e-12)


def test_kv_exchange_is_a_ring_over_cp_and_overlaps_the_attention():
    b, tp, cp = 1, 4, 4
    local = context_spec(SPEC, cp)
    assert kv_gather_bytes(local, b, tp, cp) == 3 / 4 * (2 * b * 8192 * 8 * 128 / tp) * 2
    run = RunConfig(b, tp, Recompute.NONE, cp=cp)
    # without the exchange's cost (a link of 1e30 bytes/s and no SMs taken), a CP rank's
    # layer is the s / cp layer plus cp - 1 more shares of its attention core
    free = dataclasses.replace(H100, intra_node_bytes_per_s=1e30, collective_sms=0)
    core = attention_core_s(local, free, b, tp, run.flop_count)
    launch = free.kernel_launch_s
    plain = layer_seconds(local, free, dataclasses.replace(run, cp=1))
    priced = layer_seconds(SPEC, free, run)
    assert priced.f_s == pytest.approx(plain.f_s + 3 * (core.f_s - launch), rel=1e-12)
    assert priced.i_s == pytest.approx(plain.i_s + 3 * (core.i_s - launch), rel=1e-12)
    # on H100 NVLink the 8192-token exchange hides behind the attention: only the SMs it holds
    core = attention_core_s(local, H100, b, tp, run.flop_count)
    exposed = context_seconds(local, H100, run).f_s - 3 * (core.f_s - launch)
    comm = kv_gather_bytes(local, b, tp, cp) / H100.link_bytes_per_s(tp * cp)
    assert comm < 4 * core.f_s
    assert exposed == pytest.approx(comm * H100.collective_sm_share, rel=1e-9)
    # the pipeline's boundary activation is the rank's tokens
    assert p2p_s(SPEC, H100, run, cross_node=False) == pytest.approx(
        p2p_bytes(local, b, tp=tp) / H100.achieved_bytes_per_s(cross_node=False,
                                                                one_gpu_per_node=True))


def test_gradients_and_the_distributed_optimizer_span_dp_times_cp():
    layout = Layout(2, 4, 4, 5, RunConfig(1, 4, Recompute.NONE, cp=2))
    assert (layout.gpus, layout.grad_replicas) == (64, 4)
    evaluator = Evaluator(SPEC, H100, MemoryConfig(optimizer=OptimizerSpec(sharded=True)), 1e30)
    candidate = Candidate("interleaved-1f1b", 2, 4, 4, 5, 1, 64, Recompute.NONE, cp=2)
    wide = dataclasses.replace(candidate, dp=4, cp=1)
    memory = MemoryConfig(optimizer=OptimizerSpec(sharded=True))
    placement = evaluator.stage_to_rank(candidate)
    states = rank_state(SPEC, evaluator.pieces(candidate), placement,
                        evaluator.layout(candidate), memory)
    assert states == rank_state(SPEC, evaluator.pieces(wide), placement,
                                evaluator.layout(wide), memory)
    assert evaluator.layout(candidate).gpus == candidate.gpus == 64


def test_the_search_tries_cp_within_a_node_down_to_4096_tokens_per_gpu():
    space = SearchSpace()
    assert context_degrees(SPEC, H100, 4, space) == [1, 2]
    assert context_degrees(SPEC, H100, 8, space) == [1]
    long = dataclasses.replace(SPEC, seq_len=131072)
    assert context_degrees(long, H100, 1, space) == [1, 2, 4, 8]
    assert context_degrees(dataclasses.replace(SPEC, seq_len=4096), H100, 1, space) == [1]
    assert context_degrees(SPEC, H100, 4, SearchSpace(cp=(3, 4, 16))) == [4, 16]
    with pytest.raises(ConfigError, match="multiple of 2 \\* cp = 6"):
        check_context(dataclasses.replace(SPEC, seq_len=8200), 3)


def test_plan_reports_the_cp_configuration_of_issue_35(capsys):
    parser = argparse.ArgumentParser(prog="pipeoffload")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([
        "plan", "--model", "llama3-70b", "--gpus", "64", "--hardware", "h100-80gb", "--seq",
        "8192", "--global-batch", "128", "--tp", "4", "--pp", "4", "--chunks", "5", "--cp", "2",
        "--micro-batch-sizes", "1", "--schedules", "interleaved-1f1b", "--recompute", "none",
        "--offload", "none", "--sharded-optimizer", "--json", "--quiet"])
    assert args.handler(args) == 0
    data = json.loads(capsys.readouterr().out)
    best = data["best"]
    assert data["fixed"]
    assert (best["tp"], best["pp"], best["chunks"], best["dp"], best["cp"],
            best["microbatches"]) == (4, 4, 5, 2, 2, 64)
    command = train_command(Candidate("interleaved-1f1b", 2, 4, 4, 5, 1, 64, cp=2)).argv
    assert command is not None and " --tp 4 --cp 2 " in command


def test_docs_cp_table_rows_are_what_the_benchmark_prints():
    """docs/planner.md's table (issue 35, item 4) is benchmarks/planner_cp_table.py's output:
    two of its rows, recomputed."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("planner_cp_table",
                                                  root / "benchmarks" / "planner_cp_table.py")
    assert spec is not None and spec.loader is not None
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    docs = (root / "docs" / "planner.md").read_text()
    for gpus, seq, kind in ((64, 8192, "TP + CP"), (256, 8192, "TP only")):
        assert table.row(gpus, seq, kind) in docs, (gpus, seq, kind)
