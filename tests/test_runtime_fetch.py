"""FETCH (fetch on use): backward passes read offloaded activations from host as they use them.

Schedules with FETCH are made from planned offloaded ones by ``with_fetch`` (every RELOAD
replaced by a FETCH right before the first backward of its (stage, microbatch)), so these tests
do not depend on how the planner chooses between the two.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from patience import PATIENCE_S
from test_runtime_support import (
    launch,
    one_thread,  # noqa: F401 - autouse fixture
    part_index,
    token_batch,
    token_loss,
    transformer_stages,
)

from pipeoffload.api import build_schedule, plan_schedule
from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.schedule import Schedule
from pipeoffload.core.validate import validate
from pipeoffload.errors import PipelineRuntimeError
from pipeoffload.offload.plan import OffloadPolicy
from pipeoffload.runtime.config import OffloadConfig, RuntimeConfig
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.offloader import ActivationOffloader
from pipeoffload.runtime.pipeline import Pipeline
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.simulator import simulate

CPU = torch.device("cpu")
EVERYTHING = RuntimeConfig(offload=OffloadConfig(min_offload_elements=0))
CASES = {"1f1b": (2, 4), "zb-h1": (2, 4), "zbv": (2, 4), "po-f": (3, 6),  # name: (pp, m)
         "dualpipe": (2, 4), "dualpipev": (2, 4)}


def with_fetch(schedule: Schedule) -> Schedule:
    """``schedule`` with each RELOAD(s, m) dropped and FETCH(s, m) put right before the first
    backward (I or B) of (s, m) on its rank."""
    reloaded = {(a.stage, a.microbatch) for row in schedule.ranks for a in row
                if a.kind is Kind.RELOAD}
    rows = []
    for actions in schedule.ranks:
        row = []
        for action in actions:
            if action.kind is Kind.RELOAD:
                continue
            item = (action.stage, action.microbatch)
            if action.kind.is_backward and item in reloaded:
                row.append(Action(action.stage, Kind.FETCH, action.microbatch))
                reloaded.discard(item)
            row.append(action)
        rows.append(row)
    return validate(schedule.with_ranks(rows, name=schedule.name + "+fetch"))


def schedules(name: str) -> dict[str, Schedule]:
    """The same compute order without offload, with RELOAD and with FETCH."""
    pp, m = CASES[name]
    reloading = build_schedule(name, pp, m, offload="all")
    assert reloading.has_kind(Kind.RELOAD)
    fetching = with_fetch(reloading)
    assert fetching.has_kind(Kind.FETCH) and not fetching.has_kind(Kind.RELOAD)
    return {"keep": build_schedule(name, pp, m, offload="none"), "reload": reloading,
            "fetch": fetching}


def run(sched: Schedule, meter: ActivationMeter | None = None,
        config: RuntimeConfig = EVERYTHING):
    """One float64 step in local mode: (loss, every parameter gradient, the offloader)."""
    stages = transformer_stages(len(sched.route_of(0)), torch.float64)
    ids, target = token_batch(batch=2 * sched.microbatches)
    modules = {s: stages[part_index(sched, s)] for s in range(sched.num_stages)}
    pipe = Pipeline(modules, sched, token_loss, config=config, meter=meter)
    loss = pipe.step(ids, target=target)
    return loss, [p.grad for s in stages for p in s.parameters()], pipe.offloader


def measured_and_simulated(sched: Schedule) -> tuple[tuple[int, ...], tuple[int, ...]]:
    meter = ActivationMeter()
    run(sched, meter)
    sizes = meter.stage_activation_bytes(sched.num_stages)
    assert all(size > 0 for size in sizes)
    assert all(meter.resident_bytes(r) == 0 for r in range(sched.num_ranks))
    predicted = simulate(sched, CostModel(stage_activation_bytes=sizes)).peak_bytes
    return tuple(meter.peak_bytes(r) for r in range(sched.num_ranks)), predicted


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zbv", "po-f", "dualpipe", "dualpipev"])
def test_fetch_gives_bitwise_the_losses_and_gradients_of_no_offload(name: str) -> None:
    plans = schedules(name)
    kept_loss, kept_grads, _ = run(plans["keep"])
    loss, grads, offloader = run(plans["fetch"])
    assert torch.equal(loss, kept_loss)
    assert len(grads) == len(kept_grads)
    assert all(g is not None and torch.equal(g, k) for g, k in zip(grads, kept_grads))
    assert offloader is not None and offloader.fetched_bytes > 0


def test_the_planners_fetch_plan_runs_bitwise_with_the_simulators_peaks() -> None:
    """End to end: what ``OffloadPolicy(fetch_on_use=True)`` plans is what the runtime runs."""
    plan = plan_schedule("po-f", 3, 6, policy=OffloadPolicy(fetch_on_use=True))
    assert plan.schedule.has_kind(Kind.FETCH)
    kept_loss, kept_grads, _ = run(schedules("po-f")["keep"])
    loss, grads, _ = run(plan.schedule)
    assert torch.equal(loss, kept_loss)
    assert all(torch.equal(g, k) for g, k in zip(grads, kept_grads))
    measured, predicted = measured_and_simulated(plan.schedule)
    assert measured == predicted


def test_fetch_after_copies_started_at_the_offload_action_is_bitwise_too() -> None:
    plans = schedules("zbv")
    at_offload = RuntimeConfig(offload=OffloadConfig(min_offload_elements=0, stream=False))
    kept_loss, kept_grads, _ = run(plans["keep"])
    loss, grads, _ = run(plans["fetch"], config=at_offload)
    assert torch.equal(loss, kept_loss)
    assert all(torch.equal(g, k) for g, k in zip(grads, kept_grads))


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zbv", "po-f", "dualpipe", "dualpipev"])
def test_measured_peaks_with_fetch_equal_the_simulator(name: str) -> None:
    measured, predicted = measured_and_simulated(schedules(name)["fetch"])
    assert measured == predicted


@pytest.mark.parametrize("name", ["zbv", "po-f"])
def test_fetch_peaks_below_reload(name: str) -> None:
    """A reloaded activation is held whole from its RELOAD to the end of its W; a fetched one
    never is. Where every stage of a rank is offloaded, nothing is left to set its peak."""
    plans = schedules(name)
    reload_peaks, _ = measured_and_simulated(plans["reload"])
    fetch_peaks, _ = measured_and_simulated(plans["fetch"])
    assert all(f <= r for f, r in zip(fetch_peaks, reload_peaks))
    assert sum(fetch_peaks) < sum(reload_peaks)
    fetching = plans["fetch"]
    offloaded = {a.stage for row in fetching.ranks for a in row if a.kind is Kind.OFFLOAD}
    all_out = [r for r in range(fetching.num_ranks)
               if set(fetching.stages_on_rank(r)) <= offloaded]
    assert all_out, "the planner offloaded every stage of no rank; pick another case"
    assert all(fetch_peaks[r] == 0 < reload_peaks[r] for r in all_out)


def test_fetch_needs_a_forward_and_an_offload_before_it() -> None:
    offloader = ActivationOffloader(CPU, OffloadConfig(min_offload_elements=0), [])
    with pytest.raises(PipelineRuntimeError, match=r"FETCH of \(1, 2\): no forward of it"):
        offloader.fetch_on_use((1, 2))
    x = torch.randn(8, 8, requires_grad=True)
    with offloader.scope((1, 2), owner=0):
        y = torch.tanh(x)
    with pytest.raises(PipelineRuntimeError, match=r"FETCH of \(1, 2\) without an OFFLOAD"):
        offloader.fetch_on_use((1, 2))
    offloader.offload((1, 2))
    offloader.fetch_on_use((1, 2))
    with pytest.raises(PipelineRuntimeError, match="already fetched"):
        offloader.fetch_on_use((1, 2))
    with pytest.raises(PipelineRuntimeError, match=r"RELOAD of \(1, 2\) after its FETCH"):
        offloader.reload((1, 2))
    y.sum().backward()
    assert torch.equal(x.grad, torch.autograd.grad(torch.tanh(x).sum(), x)[0])
    offloader.discard((1, 2))
    offloader.finish()


def test_a_backward_reading_the_host_without_reload_or_fetch_raises() -> None:
    offloader = ActivationOffloader(CPU, OffloadConfig(min_offload_elements=0), [])
    x = torch.randn(8, 8, requires_grad=True)
    with offloader.scope((3, 5), owner=0):
        y = torch.tanh(x)
    offloader.offload((3, 5))
    with pytest.raises(PipelineRuntimeError,
                       match=r"\(3, 5\) is on the host.*must RELOAD or FETCH it before its I or B"):
        y.sum().backward()


def test_fetch_without_offload_in_a_pipeline_raises() -> None:
    """A schedule the validator would reject (FETCH with no OFFLOAD) still fails clearly if it
    reaches the executor: the FETCH finds no offload scope."""
    from pipeoffload.runtime.executor import RankExecutor, StepData
    from pipeoffload.runtime.p2p import LocalTransport

    sched = build_schedule("1f1b", 1, 1)
    offloader = ActivationOffloader(CPU, OffloadConfig(), [])
    executor = RankExecutor(0, sched, {}, LocalTransport(), offloader, None, True)
    with pytest.raises(PipelineRuntimeError, match=r"FETCH of \(0, 0\): no forward of it"):
        executor.run(Action(0, Kind.FETCH, 0), StepData([], []))


class FusedQKV(torch.autograd.Function):
    """Saves three views of one storage (q, k, v of a fused projection), as attention does."""

    @staticmethod
    def forward(ctx, qkv):  # type: ignore[override]
        q, k, v = qkv.chunk(3, dim=-1)
        ctx.save_for_backward(q, k, v)
        return q * k * v

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v = ctx.saved_tensors
        assert q.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        return torch.cat([grad * k * v, grad * q * v, grad * q * k], dim=-1)


def test_views_of_one_storage_are_fetched_once_per_pass() -> None:
    offloader = ActivationOffloader(CPU, OffloadConfig(min_offload_elements=0), [])
    weight = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 6, dtype=torch.float64)
    with offloader.scope("k", owner=0):
        out = FusedQKV.apply(x.exp() @ weight.repeat(1, 3)).sum()
    one = 4 * 18 * 8  # the fused q, k, v storage, float64
    stored = offloader.host_bytes("k")
    offloader.offload("k")
    offloader.fetch_on_use("k")
    assert offloader.device_bytes("k") == 0
    (first,) = torch.autograd.grad(out, weight, retain_graph=True)
    per_pass = offloader.fetched_bytes
    # FusedQKV reads the q, k, v storage once, the matmul its saved input x.exp() once.
    assert per_pass == one + 4 * 6 * 8
    assert stored == per_pass
    (second,) = torch.autograd.grad(out, weight)
    assert offloader.fetched_bytes == 2 * per_pass  # a second pass (a W) reads again
    offloader.discard("k")
    offloader.finish()
    plain = torch.autograd.grad(FusedQKV.apply(x.exp() @ weight.repeat(1, 3)).sum(), weight)[0]
    assert torch.equal(first, plain) and torch.equal(second, plain)


def _fetch_po_f(rank: int, world: int) -> tuple[bool, bool]:
    """po-f with FETCH over gloo: (gradients equal to no offload, loss equal) on this rank."""
    results = []
    for key in ("keep", "fetch"):
        sched = schedules("po-f")[key]
        stages = transformer_stages(sched.num_stages, torch.float64)
        mine = {s: stages[s] for s in sched.stages_on_rank(rank)}
        ids, target = token_batch(batch=2 * sched.microbatches)
        config = RuntimeConfig(p2p_timeout_s=PATIENCE_S,
                               offload=OffloadConfig(min_offload_elements=0))
        loss = Pipeline(mine, sched, token_loss, config=config).step(ids, target=target)
        results.append((loss, [p.grad for s in mine.values() for p in s.parameters()]))
    (kept_loss, kept), (loss, grads) = results
    same_loss = (loss is None and kept_loss is None) or torch.equal(loss, kept_loss)
    same_grads = len(grads) == len(kept) and all(torch.equal(a, b) for a, b in zip(grads, kept))
    return same_grads, same_loss


@pytest.mark.slow
def test_gloo_fetch_gives_bitwise_gradients(tmp_path) -> None:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    results = launch(_fetch_po_f, 3, tmp_path)
    assert sorted(results) == [0, 1, 2], results
    for rank, outcome in results.items():
        assert "ok" in outcome, outcome.get("trace")
        assert outcome["ok"] == (True, True), rank


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fetch_is_bitwise_and_reuses_pinned_buffers() -> None:
    device = torch.device("cuda")
    plans = schedules("zbv")
    grads = []
    for key in ("keep", "fetch"):
        stages = [s.to(device) for s in transformer_stages(4, torch.float32)]
        pipe = Pipeline(dict(enumerate(stages)), plans[key], token_loss, config=EVERYTHING)
        ids, target = token_batch()
        for step in range(2):
            for stage in stages:
                stage.zero_grad(set_to_none=True)
            pipe.step(ids.to(device), target=target.to(device))
            if key == "fetch" and step == 0:
                pooled = pipe.offloader.host_pool_bytes
        if key == "fetch":
            # Whether a read found its storage still on the device depends on timing, so the
            # fetched bytes are not compared; the host pool must be reused whatever the timing.
            assert pipe.offloader.host_pool_bytes == pooled
        torch.cuda.synchronize()
        grads.append([p.grad.cpu() for s in stages for p in s.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
