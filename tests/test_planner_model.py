"""Analytic model, hardware presets, the ratio k and model presets.

Expected values are computed here independently: FLOPs by listing the layer's matmuls and
their backward matmuls, activation bytes from Korthikanti et al. 2022's closed form or by
listing the tensors autograd keeps, k from docs/method.md's published figures.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from pipeoffload.errors import ConfigError
from pipeoffload.planner.comm_bytes import layer_tp_comm_bytes, p2p_bytes
from pipeoffload.planner.hardware import (
    HBM_EFFICIENCY,
    HOPPER_ATTENTION_EFFICIENCY,
    HOPPER_GEMM_EFFICIENCY,
    Hardware,
    hardware_names,
    hardware_preset,
    load_hardware,
)
from pipeoffload.planner.optimizer import OptimizerSpec, dp_traffic, state_bytes
from pipeoffload.planner.presets import (
    load_model,
    load_model_config,
    model_from_config,
    model_names,
    model_preset,
)
from pipeoffload.planner.ratio import (
    RunConfig,
    k_table,
    layer_cost,
    offload_ratio,
    paper_hardware,
    paper_k,
    paper_layer,
    stage_cost,
)
from pipeoffload.planner.transformer import (
    FlopCount,
    MlpKind,
    Recompute,
    TransformerSpec,
    head_activation_bytes,
    head_flops,
    layer_activation_bytes,
    layer_flops,
    layer_params,
    model_params,
    recompute_flops,
)
from pipeoffload.sim.costs import Duplex

B, S, H, A, KV, FFN, V = 2, 4, 8, 2, 1, 12, 10
D = H // A


def tiny(**changes: object) -> TransformerSpec:
    base = TransformerSpec(
        num_layers=2, hidden=H, heads=A, kv_heads=KV, ffn_hidden=FFN, vocab=V, seq_len=S,
        mlp=MlpKind.GELU, flash_attention=False, dropout=True, name="tiny",
    )
    return dataclasses.replace(base, **changes)


def mm(m: int, k: int, n: int) -> int:
    """FLOPs of an (m x k) @ (k x n) product."""
    return 2 * m * k * n


def forward_matmuls(mlp: MlpKind, kv_heads: int) -> tuple[list, list]:
    """(linear matmuls, attention-core matmuls) of one layer's forward as (m, k, n)."""
    rows = B * S
    linear = [(rows, H, H), (rows, H, kv_heads * D), (rows, H, kv_heads * D), (rows, H, H)]
    if mlp is MlpKind.GELU:
        linear += [(rows, H, FFN), (rows, FFN, H)]
    else:
        linear += [(rows, H, FFN), (rows, H, FFN), (rows, FFN, H)]
    per_head = [(S, D, S), (S, S, D)]  # Q K^T, then P V, for each of B * A (sequence, head)
    core = per_head * (B * A)
    return linear, core


@pytest.mark.parametrize("mlp", [MlpKind.GELU, MlpKind.SWIGLU])
@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("flash", [False, True])
def test_layer_flops_match_listed_matmuls(mlp: MlpKind, kv_heads: int, flash: bool) -> None:
    linear, core = forward_matmuls(mlp, kv_heads)
    forward = sum(mm(*x) for x in linear + core)
    # Y = X W: dX = dY W^T (m, n, k) and dW = X^T dY (k, m, n) cost the same as the forward.
    weight_grad = sum(mm(k, m, n) for m, k, n in linear)
    input_grad = sum(mm(m, n, k) for m, k, n in linear)
    # S = Q K^T: dQ = dS K, dK = dS^T Q; O = P V: dP = dO V^T, dV = P^T dO.
    input_grad += sum(2 * mm(m, k, n) for m, k, n in core)
    recomputed_scores = sum(mm(S, D, S) for _ in range(B * A)) if flash else 0
    spec = tiny(mlp=mlp, kv_heads=kv_heads, flash_attention=flash)

    hardware = layer_flops(spec, B, count=FlopCount.HARDWARE)
    assert (hardware.f, hardware.i, hardware.w) == (
        forward, input_grad + recomputed_scores, weight_grad
    )
    model = layer_flops(spec, B, count="model")
    assert (model.f, model.i, model.w) == (forward, input_grad, weight_grad)
    assert model.total == 3 * forward
    halved = layer_flops(spec, B, tp=2)
    assert halved.total == pytest.approx(hardware.total / 2)


