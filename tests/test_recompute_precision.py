"""`train --recompute` and `--dtype`: recompute changes memory, never values; bf16 halves the
activation bytes (except what stays float32 by design) and still learns. Inline runs (one
process, Pipeline's local mode) on the tiny model."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from test_runtime_support import one_thread  # noqa: E402, F401 - autouse fixture

from pipeoffload.core.actions import Kind  # noqa: E402
from pipeoffload.parallel.topology import Topology  # noqa: E402
from pipeoffload.training.data import DataConfig  # noqa: E402
from pipeoffload.training.model_config import model_preset  # noqa: E402
from pipeoffload.training.train import TrainConfig  # noqa: E402
from pipeoffload.training.trainer import train  # noqa: E402

TINY = model_preset("tiny")


def _config(**changes) -> TrainConfig:
    base = TrainConfig(model=TINY, data=DataConfig(seq_len=32, batch_size=8, max_bytes=1 << 16),
                       pp=2, schedule="1f1b", steps=5, measure_baseline=False)
    return dataclasses.replace(base, **changes)


def _run(config: TrainConfig):
    return train(config, Topology.local(config.pp))


MODES = {"1f1b": ("none", "lgd", "full"),  # plain B
         "po-f": ("none", "full"),  # recompute mixed with offload
         "zbv": ("none", "lgd")}  # the I/W split re-runs a region twice


@pytest.mark.parametrize("schedule", list(MODES))
def test_recompute_keeps_losses_bitwise_and_lowers_peaks_as_simulated(schedule: str) -> None:
    runs = {mode: _run(_config(schedule=schedule, recompute=mode)) for mode in MODES[schedule]}
    none = runs["none"]
    for mode, result in runs.items():
        assert result.losses == none.losses, mode  # bitwise, all 5 steps
        assert result.peak_bytes == tuple(int(b) for b in result.predicted_bytes), mode
        if mode != "none":
            assert all(a < b for a, b in zip(result.peak_bytes, none.peak_bytes)), mode
            assert all(a < b for a, b in zip(result.stage_bytes, none.stage_bytes)), mode
    if "lgd" in runs and "full" in runs:
        assert all(a < b for a, b in zip(runs["full"].stage_bytes, runs["lgd"].stage_bytes))
    assert not any(r.plan.schedule.has_kind(Kind.RECOMPUTE) for r in runs.values())


def test_the_planners_per_chunk_recompute_and_offload_mix_runs_exactly() -> None:
    from pipeoffload.planner.evaluate import RECOMPUTE_AND_OFFLOAD

    grouped = {"schedule": "grouped-interleaved", "chunks": 2, "steps": 2}
    offload = _run(_config(offload="all", **grouped))
    mixed = _run(_config(offload=RECOMPUTE_AND_OFFLOAD, **grouped))
    assert mixed.plan.schedule.has_kind(Kind.RECOMPUTE)
    assert mixed.plan.schedule.has_kind(Kind.OFFLOAD)
    assert mixed.losses == offload.losses
    assert mixed.peak_bytes == tuple(int(b) for b in mixed.predicted_bytes)


def test_bf16_halves_activation_bytes_except_float32_statistics() -> None:
    """Per middle-stage layer, fp32 keeps what bf16 keeps at twice the bytes, plus two norms'
    float32 work (normalised x and 1/rms) that bf16 recomputes, minus nothing for attention's
    log-sum-exp, which is float32 in both (b * heads * s * 4 bytes)."""
    runs = {d: _run(_config(schedule="po-f", steps=1, dtype=d)) for d in ("fp32", "bf16")}
    b, s = 8 // (2 * 2), 32  # batch / microbatches (2 * pp), seq
    extra_fp32 = 2 * (b * s * TINY.dim * 4 + b * s * 4)
    lse = b * TINY.n_heads * s * 4
    layers_per_stage = TINY.n_layers // 4  # po-f at pp=2: 4 stages
    for stage in (1, 2):  # no embedding ids, no float32 loss
        fp32, bf16 = runs["fp32"].stage_bytes[stage], runs["bf16"].stage_bytes[stage]
        assert fp32 - 2 * bf16 == layers_per_stage * (extra_fp32 - lse), (fp32, bf16)
    for result in runs.values():  # the simulator, given the sizes, predicts what was measured
        assert result.peak_bytes == tuple(int(v) for v in result.predicted_bytes)
    assert runs["bf16"].peak_bytes[0] < runs["fp32"].peak_bytes[0] / 2


def test_bf16_trains_bf16_weights_from_float32_masters_and_learns() -> None:
    result = _run(_config(dtype="bf16", steps=30))
    assert result.losses[-1] <= 0.7 * result.losses[0], result.losses


def test_bf16_keeps_float32_masters_and_optimizer_state() -> None:
    from pipeoffload.parallel.precision import MasterWeights

    module = torch.nn.Linear(4, 4).to(torch.bfloat16)
    masters = MasterWeights({0: module}, mixed=True)
    assert all(m.dtype == torch.float32 for m in masters.params[0])
    module(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
    masters.take_grads()
    assert module.weight.grad is None and masters.params[0][0].grad.dtype == torch.float32
    with torch.no_grad():
        masters.params[0][0].add_(1e-3)  # below bf16's resolution near the weights
    masters.write_back()
    assert module.weight.dtype == torch.bfloat16
    assert torch.equal(module.weight, masters.params[0][0].to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("seed,batch,seq", [(0, 2, 128), (1, 1, 32), (2, 3, 17)])
@pytest.mark.parametrize("split", [False, True])
def test_one_block_s_gradients_are_bitwise_in_every_recompute_mode(dtype, seed, batch, seq,
                                                                 split) -> None:
    """Outputs, input gradient and every parameter gradient of one block equal recompute
    none's bit for bit, with one backward (B) and with the input gradient first and the
    parameters' after (the runtime's I then W). Before the regions passed the residual's input
    on (Note: [lgd gradient sums]) lgd's input gradient differed here in the last bit."""
    from pipeoffload.training.model import TransformerBlock, rope_angles

    torch.manual_seed(seed)
    block = TransformerBlock(TINY)
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.1)
    block = block.to(dtype)
    x0 = torch.randn(batch, seq, TINY.dim, dtype=dtype)
    grad_out = torch.randn(batch, seq, TINY.dim, dtype=dtype)
    cos, sin = rope_angles(torch.arange(seq), TINY.head_dim, TINY.rope_theta)
    got = {}
    for mode in ("none", "lgd", "full"):
        block.recompute = mode
        block.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        out = block(x, cos, sin)
        params = list(block.parameters())
        if split:
            (x_grad,) = torch.autograd.grad(out, x, grad_out, retain_graph=True)
            grads = torch.autograd.grad(out, params, grad_out)
        else:
            out.backward(grad_out)
            x_grad, grads = x.grad, [p.grad for p in params]
        got[mode] = (out.detach(), x_grad, grads)
    for mode in ("lgd", "full"):
        out, x_grad, grads = got[mode]
        assert torch.equal(out, got["none"][0]), mode
        assert torch.equal(x_grad, got["none"][1]), mode
        names = [n for n, _ in block.named_parameters()]
        assert [n for n, g, g0 in zip(names, grads, got["none"][2]) if not torch.equal(g, g0)
                ] == [], mode
