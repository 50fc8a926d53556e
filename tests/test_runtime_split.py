"""The B/W split (I then W) against a plain backward: same gradients, same FLOPs."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from test_runtime_support import (
    Block,
    Embed,
    Head,
    one_thread,  # noqa: F401 - autouse fixture
    token_batch,
    token_loss,
)
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from pipeoffload.runtime.backward import plan_split
from pipeoffload.runtime.stage import StageRunner


def _middle_input(dtype=torch.float64) -> torch.Tensor:
    return torch.randn(2, 4, 8, dtype=dtype, generator=torch.Generator().manual_seed(3))


def _stage_cases():
    ids, target = token_batch(batch=2)
    hidden = _middle_input()
    return {
        "first (embedding, no input grad)": (Embed().double(), True, False, (ids,), ()),
        "middle (attention, norms, mlp)": (Block().double(), False, False, (hidden,), ()),
        "last (head and loss)": (Head().double(), False, True, (hidden,), (target,)),
    }


def _run(module, first, last, inputs, target, split):
    runner = StageRunner(1, module, first, last, token_loss, microbatches=1)
    outputs = runner.forward(0, inputs, target)
    grad_out = () if last else tuple(torch.ones_like(o) for o in outputs)
    with FlopCounterMode(display=False) as counter:
        grads = runner.backward(0, grad_out, split=split)
        if split:
            runner.weight(0)
    return counter.get_total_flops(), grads, [p.grad for p in module.parameters()]


@pytest.mark.parametrize("case", list(_stage_cases()))
def test_split_matches_plain_backward_in_gradients_and_flops(case: str) -> None:
    module, first, last, inputs, target = _stage_cases()[case]
    plain_module = copy.deepcopy(module)
    split_flops, split_in, split_params = _run(module, first, last, inputs, target, split=True)
    plain_flops, plain_in, plain_params = _run(plain_module, first, last, inputs, target, False)
    assert plain_flops > 0
    assert abs(split_flops - plain_flops) <= 0.05 * plain_flops
    for a, b in zip(split_in, plain_in):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(split_params, plain_params):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_input_backward_does_not_compute_weight_gradients() -> None:
    module = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)).double()
    runner = StageRunner(1, module, False, False, token_loss, microbatches=1)
    (out,) = runner.forward(0, (_middle_input().reshape(-1, 8).repeat(1, 2),), ())
    with FlopCounterMode(display=False) as i_counter:
        runner.backward(0, (torch.ones_like(out),), split=True)
    with FlopCounterMode(display=False) as w_counter:
        runner.weight(0)
    # Two Linear layers of 16x16 on 8 rows: dX of each is one 8x16x16 matmul, and so is dW.
    matmul = 2 * 8 * 16 * 16
    assert i_counter.get_total_flops() == 2 * matmul
    assert w_counter.get_total_flops() == 2 * matmul
    assert all(p.grad is not None for p in module.parameters())


class Tied(nn.Module):
    """One Linear applied twice: its weight sits on two input-gradient paths."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.tanh(self.linear(x)))


def test_parameter_on_two_input_paths_falls_back_to_full_backward_in_i() -> None:
    module = Tied().double()
    x = _middle_input()
    leaf = x.clone().requires_grad_()
    out = module(leaf)
    edges = [torch.autograd.graph.get_gradient_edge(out)]
    plan = plan_split(edges, [torch.autograd.graph.get_gradient_edge(leaf).node],
                      list(module.parameters()))
    assert plan.fallback
    reference = copy.deepcopy(module)
    _, grads, params = _run(module, False, False, (x,), (), split=True)
    _, ref_grads, ref_params = _run(reference, False, False, (x,), (), split=False)
    for a, b in zip([*grads, *params], [*ref_grads, *ref_params]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_untied_chain_does_not_fall_back() -> None:
    module = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).double()
    leaf = _middle_input().requires_grad_()
    out = module(leaf)
    plan = plan_split([torch.autograd.graph.get_gradient_edge(out)],
                      [torch.autograd.graph.get_gradient_edge(leaf).node],
                      list(module.parameters()))
    assert not plan.fallback
    assert len(plan.boundary) == 2  # one per Linear
