"""The host pool (runtime/pool.py Note: [host pool]): reserved from the plan before the first
step and never allocating inside one; bounded when shapes change; a dropped Pipeline frees its
buffers at once; stats that describe the last step, not a sum over steps."""

from __future__ import annotations

import gc
import random
import warnings
import weakref

import pytest
import torch
from test_runtime_support import (
    one_thread,  # noqa: F401 - autouse fixture
    token_batch,
    token_loss,
    transformer_stages,
)
from torch import nn

from pipeoffload.api import build_schedule
from pipeoffload.runtime.config import OffloadConfig, RuntimeConfig
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.offloader import ActivationOffloader
from pipeoffload.runtime.pipeline import Pipeline
from pipeoffload.runtime.pool import HostBufferPool, plan_need

EVERYTHING = RuntimeConfig(offload=OffloadConfig(min_offload_elements=0))


def _measured_sizes(sched, stages, ids, target) -> dict[int, int]:
    meter = ActivationMeter()
    Pipeline(dict(enumerate(stages)), sched, token_loss, config=EVERYTHING,
             meter=meter).step(ids, target=target)
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    return dict(enumerate(meter.stage_activation_bytes(sched.num_stages)))


@pytest.mark.parametrize(("name", "pp"), [("po-f", 4), ("zbv", 2), ("1f1b", 2),
                                          ("interleaved-1f1b", 2), ("dualpipev", 2)])
def test_a_reserved_pool_allocates_nothing_inside_a_step(name: str, pp: int) -> None:
    """Reserved from the plan's sizes before the first step, the pool of a strict (NCCL)
    pipeline never allocates during three steps; its plan matches what the steps used."""
    sched = build_schedule(name, pp=pp, microbatches=2 * pp, offload="all")
    stages = transformer_stages(sched.num_stages, torch.float32)
    ids, target = token_batch(batch=2 * pp)
    sizes = _measured_sizes(sched, stages, ids, target)
    pipe = Pipeline(dict(enumerate(stages)), sched, token_loss, config=EVERYTHING)
    pool = pipe.offloader.host_pool
    pool._strict = True  # what Pipeline does on NCCL
    need = pipe.reserve_host_memory(sizes)
    assert need == plan_need(pipe._order, sizes) > 0
    assert pool.allocations == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the strict pool warns when it allocates in a step
        for _ in range(3):
            for stage in stages:
                stage.zero_grad(set_to_none=True)
            pipe.step(ids, target=target)
    assert pool.allocations == 1
    stats = pipe.stats()
    assert need <= stats.host_pool_need_bytes <= 1.01 * need  # 64-byte block alignment
    assert stats.host_pool_bytes <= 1.5 * stats.host_pool_need_bytes


def test_a_strict_pool_warns_when_the_reservation_is_too_small() -> None:
    pool = HostBufferPool(pin_memory=False, strict=True)
    pool.reserve(1000)
    held = pool.take(900)
    with pytest.warns(UserWarning, match="inside a step.*reserve more"):
        pool.take(900)
    pool.give_back(held)


def test_reserve_needs_every_offloaded_stage() -> None:
    sched = build_schedule("po-f", pp=2, microbatches=4, offload_ratio=0.5)
    pipe = Pipeline(dict(enumerate(transformer_stages(sched.num_stages))), sched, token_loss)
    with pytest.raises(Exception, match=r"no activation bytes for offloaded stages \[1, 2"):
        pipe.reserve_host_memory({0: 100, 3: 100})


def _offloaded_steps(pattern: str,
                     steps: int = 200) -> tuple[HostBufferPool, list[float], int]:
    """Steps of two stages x three microbatches whose sequence length rises 8 -> 256 or is drawn
    at random; half the activations come back by RELOAD, half by FETCH. Returns the pool, after
    each step its bytes over the largest need so far, and the largest need of the run."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(2)]
    offloader = ActivationOffloader(torch.device("cpu"), OffloadConfig(min_offload_elements=0),
                                    [p for b in blocks for p in b.parameters()])
    rng = random.Random(0)
    ratios, largest = [], 0
    for step in range(steps):
        seq = 8 + (248 * step) // (steps - 1) if pattern == "rising" else rng.randint(8, 256)
        outputs = {}
        for mb in range(3):
            x = torch.randn(1, seq, 8, requires_grad=True)
            for stage, block in enumerate(blocks):
                with offloader.scope((stage, mb), 0):
                    x = block(x)
                offloader.offload((stage, mb))
            outputs[mb] = x
            if mb:  # one forward ahead, like 1F1B
                _backward(offloader, outputs.pop(mb - 1), mb - 1)
        _backward(offloader, outputs.pop(2), 2)
        offloader.finish()
        largest = max(largest, offloader.host_pool_need_bytes)
        ratios.append(offloader.host_pool_bytes / largest)
    return offloader.host_pool, ratios, largest


def _backward(offloader: ActivationOffloader, output: torch.Tensor, mb: int) -> None:
    offloader.reload((1, mb))
    offloader.fetch_on_use((0, mb))
    output.sum().backward()
    offloader.discard((1, mb))
    offloader.discard((0, mb))


@pytest.mark.parametrize("pattern", ["rising", "random"])
def test_the_pool_stays_bounded_when_shapes_change(pattern: str) -> None:
    """Issue 25.7: 200 steps of rising or random lengths grew the pool to 82x (2.4x) the
    largest step's need; now it stays within 1.5x, inside steps and after them."""
    pool, ratios, largest = _offloaded_steps(pattern)
    assert max(ratios) <= 1.5, max(ratios)
    assert pool.peak_bytes <= 1.5 * largest  # also in the middle of a step
    assert pool.allocations < 100  # rebuilt when shapes change, not on every request


