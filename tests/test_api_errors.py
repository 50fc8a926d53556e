"""Python API misuse ends in an error that names the stage, the microbatch and what was
expected, not an exception from inside torch or the user's module (issue 25, point 10)."""

from __future__ import annotations

import re

import pytest

from pipeoffload.core.actions import parse_action
from pipeoffload.core.errors import ScheduleError
from pipeoffload.core.schedule import Schedule

torch = pytest.importorskip("torch")
from torch import nn

import pipeoffload as po
from pipeoffload.errors import ConfigError, PipelineRuntimeError


def _stages() -> dict[int, nn.Module]:
    torch.manual_seed(0)
    return {0: nn.Linear(8, 8), 1: nn.Linear(8, 8)}


def _mse(out, y):
    return ((out - y) ** 2).mean()


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x), self.linear(x)


SCHEDULE = po.build_schedule("1f1b", pp=2, microbatches=2)
X, Y = torch.randn(4, 8), torch.randn(4, 8)


def test_a_schedule_of_strings_is_refused_where_it_is_made():
    with pytest.raises(ScheduleError, match=re.escape(
            "rank 0, position 1: '0B0' is a str, not an Action")):
        Schedule([[parse_action("0F0"), "0B0"]], (0,), 1)


@pytest.mark.parametrize("inputs,target,says", [
    (torch.tensor(1.0), Y, "inputs[0] is a scalar (0-d tensor); it needs a batch dimension"),
    (X, torch.tensor(1.0), "target[0] is a scalar (0-d tensor)"),
    (X.to("meta"), Y, "inputs[0] is on the meta device"),
])
def test_inputs_without_a_batch_or_without_data_are_refused_before_any_compute(inputs, target,
                                                                            says):
    pipe = po.Pipeline(_stages(), SCHEDULE, _mse)
    with pytest.raises(ConfigError, match=re.escape(says)):
        pipe.step(inputs, target=target)


@pytest.mark.parametrize("loss_fn,says", [
    (lambda out, y: (out.sum() > 0).long(), "stage 1, microbatch 0: loss_fn returned a tensor "
     "of dtype int64; it must return a floating-point scalar"),
    (lambda out, y: _mse(out, y).detach(), "stage 1, microbatch 0: loss_fn returned a tensor "
     "that does not depend on the output through autograd"),
    (lambda out, y: torch.tensor(_mse(out, y).item()), "does not depend on the output"),
])
def test_a_loss_that_cannot_be_backpropagated_is_named(loss_fn, says):
    pipe = po.Pipeline(_stages(), SCHEDULE, loss_fn)
    with pytest.raises(PipelineRuntimeError, match=re.escape(says)):
        pipe.step(X, target=Y)


def test_a_loss_without_parameters_to_train_is_not_an_error():
    stages = _stages()
    for module in stages.values():
        module.requires_grad_(False)
    loss = po.Pipeline(stages, SCHEDULE, _mse).step(X, target=Y)
    assert loss is not None and not loss.requires_grad


def test_a_tuple_into_a_one_argument_stage_names_both_stages():
    pipe = po.Pipeline({0: _Pair(), 1: nn.Linear(8, 8)}, SCHEDULE, _mse)
    with pytest.raises(PipelineRuntimeError) as caught:
        pipe.step(X, target=Y)
    text = str(caught.value)
    assert text.startswith("stage 1, microbatch 0: forward(float32 [2, 8], float32 [2, 8]): "
                           "its forward(input: torch.Tensor) -> torch.Tensor cannot take 2 "
                           "positional tensor(s); they are the outputs of stage 0"), text


@pytest.mark.parametrize("inputs,says", [
    (X.double(), "stage 0, microbatch 0: forward(float64 [2, 8]) failed on the microbatch of "
     "step()'s inputs (input 0 is float64, the stage's parameters are float32): RuntimeError"),
    (torch.randn(4, 7), "stage 0, microbatch 0: forward(float32 [2, 7]) failed on the "
     "microbatch of step()'s inputs: RuntimeError: mat1 and mat2 shapes cannot be multiplied "
     "(2x7 and 8x8)"),
])
def test_wrong_dtype_or_width_into_the_first_stage_is_named(inputs, says):
    pipe = po.Pipeline(_stages(), SCHEDULE, _mse)
    with pytest.raises(PipelineRuntimeError, match=re.escape(says)):
        pipe.step(inputs, target=Y)
    loss = pipe.step(X, target=Y)  # the failed step left nothing behind
    assert loss is not None and torch.isfinite(loss)