def test_model_flops_equal_the_papers_count_for_gpt() -> None:
    spec = tiny(kv_heads=A, ffn_hidden=4 * H)
    assert layer_flops(spec, B, count="model").total == 12 * B * S * H * (6 * H + S)
    # Narayanan et al. 2021: 72 B s l h^2 (1 + s / 6h) per step for l layers, no vocabulary.
    assert layer_flops(spec, B, count="model").total == pytest.approx(
        72 * B * S * H**2 * (1 + S / (6 * H))
    )


def test_recompute_flops() -> None:
    spec = tiny()
    assert recompute_flops(spec, B, "none") == 0
    assert recompute_flops(spec, B, "lgd") == 0
    assert recompute_flops(spec, B, "full") == layer_flops(spec, B).f
    assert recompute_flops(spec, B, "full", count="model") == 0


def test_head_flops() -> None:
    flops = head_flops(tiny(), B, tp=2)
    assert flops.f == flops.i == flops.w == mm(B * S, H, V) / 2


def test_activation_bytes_match_korthikanti() -> None:
    # Korthikanti et al. 2022, eq. 1 and section 4.2.2: 34 s b h + 5 a s^2 b per layer in 16-bit
    # (GPT layer: no GQA, f = 4h, dropout), divided by t under tensor + sequence parallelism.
    spec = tiny(kv_heads=A, ffn_hidden=4 * H)
    expected = 34 * S * B * H + 5 * A * S * S * B
    assert layer_activation_bytes(spec, B, "none") == expected
    assert layer_activation_bytes(spec, B, Recompute.NONE, tp=4) == expected / 4
    flash = dataclasses.replace(spec, flash_attention=True)
    lse = 4 * A * S * B  # fp32 log-sum-exp per (sequence, head, position)
    assert layer_activation_bytes(flash, B, "none") == 34 * S * B * H + lse
    # docs/method.md section 2: ~20 b s h for LGD with flash attention.
    assert layer_activation_bytes(flash, B, "lgd") == 20 * B * S * H + lse
    assert layer_activation_bytes(flash, B, "full") == 2 * B * S * H
    assert layer_activation_bytes(flash, B, "full", tp=2) == B * S * H


def test_activation_bytes_swiglu_gqa_listed() -> None:
    spec = tiny(mlp="swiglu", flash_attention=True, dropout=False, activation_bytes=2)
    e, bsh, bsf, kv = 2, B * S * H, B * S * FFN, B * S * KV * D
    kept_by_lgd = {  # tensors autograd keeps that LGD does not recompute
        "norm1 input": e * bsh, "q": e * bsh, "k": e * kv, "v": e * kv,
        "attention output": e * bsh, "lse": 4 * B * A * S, "norm2 input": e * bsh,
        "gate": e * bsf, "up": e * bsf,
    }
    recomputed_by_lgd = {
        "norm1 output": e * bsh, "norm2 output": e * bsh, "silu(gate)": e * bsf,
        "silu(gate) * up": e * bsf,
    }
    assert layer_activation_bytes(spec, B, "lgd") == sum(kept_by_lgd.values())
    assert layer_activation_bytes(spec, B, "none") == sum(kept_by_lgd.values()) + sum(
        recomputed_by_lgd.values()
    )


def test_head_activation_bytes() -> None:
    spec = tiny()
    assert head_activation_bytes(spec, B, "none") == 2 * 2 * B * S * H + 4 * B * S * V
    assert head_activation_bytes(spec, B, "lgd", tp=2) == (2 * B * S * H + 4 * B * S * V) / 2


def test_params_and_state_bytes() -> None:
    spec = tiny(mlp="swiglu")
    matrices = 2 * H * H + 2 * H * KV * D + 3 * H * FFN
    assert layer_params(spec).total == matrices + 2 * H
    assert layer_params(spec, tp=2).total == matrices / 2 + 2 * H
    # Megatron-LM distributed-optimizer docs: 18 bytes per parameter, 6 + 12 / d when sharded.
    n = 1000.0
    assert state_bytes(spec, n, OptimizerSpec()).total == 18 * n
    assert state_bytes(spec, n, OptimizerSpec(sharded=True), dp=4).total == (6 + 12 / 4) * n


def test_communication_bytes() -> None:
    spec = tiny()
    one = (4 - 1) / 4 * B * S * H * 2
    comm = layer_tp_comm_bytes(spec, B, tp=4)
    # backward: the four conjugates and Megatron's re-gather of the two column-parallel inputs
    assert (comm.forward, comm.backward) == (pytest.approx(4 * one), pytest.approx(6 * one))
    assert layer_tp_comm_bytes(spec, B, tp=1).forward == 0
    assert p2p_bytes(spec, B, tp=2) == B * S * H * 2 / 2
    traffic = dp_traffic(spec, 1000.0, OptimizerSpec(), dp=4)
    assert traffic.total == pytest.approx(2 * 3 / 4 * 1000 * 4)
    sharded = dp_traffic(spec, 1000.0, OptimizerSpec(sharded=True), dp=4)
    assert sharded.total == pytest.approx(3 / 4 * 1000 * 4 + 3 / 4 * 1000 * 2)