def test_a_dropped_pipeline_frees_its_host_buffers_without_a_collection() -> None:
    """Rebuilding a Pipeline per shape grew RSS: executors and the offloader's copy queue held
    reference cycles, so a dropped Pipeline (with its host buffers) lived until the cyclic
    garbage collector ran. Without cycles it goes as soon as it is dropped."""
    sched = build_schedule("po-f", pp=2, microbatches=4, offload_ratio=0.5)
    stages = transformer_stages(sched.num_stages)
    ids, target = token_batch()
    gc.collect()
    gc.disable()
    try:
        pipe = Pipeline(dict(enumerate(stages)), sched, token_loss, config=EVERYTHING)
        pipe.step(ids, target=target)
        pool = weakref.ref(pipe.offloader.host_pool)
        offloader = weakref.ref(pipe.offloader)
        assert pool() is not None and pool().allocated_bytes > 0
        del pipe
        assert pool() is None and offloader() is None
    finally:
        gc.enable()


def test_stats_describe_the_last_step_and_do_not_grow() -> None:
    """Issue 25.12: stage_bytes and kept_bytes grew every step (1.13 -> 2.27 -> 3.40 MB)."""
    sched = build_schedule("po-f", pp=2, microbatches=4, offload_ratio=0.5)
    stages = transformer_stages(sched.num_stages)
    ids, target = token_batch()
    meter = ActivationMeter()
    pipe = Pipeline(dict(enumerate(stages)), sched, token_loss, meter=meter,
                    config=RuntimeConfig(offload=OffloadConfig(min_offload_elements=64)))
    seen = []
    for _ in range(4):
        for stage in stages:
            stage.zero_grad(set_to_none=True)
        pipe.step(ids, target=target)
        stats = pipe.stats()
        seen.append((stats.stage_bytes, stats.kept_bytes, stats.host_pool_bytes,
                     stats.host_pool_need_bytes))
    assert seen[0][1]["small"] > 0 and all(b > 0 for b in seen[0][0].values())
    assert seen == [seen[0]] * 4
    assert seen[0][0] == dict(enumerate(meter.stage_activation_bytes(sched.num_stages)))


def test_train_reserves_the_host_pool_before_the_first_step(monkeypatch) -> None:
    """`train` sizes the pool from one microbatch per stage before step 1: no host allocation
    happens inside a step (what NCCL needs), and the steps fit what was reserved."""
    from pipeoffload.parallel.topology import Topology
    from pipeoffload.runtime import pool as pool_module
    from pipeoffload.training.data import DataConfig
    from pipeoffload.training.model_config import model_preset
    from pipeoffload.training.train import TrainConfig
    from pipeoffload.training.trainer import train

    inside, allocations = [False], []
    real_step, real_allocate = Pipeline.step, pool_module.HostMemory.allocate

    def step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        inside[0] = True
        try:
            return real_step(self, *args, **kwargs)
        finally:
            inside[0] = False

    def allocate(self, nbytes: int) -> torch.Tensor:
        allocations.append((inside[0], nbytes))
        return real_allocate(self, nbytes)

    monkeypatch.setattr(Pipeline, "step", step)
    monkeypatch.setattr(pool_module.HostMemory, "allocate", allocate)
    config = TrainConfig(model=model_preset("tiny"),
                         data=DataConfig(seq_len=32, batch_size=8, max_bytes=1 << 16),
                         pp=2, schedule="po-f", steps=3, measure_baseline=False)
    train(config, Topology.local(config.pp))
    assert allocations and not any(during for during, _ in allocations)
