"""The CUDA paths of the offloader and the recomputation (skipped without a GPU;
benchmarks/gpu_check.sh runs them, also under TORCH_CUDA_SANITIZER=1)."""

from __future__ import annotations

import pytest
import torch
from test_runtime_support import token_batch, token_loss, transformer_stages, with_offload
from torch import nn

from pipeoffload.api import build_schedule
from pipeoffload.core.actions import Action, Kind
from pipeoffload.runtime.config import OffloadConfig, RuntimeConfig
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.pipeline import Pipeline

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture
def deterministic():
    """Deterministic kernels (embedding backward without atomics; SDPA by the math backend) so
    that two runs can be compared bitwise; the global setting is restored afterwards."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _grads(sched, cap: int | None = None, meter: ActivationMeter | None = None):
    torch.manual_seed(0)
    stages = [s.cuda() for s in transformer_stages(sched.num_stages, torch.float32)]
    ids, target = token_batch(batch=8, seq=16)
    config = RuntimeConfig(offload=OffloadConfig(min_offload_elements=0,
                                                 max_pending_copy_bytes=cap))
    pipe = Pipeline(dict(enumerate(stages)), sched, token_loss, config=config, meter=meter)
    for _ in range(2):
        for s in stages:
            s.zero_grad(set_to_none=True)
        pipe.step(ids.cuda(), target=target.cuda())
    torch.cuda.synchronize()
    return [p.grad.cpu() for s in stages for p in s.parameters()], pipe


@pytest.mark.parametrize("back", [Kind.RELOAD, Kind.FETCH])
@pytest.mark.parametrize("cap", [None, 0, 1 << 16])
def test_cuda_offload_is_bitwise_and_respects_the_cap(back: Kind, cap: int | None,
                                                      deterministic) -> None:
    base = build_schedule("zbv", pp=2, microbatches=4)
    plain, _ = _grads(base)
    offloaded, pipe = _grads(with_offload(base, back=back), cap)
    assert all(torch.equal(a, b) for a, b in zip(plain, offloaded))
    if cap is not None:
        assert pipe.offloader.max_pending_bytes_seen <= cap


class Noise(nn.Module):
    """No parameters: its device comes from the pipeline, not from a weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, 0.5) * 2


def test_cuda_recompute_of_a_parameter_free_stage_draws_the_same_numbers() -> None:
    sched = build_schedule("1f1b", pp=2, microbatches=2)
    results = []
    for schedule in (sched, _recompute_before_backward(sched, stage=1)):
        torch.manual_seed(0)
        torch.cuda.manual_seed(0)
        stages = {0: nn.Linear(4, 4).cuda(), 1: Noise()}
        x = torch.randn(4, 4, device="cuda")
        pipe = Pipeline(stages, schedule, lambda out: out.sum(), device="cuda")
        pipe.step(x)
        results.append(stages[0].weight.grad.clone())
    # Stage 1's input gradient is its dropout mask: stage 0's weight gradient sees it.
    assert torch.equal(results[0], results[1])


def _recompute_before_backward(schedule, stage: int):
    rows = []
    for row in schedule.ranks:
        out = []
        for action in row:
            if action.kind is Kind.B and action.stage == stage:
                out.append(Action(stage, Kind.RECOMPUTE, action.microbatch))
            out.append(action)
        rows.append(out)
    return schedule.with_ranks(rows, name=schedule.name + "+recompute")