def fake_hw(**changes: object) -> Hardware:
    base = Hardware(
        name="fake", bf16_flops_per_s=1e3, hbm_bytes=1e9, d2h_bytes_per_s=100.0,
        h2d_bytes_per_s=50.0, intra_node_bytes_per_s=10.0, inter_node_bytes_per_s=1.0,
        gpus_per_node=4,
    )
    return dataclasses.replace(base, **changes)


def test_times_from_flops_and_bytes() -> None:
    """Flat GEMM rate and nominal links (fake_hw's defaults): F pays its 4 collectives, I the
    2 exposed ones plus the re-run forward under full recompute; the column-parallel re-gather
    (I) and reduce-scatter (W) cost only what sticks out of the QKV and MLP-in matmuls."""
    spec, hw = tiny(), fake_hw()
    run = RunConfig(micro_batch=B, tp=2, recompute="full")
    cost = layer_cost(spec, hw, run)
    flops = layer_flops(spec, B, tp=2)
    one = layer_tp_comm_bytes(spec, B, tp=2).forward / 4 / 10.0
    column = (mm(B * S, H, (H + 2 * KV * D) // 2) / 1e3, mm(B * S, H, FFN // 2) / 1e3)
    overhang = sum(max(0.0, one - matmul) for matmul in column)
    assert overhang > 0  # tiny matmuls: the collectives stick out
    forward = flops.f / 1e3 + 4 * one
    assert cost.f_s == pytest.approx(forward)
    assert cost.i_s == pytest.approx(flops.i / 1e3 + 2 * one + overhang + forward)
    assert cost.w_s == pytest.approx(flops.w / 1e3 + overhang)
    across_nodes = layer_cost(spec, hw, RunConfig(micro_batch=B, tp=8))
    assert across_nodes.f_s == pytest.approx(
        layer_flops(spec, B, tp=8).f / 1e3 + layer_tp_comm_bytes(spec, B, tp=8).forward / 1.0
    )
    last = stage_cost(spec, hw, run, layers=3, head=True)
    assert last.chunk_s == pytest.approx(
        3 * cost.chunk_s + head_flops(spec, B, tp=2).total / 1e3 + one
        + 2 * max(0.0, one - mm(B * S, H, V // 2) / 1e3)
    )
    assert last.activation_bytes == pytest.approx(
        3 * cost.activation_bytes + head_activation_bytes(spec, B, "full", tp=2)
    )
    with pytest.raises(ConfigError, match="at least one layer"):
        stage_cost(spec, hw, run, layers=0)


# docs/method.md section 2, A100 figures (220 TFLOP/s, 15 GB/s), s = 8192.
PAPER_K = [(4096, 1.49), (8192, 0.85), (16384, 0.46)]


@pytest.mark.parametrize(("hidden", "expected"), PAPER_K)
def test_k_reproduces_paper_notes(hidden: int, expected: float) -> None:
    a100 = paper_hardware()  # the paper's 220 TFLOP/s for every FLOP, memory-bound work not timed
    closed = paper_k(hidden, 8192, a100.bf16_flops_per_s, a100.d2h_bytes_per_s)
    assert closed == pytest.approx(expected, rel=0.02)
    spec, run = paper_layer(hidden, 8192)
    ratio = offload_ratio(spec, a100, run)
    assert ratio.k == pytest.approx(expected, rel=0.02)
    assert ratio.k == pytest.approx(closed, rel=0.005)
    assert f"{ratio.k:.3f}" in str(ratio)
    # At one matmul rate k does not depend on the microbatch size; with the GEMM shape model
    # larger microbatches run their matmuls a little faster, so k rises a little.
    bigger = offload_ratio(spec, a100, dataclasses.replace(run, micro_batch=4))
    assert bigger.k == pytest.approx(ratio.k)
    shaped = dataclasses.replace(a100, gemm_ridge_flops_per_byte=153.0)
    k1 = offload_ratio(spec, shaped, run).k
    assert k1 <= offload_ratio(spec, shaped, dataclasses.replace(run, micro_batch=4)).k < 1.01 * k1


def test_hardware_flop_count_lowers_k_by_flash_recompute() -> None:
    a100 = paper_hardware()
    h, s = 4096, 8192
    spec, run = paper_layer(h, s)
    model_k = offload_ratio(spec, a100, run).k
    hardware_k = offload_ratio(spec, a100, dataclasses.replace(run, flop_count="hardware")).k
    # flash attention re-runs Q K^T (2 b s^2 h) on top of 12 b s h (6h + s)
    assert hardware_k / model_k == pytest.approx(12 * (6 * h + s) / (12 * (6 * h + s) + 2 * s))


def test_k_table_rows() -> None:
    rows = k_table(paper_hardware(), (4096, 8192), (8192,))
    assert [(h, s) for h, s, _, _ in rows] == [(4096, 8192), (8192, 8192)]
    assert rows[0][2] > rows[1][2]  # k falls as h grows


def test_hardware_presets_and_json(tmp_path) -> None:
    assert {"a100-80gb", "h100-80gb", "h200"} <= set(hardware_names())
    a100 = hardware_preset(" A100-80GB ")
    # measured large-GEMM rates (MAMF) and datasheet peaks; the host link's authors' figures
    assert (a100.bf16_flops_per_s, a100.peak_flops_per_s, a100.d2h_bytes_per_s) == (
        271.2e12, 312e12, 15e9)
    h100 = hardware_preset("H100")
    # Hopper: the measured burst rates at the sustained shares fitted on published H100 runs
    # (hardware.py, Note [Hopper calibration])
    assert (h100.bf16_flops_per_s, h100.attention_flops_per_s, h100.peak_flops_per_s,
            h100.h2d_bytes_per_s) == (HOPPER_GEMM_EFFICIENCY * 794.5e12,
                                      HOPPER_ATTENTION_EFFICIENCY * 335e12, 989e12, 21e9)
    assert a100.sm_count == 108 and h100.sm_count == 132
    assert a100.hbm_bytes_per_s == pytest.approx(HBM_EFFICIENCY * 2.039e12)
    for preset in (a100, h100, hardware_preset("h200")):
        assert preset.host_bytes_per_node == 2e12
    assert hardware_preset("h200").hbm_bytes > h100.hbm_bytes
    with pytest.raises(ConfigError, match="a100-80gb, h100-80gb, h200, b200, gb200"):
        hardware_preset("v100")
    b200, gb200 = hardware_preset("B200"), hardware_preset("gb200-nvl72")
    # Blackwell datasheets: dense BF16 peak, HBM, one NVLink domain of 72 on the NVL72
    assert (b200.peak_flops_per_s, gb200.peak_flops_per_s) == (2.25e15, 2.5e15)
    assert (b200.hbm_bytes, gb200.hbm_bytes, gb200.gpus_per_node) == (180e9, 186e9, 72)
    assert b200.bf16_flops_per_s / b200.peak_flops_per_s == pytest.approx(
        h100.bf16_flops_per_s / h100.peak_flops_per_s)
    custom = dataclasses.replace(a100, name="mine", d2h_bytes_per_s=12e9, full_duplex=False)
    assert Hardware.from_json(custom.to_json()) == custom
    assert custom.host_link().duplex is Duplex.HALF
    assert a100.host_link().ranks_per_link == 2
    path = tmp_path / "hw.json"
    path.write_text(custom.to_json())
    assert load_hardware(str(path)) == custom
    assert load_hardware("h200") == hardware_preset("h200")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", r"<json>:1:2: not valid JSON"),
        ("[1]", "expected a JSON object"),
        ('{"name": "x", "speed": 1}', "unknown hardware field.*speed"),
        ('{"name": "x"}', "missing hardware field.*bf16_flops_per_s"),
    ],
)
def test_hardware_json_errors(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Hardware.from_json(text)


def test_hardware_rejects_bad_values() -> None:
    with pytest.raises(ConfigError, match="d2h_bytes_per_s must be a positive number"):
        fake_hw(d2h_bytes_per_s=0)
    with pytest.raises(ConfigError, match="gpus_per_node must be a whole number"):
        fake_hw(gpus_per_node=2.5)


# Published parameter counts: Llama 3 model cards (8.03B, 70.6B, 405B), GPT-3 175.0B;
# the PipeOffload paper's table 2 names its models by size with the embedding counted once.
@pytest.mark.parametrize(
    ("name", "billions", "rel"),
    [("llama3-8b", 8.03, 0.002), ("llama3-70b", 70.6, 0.002), ("llama3-405b", 405.0, 0.005),
     ("gpt3-175b", 175.0, 0.005)],
)
def test_model_presets_parameter_counts(name: str, billions: float, rel: float) -> None:
    assert model_params(model_preset(name)) == pytest.approx(billions * 1e9, rel=rel)


@pytest.mark.parametrize("billions", ["5.8", "10.5", "18.1", "42.9", "66.6", "83.8"])
def test_paper_model_presets(billions: str) -> None:
    spec = model_preset(f"pipeoffload-{billions}b")
    assert spec.kv_heads == 8 and spec.head_dim == 128
    once = model_params(spec) - spec.vocab * spec.hidden
    assert once == pytest.approx(float(billions) * 1e9, abs=0.06e9)


def test_model_preset_lookup_and_overrides() -> None:
    assert model_preset("Llama-3-8B") == model_preset("llama3_8b")
    llama = model_preset("llama3-8b", seq_len=4096)
    assert (llama.seq_len, llama.kv_heads, llama.ffn_hidden, llama.mlp) == (
        4096, 8, 14336, MlpKind.SWIGLU
    )
    assert "gpt3-175b" in model_names()
    with pytest.raises(ConfigError, match="known presets: .*llama3-405b"):
        model_preset("llama2-7b")
    with pytest.raises(ConfigError, match="unknown model field.*seq_length"):
        model_preset("llama3-8b", seq_length=4096)


LLAMA3_8B_HF = {
    "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "attention_dropout": 0.0, "vocab_size": 128256,
    "torch_dtype": "bfloat16",
}


def test_load_huggingface_config(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B_HF))
    loaded = load_model_config(path)
    assert dataclasses.replace(loaded, name="llama3-8b", train_model=None,
                               model_type=None) == model_preset("llama3-8b")
    assert (loaded.train_model, loaded.model_type) == (str(path), "llama")  # train --model it
    assert load_model(str(path), seq_len=2048).seq_len == 2048
    gpt2 = model_from_config({"n_layer": 12, "n_embd": 768, "n_head": 12, "n_inner": None,
                              "n_positions": 1024, "vocab_size": 50257,
                              "activation_function": "gelu_new", "resid_pdrop": 0.1})
    assert (gpt2.ffn_hidden, gpt2.kv_heads, gpt2.mlp, gpt2.dropout) == (
        3072, 12, MlpKind.GELU, True
    )
    ours = model_from_config({"num_layers": 2, "hidden": 8, "heads": 2, "ffn_hidden": 12,
                              "vocab": 10, "seq_len": 4, "mlp": "swiglu",
                              "flash_attention": False, "name": "mine"})
    assert ours == TransformerSpec(2, 8, 2, 2, 12, 10, 4, mlp=MlpKind.SWIGLU,
                                   flash_attention=False, name="mine")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden": 5120}, "hidden=5120, hidden_size=4096 disagree"),
        ({"num_hidden_layers": None}, r"missing num_layers \(or num_hidden_layers / n_layer\)"),
        ({"hidden_act": "relu"}, "unknown activation 'relu'"),
        ({"num_attention_heads": 30}, "hidden=4096 is not a multiple of heads=30"),
        ({"mlp": "moe"}, "mlp must be one of"),
    ],
)
def test_config_errors_name_the_file(tmp_path, changes: dict, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA3_8B_HF, **changes}))
    with pytest.raises(ConfigError, match=message) as info:
        load_model_config(path)
    assert str(path) in str(info.value)


def test_config_file_errors(tmp_path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "hidden_size": 4096,\n}')
    with pytest.raises(ConfigError, match=r"bad.json:3:1: not valid JSON"):
        load_model_config(path)
    with pytest.raises(ConfigError, match="cannot read model config"):
        load_model(str(tmp_path / "missing.json"))


def test_spec_validation() -> None:
    with pytest.raises(ConfigError, match="heads=2 is not a multiple of kv_heads=3"):
        tiny(kv_heads=3)
    with pytest.raises(ConfigError, match="seq_len must be a positive integer"):
        tiny(seq_len=0)
    with pytest.raises(ConfigError, match="flash_attention must be true or false, got 'yes'"):
        tiny(flash_attention="yes")
    with pytest.raises(ConfigError,
                       match="recompute must be one of 'none', 'lgd', 'selective', 'full'"):
        layer_activation_bytes(tiny(), B, "partial")
    with pytest.raises(ConfigError, match="micro_batch must be >= 1"):
        layer_flops(tiny(), 0)


def test_planner_model_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import pipeoffload.planner.transformer, pipeoffload.planner.hardware\n"
        "import pipeoffload.planner.ratio, pipeoffload.planner.presets\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
