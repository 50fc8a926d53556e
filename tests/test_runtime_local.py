"""Local mode: one process runs every rank of a schedule; results against plain autograd."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from test_runtime_support import (
    max_relative_error,
    one_thread,  # noqa: F401 - autouse fixture
    part_index,
    reference,
    token_batch,
    token_loss,
    transformer_stages,
    with_offload,
)

from pipeoffload.core.actions import Kind
from pipeoffload.core.registry import FAMILIES, build_schedule
from pipeoffload.errors import ConfigError, PipelineRuntimeError
from pipeoffload.runtime.config import OffloadConfig, RuntimeConfig
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.pipeline import Pipeline

MICROBATCHES = 4
OPTIONS = {"interleaved-1f1b": {"chunks": 2}, "grouped-interleaved": {"chunks": 2, "group_size": 2}}


BACK = {"reload": Kind.RELOAD, "fetch": Kind.FETCH}


def schedule(name: str, pp: int = 2, microbatches: int = MICROBATCHES,
             offload: bool | str = False):
    """``offload``: False, True (RELOAD), or "reload" / "fetch" (how activations come back)."""
    built = build_schedule(name, pp=pp, microbatches=microbatches, **OPTIONS.get(name, {}))
    if not offload:
        return built
    return with_offload(built, back=BACK["reload" if offload is True else offload])


def run(sched, dtype=torch.float64, config=None, meter=None, steps=1):
    """Run ``sched``; returns the model parts (DualPipe's twin stages share one module, so
    their gradients add up in it, as autograd's do), the loss, and the batch."""
    stages = transformer_stages(len(sched.route_of(0)), dtype)
    ids, target = token_batch()
    modules = {s: stages[part_index(sched, s)] for s in range(sched.num_stages)}
    pipe = Pipeline(modules, sched, token_loss, config=config, meter=meter)
    for _ in range(steps):
        loss = pipe.step(ids, target=target)
    return stages, loss, ids, target


@pytest.mark.parametrize("offload", [False, "reload", "fetch"], ids=["keep", "reload", "fetch"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_loss_and_gradients_equal_autograd_float64(name: str, offload: bool | str) -> None:
    sched = schedule(name, offload=offload)
    stages, loss, ids, target = run(sched)
    ref_loss, ref_grads = reference(stages, ids, target, MICROBATCHES)
    assert abs(loss.item() - ref_loss.item()) <= 1e-12 * abs(ref_loss.item())
    assert max_relative_error(stages, ref_grads) <= 1e-12


@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_float32_gradients_within_1e_5(name: str) -> None:
    stages, loss, ids, target = run(schedule(name, offload=True), dtype=torch.float32)
    ref_loss, ref_grads = reference(stages, ids, target, MICROBATCHES)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    assert max_relative_error(stages, ref_grads) <= 1e-5


def test_two_steps_accumulate_like_autograd() -> None:
    stages, _, ids, target = run(schedule("zb-h1"), steps=2)
    _, ref_grads = reference(stages, ids, target, MICROBATCHES)
    doubled = [[2 * g for g in grads] for grads in ref_grads]
    assert max_relative_error(stages, doubled) <= 1e-12


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "at-offload"])
@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zbv", "v-min"])
def test_offload_gives_bitwise_identical_gradients(name: str, stream: bool) -> None:
    grads = []
    config = RuntimeConfig(offload=OffloadConfig(min_offload_elements=0, stream=stream))
    for offload in (False, "reload", "fetch"):
        stages, _, _, _ = run(schedule(name, offload=offload), dtype=torch.float32, config=config)
        grads.append([p.grad for s in stages for p in s.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[2]))


@pytest.mark.parametrize("offload", [False, "reload", "fetch"], ids=["keep", "reload", "fetch"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_measured_peaks_equal_simulator(name: str, offload: bool | str) -> None:
    simulator = pytest.importorskip(
        "pipeoffload.sim.simulator", reason="pipeoffload.sim.simulator is not written yet")
    from pipeoffload.sim.costs import CostModel

    sched = schedule(name, offload=offload)
    meter = ActivationMeter()
    config = RuntimeConfig(offload=OffloadConfig(min_offload_elements=0))
    run(sched, config=config, meter=meter)
    sizes = meter.stage_activation_bytes(sched.num_stages)
    assert all(size > 0 for size in sizes)
    result = simulator.simulate(sched, CostModel(stage_activation_bytes=sizes))
    measured = tuple(meter.peak_bytes(r) for r in range(sched.num_ranks))
    assert measured == result.peak_bytes
    assert all(meter.resident_bytes(r) == 0 for r in range(sched.num_ranks))


def test_offload_lowers_measured_peak_and_keeps_tiny_tensors() -> None:
    peaks = []
    for offload, smallest in ((False, 0), (True, 0), (True, 1024)):
        meter = ActivationMeter()
        config = RuntimeConfig(offload=OffloadConfig(min_offload_elements=smallest))
        run(schedule("gpipe", offload=offload), meter=meter, config=config)
        peaks.append(meter.peaks)
    assert all(peaks[1][r] < peaks[0][r] for r in peaks[0])
    # Every saved tensor of this small model has <= 1024 elements, so none moves by default.
    assert peaks[2] == peaks[0]


def test_meter_observes_a_plain_autograd_step() -> None:
    stages = transformer_stages(2)
    ids, target = token_batch()
    meter = ActivationMeter()
    meter.exclude(p for s in stages for p in s.parameters())
    with meter.observe(owner=0):
        loss = token_loss(stages[1](stages[0](ids)), target)
    during = meter.resident_bytes(0)
    loss.backward()
    assert during > 0 and meter.peak_bytes(0) == during and meter.resident_bytes(0) == 0


def test_batch_not_divisible_raises_before_compute() -> None:
    sched = schedule("1f1b")
    stages = transformer_stages(2)
    ids, target = token_batch(batch=6)
    pipe = Pipeline(dict(enumerate(stages)), sched, token_loss)
    with pytest.raises(ConfigError, match="4 microbatches do not divide"):
        pipe.step(ids, target=target)
    assert all(p.grad is None for s in stages for p in s.parameters())


def test_changed_input_shape_raises_before_compute() -> None:
    sched = schedule("1f1b")
    stages = transformer_stages(2)
    ids, target = token_batch()
    pipe = Pipeline(dict(enumerate(stages)), sched, token_loss)
    pipe.step(ids, target=target)
    before = [p.grad.clone() for s in stages for p in s.parameters()]
    calls = []
    stages[0].register_forward_pre_hook(lambda *_: calls.append(1))
    wider_ids, wider_target = token_batch(seq=6)
    with pytest.raises(ConfigError, match="set up for"):
        pipe.step(wider_ids, target=wider_target)
    assert not calls
    assert all(torch.equal(a, p.grad) for a, p in zip(before, (p for s in stages
                                                               for p in s.parameters())))


def test_example_inputs_check_the_first_step() -> None:
    stages = transformer_stages(2)
    ids, target = token_batch()
    pipe = Pipeline(dict(enumerate(stages)), schedule("1f1b"), token_loss,
                    example_inputs=torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(ConfigError, match=r"\[2, 4\] int64.*set up for \(\[2, 5\] int64\)"):
        pipe.step(ids, target=target)


def test_stages_not_matching_placement_raise() -> None:
    stages = transformer_stages(4)
    with pytest.raises(ConfigError, match=r"needs exactly stages \[0, 1, 2, 3\]"):
        Pipeline({0: stages[0], 1: stages[1]}, schedule("zbv"), token_loss)


@pytest.mark.parametrize("name", ["1f1b", "zbv", "grouped-interleaved"])
def test_recompute_gives_bitwise_identical_gradients_and_matches_the_simulator(name) -> None:
    from pipeoffload.offload.recompute import add_recompute
    from pipeoffload.sim.costs import CostModel
    from pipeoffload.sim.simulator import simulate

    plain = schedule(name)
    recomputed = add_recompute(plain, target="chunks:1").schedule
    assert recomputed.has_kind(Kind.RECOMPUTE)
    grads = []
    for sched in (plain, recomputed):
        meter = ActivationMeter()
        stages, loss, ids, target = run(sched, dtype=torch.float32, meter=meter)
        grads.append([p.grad for s in stages for p in s.parameters()])
        sizes = meter.stage_activation_bytes(sched.num_stages)
        predicted = simulate(sched, CostModel(stage_activation_bytes=sizes)).peak_bytes
        assert tuple(meter.peaks[r] for r in range(sched.num_ranks)) == predicted
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_recompute_replays_the_random_numbers_of_its_forward() -> None:
    from pipeoffload.offload.recompute import add_recompute

    torch.manual_seed(0)
    dropout = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
    head = torch.nn.Linear(8, 1)
    data = torch.randn(4, 8)

    def loss_fn(out, target):
        return ((out - target) ** 2).mean()

    grads = []
    for recompute in (False, True):
        sched = build_schedule("1f1b", pp=2, microbatches=2)
        if recompute:
            sched = add_recompute(sched, target="all").schedule
        for module in (dropout, head):
            module.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        Pipeline({0: dropout, 1: head}, sched, loss_fn).step(data, target=torch.zeros(4, 1))
        grads.append([p.grad.clone() for m in (dropout, head) for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("name", ["po-h", "po-f"])
def test_planned_presets_equal_autograd_and_the_simulator(name: str) -> None:
    """The planner's own output (OFFLOAD_WAIT included, at k = 1) runs exactly."""
    from pipeoffload.api import plan_schedule
    from pipeoffload.sim.costs import CostModel
    from pipeoffload.sim.simulator import simulate

    sched = plan_schedule(name, 6, 12, offload_ratio=0.5).schedule
    if name == "po-f":
        assert sched.has_kind(Kind.OFFLOAD_WAIT), "po-f at k = 1 postpones warm-up forwards"
    config = RuntimeConfig(offload=OffloadConfig(min_offload_elements=0))
    stages = transformer_stages(sched.num_stages, torch.float64)
    ids, target = token_batch(batch=12)
    meter = ActivationMeter()
    loss = Pipeline(dict(enumerate(stages)), sched, token_loss, config=config,
                    meter=meter).step(ids, target=target)
    ref_loss, ref_grads = reference(stages, ids, target, 12)
    assert abs(loss.item() - ref_loss.item()) <= 1e-12 * abs(ref_loss.item())
    assert max_relative_error(stages, ref_grads) <= 1e-12
    sizes = meter.stage_activation_bytes(sched.num_stages)
    predicted = simulate(sched, CostModel(stage_activation_bytes=sizes)).peak_bytes
    assert tuple(meter.peaks[r] for r in range(sched.num_ranks)) == predicted


def test_a_failed_step_leaves_the_pipeline_usable() -> None:
    stages = transformer_stages(2)
    ids, target = token_batch()
    calls = []

    def flaky_loss(logits, labels):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("flaky")
        return token_loss(logits, labels)

    pipe = Pipeline(dict(enumerate(stages)), schedule("zb-h1", offload=True), flaky_loss)
    with pytest.raises(PipelineRuntimeError, match="flaky"):
        pipe.step(ids, target=target)
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    loss = pipe.step(ids, target=target)
    ref_loss, ref_grads = reference(stages, ids, target, MICROBATCHES)
    assert abs(loss.item() - ref_loss.item()) <= 1e-12 * ref_loss.item()
    assert max_relative_error(stages, ref_grads) <= 1e-12


def test_loss_must_be_scalar() -> None:
    stages = transformer_stages(2)
    ids, target = token_batch()
    pipe = Pipeline(dict(enumerate(stages)), schedule("gpipe"),
                    lambda out, t: torch.nn.functional.cross_entropy(out, t.flatten(),
                                                                     reduction="none"))
    with pytest.raises(PipelineRuntimeError, match="must return a scalar"):
        pipe.step(ids, target=target)
