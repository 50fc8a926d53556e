"""The runtime contract: what a step accepts, tied parameters, stats(), the offloader's keep=,
and the names exported from pipeoffload."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from test_runtime_support import (  # noqa: F401 - one_thread is a fixture
    one_thread,
    reference,
    token_batch,
    token_loss,
    transformer_stages,
)
from torch import nn

import pipeoffload
from pipeoffload.api import build_schedule
from pipeoffload.errors import ConfigError
from pipeoffload.runtime.config import OffloadConfig, RuntimeConfig
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.offloader import ActivationOffloader
from pipeoffload.runtime.pipeline import Pipeline


def test_runtime_names_are_exported_lazily():
    assert pipeoffload.RuntimeConfig is RuntimeConfig
    assert pipeoffload.OffloadConfig is OffloadConfig
    assert pipeoffload.ActivationMeter is ActivationMeter
    assert {"RuntimeConfig", "OffloadConfig", "ActivationMeter"} <= set(pipeoffload.__all__)


@pytest.mark.parametrize("inputs,target,message", [
    ("abc", None, "inputs is a str; pass a tensor, a tuple of tensors or a dict"),
    (3, None, "inputs is a int"),
    ({}, None, "inputs is an empty dict"),
    ({0: torch.zeros(8, 4)}, None, "inputs has key 0"),
    (None, 1.5, "target is a float; pass a tensor, a tuple of tensors \\(batch"),
    ([torch.zeros(8, 4, dtype=torch.long), "x"], None, "inputs\\[1\\] is a str"),
])
def test_wrong_inputs_name_what_is_wrong(inputs, target, message):
    schedule = build_schedule("1f1b", pp=2, microbatches=2)
    pipe = Pipeline(dict(enumerate(transformer_stages(2))), schedule, token_loss)
    ids, real_target = token_batch()
    with pytest.raises(ConfigError, match=message):
        pipe.step(ids if inputs is None else inputs,
                  target=real_target if target is None else target)


class Tied(nn.Module):
    """An embedding on the first stage or an output layer on the last, tied by declaration."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.weight = nn.Parameter(torch.randn(16, 8, dtype=torch.float64))
        self.first = first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            return nn.functional.embedding(x, self.weight)
        return (x @ self.weight.T).flatten(0, 1)


def test_tied_copies_get_the_summed_gradient_and_earlier_steps_are_kept():
    """Two distinct copies of one tied weight (as two ranks hold them), declared tied: after
    each step both hold the gradient of one shared weight; accumulating over two steps without
    zero_grad doubles it exactly once."""
    schedule = build_schedule("1f1b", pp=2, microbatches=4)
    ids, target = token_batch()
    shared = [Tied(True), Tied(False)]
    shared[1].weight = shared[0].weight
    _, expected = reference(shared, ids, target, 4)
    stages = {0: Tied(True), 1: Tied(False)}
    pipe = Pipeline(stages, schedule, token_loss, tied={"w": {0: "weight", 1: "weight"}})
    assert pipe.stats().tied == ("w",)
    pipe.step(ids, target=target)
    for module in stages.values():
        torch.testing.assert_close(module.weight.grad, expected[0][0], rtol=1e-12, atol=0)
    pipe.step(ids, target=target)
    for module in stages.values():
        torch.testing.assert_close(module.weight.grad, 2 * expected[0][0], rtol=1e-12, atol=0)


def test_undeclared_copies_are_not_summed_and_a_wrong_name_is_refused():
    schedule = build_schedule("1f1b", pp=2, microbatches=2)
    stages = {0: Tied(True), 1: Tied(False)}
    assert Pipeline(stages, schedule, token_loss).stats().tied == ()
    with pytest.raises(ConfigError, match="tie 'w': stage 1 has no parameter 'wieght'"):
        Pipeline(stages, schedule, token_loss, tied={"w": {0: "weight", 1: "wieght"}})


def test_stats_report_the_meter_and_the_offloader():
    schedule = build_schedule("po-f", pp=2, microbatches=4, offload_ratio=0.5)
    stages = transformer_stages(schedule.num_stages)
    meter = ActivationMeter()
    config = RuntimeConfig(offload=OffloadConfig(min_offload_elements=0))
    pipe = Pipeline(dict(enumerate(stages)), schedule, token_loss, config=config, meter=meter)
    ids, target = token_batch()
    pipe.step(ids, target=target)
    stats = pipe.stats()
    assert stats.peak_bytes == {r: meter.peak_bytes(r) for r in (0, 1)}
    assert all(b > 0 for b in stats.peak_bytes.values())
    assert sorted(stats.stage_bytes) == list(range(schedule.num_stages))
    assert stats.host_pool_bytes == pipe.offloader.host_pool_bytes > 0
    assert stats.fetched_bytes == 0
    assert stats.kept_bytes == pipe.offloader.kept_bytes


def test_offloader_keeps_what_it_is_told_to_and_views_of_parameters():
    weight = nn.Parameter(torch.randn(64, 64, dtype=torch.float64))
    offloader = ActivationOffloader(torch.device("cpu"), OffloadConfig(min_offload_elements=0),
                                    [])
    kept = torch.randn(32, 64, dtype=torch.float64, requires_grad=True)
    moved = torch.randn(32, 64, dtype=torch.float64, requires_grad=True)
    with offloader.scope("a", 0, keep=[kept]):
        view = weight.view(64, 64)  # like FSDP's unsharded parameter: a view made in the step
        out = (kept @ view).sum() + (moved * moved).sum()
    offloader.offload("a")
    # moved is saved (by mul) and copied to host; kept and the parameter view are not
    assert offloader.host_bytes("a") == moved.numel() * 8
    assert offloader.kept_bytes == {"kept by the caller": kept.numel() * 8,
                                    "parameter": weight.numel() * 8}
    offloader.reload("a")
    offloader.wait_reloaded("a")
    out.backward()
    offloader.discard("a")
    offloader.finish()
    assert torch.equal(moved.grad, 2 * moved.detach())


def test_markers_in_a_schedule_are_skipped_by_the_pipeline():
    from pipeoffload.core.actions import Action, Kind

    schedule = build_schedule("1f1b", pp=2, microbatches=2)
    marked = schedule.with_ranks([[Action(r, Kind.UNSHARD, None), *row,
                                   Action(r, Kind.REDUCE_GRAD, None)]
                                  for r, row in enumerate(schedule.ranks)])
    stages = transformer_stages(2)
    ids, target = token_batch()
    plain = copy.deepcopy(stages)
    Pipeline(dict(enumerate(stages)), marked, token_loss).step(ids, target=target)
    Pipeline(dict(enumerate(plain)), schedule, token_loss).step(ids, target=target)
    for a, b in zip(stages, plain):
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))
