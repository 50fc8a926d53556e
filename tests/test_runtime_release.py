"""What only a GPU would show, modelled on CPU: copies to host that finish late keep device
memory until released in stream order (offloader.py Note: [release order]); saved tensors
kept on the device create no reference cycle; autocast's weight casts stay; the host pool
reuses ready buffers; recomputation draws from the pipeline's device RNG."""

from __future__ import annotations

import gc
import weakref
from functools import partial

import pytest
import torch
from test_runtime_support import token_batch, token_loss, transformer_stages, with_offload
from torch import nn

from pipeoffload.api import build_schedule
from pipeoffload.core.actions import Action, Kind
from pipeoffload.runtime import pipeline as pipeline_module
from pipeoffload.runtime.config import OffloadConfig, RuntimeConfig
from pipeoffload.runtime.executor import RankExecutor, StepData
from pipeoffload.runtime.lowering import with_comms
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.offloader import ActivationOffloader
from pipeoffload.runtime.p2p import LocalTransport
from pipeoffload.runtime.pool import HostBufferPool
from pipeoffload.runtime.stage import RngState, StageRunner
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.simulator import simulate


class Event:
    def __init__(self, done: bool = False) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        """The host waits until the copy has run (a fake GPU then has run it)."""
        self.done = True


class SlowCopies:
    """Copies that take effect at once (so values are right) but whose events complete only
    when ``complete`` says so: a GPU whose copy stream lags far behind the host."""

    synchronous = False

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.compute_waits: list[Event] = []
        self.retired: list[int] = []

    def copy_out(self, pairs) -> Event:
        for host, device in pairs:
            host.copy_(device)
        self.events.append(Event())
        return self.events[-1]

    def done(self, event: Event) -> bool:
        return event.done

    def compute_wait(self, event: Event) -> None:
        self.compute_waits.append(event)

    def retire(self, tensor: torch.Tensor) -> None:
        self.retired.append(tensor.untyped_storage().nbytes())


def _run(sched, monkeypatch, copies=None, cap=None, meter=None, auto=None):
    if copies is not None:
        monkeypatch.setattr(pipeline_module, "ActivationOffloader",
                            partial(ActivationOffloader, copies=copies))
    stages = transformer_stages(sched.num_stages)
    ids, target = token_batch()
    config = RuntimeConfig(offload=OffloadConfig(min_offload_elements=0,
                                                 max_pending_copy_bytes=cap,
                                                 pending_copy_activations=auto))
    pipe = pipeline_module.Pipeline(dict(enumerate(stages)), sched, token_loss, config=config,
                                    meter=meter)
    pipe.step(ids, target=target)
    return pipe, [p.grad.clone() for s in stages for p in s.parameters()]


def test_late_copies_keep_memory_and_the_cap_releases_it_in_stream_order(monkeypatch) -> None:
    sched = with_offload(build_schedule("1f1b", pp=2, microbatches=4))
    peaks, grads, offloaders, engines = [], [], [], []
    for cap in (None, 0, 4096):
        engine = SlowCopies()
        meter = ActivationMeter()
        pipe, g = _run(sched, monkeypatch, engine, cap, meter)
        peaks.append(tuple(meter.peak_bytes(r) for r in range(2)))
        grads.append(g)
        offloaders.append(pipe.offloader)
        engines.append(engine)
    sizes = meter.stage_activation_bytes(sched.num_stages)
    planned = simulate(sched, CostModel(stage_activation_bytes=sizes)).peak_bytes
    unoffloaded = simulate(sched.without(Kind.OFFLOAD, Kind.RELOAD),
                           CostModel(stage_activation_bytes=sizes)).peak_bytes
    # No copy is ever seen complete: without a cap (host-time release only,
    # pending_copy_activations=None) nothing offloaded leaves the device.
    assert peaks[0] == unoffloaded and peaks[0] > planned
    assert engines[0].compute_waits == []
    assert engines[0].retired  # freed by the backward while its copy may still read it
    # Cap 0: the compute stream waits for each copy, its memory goes at once: the plan's peak.
    assert peaks[1] == planned
    assert len(engines[1].compute_waits) == len(engines[1].events)
    assert offloaders[1].max_pending_bytes_seen == 0
    # A cap in between: never more than the cap waits, and the peak lies between the two.
    assert 0 < offloaders[2].max_pending_bytes_seen <= 4096
    assert all(p <= q for p, q in zip(planned, peaks[2]))
    assert all(p <= q for p, q in zip(peaks[2], peaks[0]))
    assert 0 < len(engines[2].compute_waits) < len(engines[2].events)
    assert all(torch.equal(a, b) for g in grads[1:] for a, b in zip(grads[0], g))


def test_by_default_at_most_one_activation_waits_for_its_copy(monkeypatch) -> None:
    """The default (OffloadConfig.pending_copy_activations=1): with copies that never finish
    on their own, memory is released in stream order once more than the largest activation
    waits, so the peak stays within one activation of the plan, gradients unchanged."""
    sched = with_offload(build_schedule("1f1b", pp=2, microbatches=4))
    meter, engine = ActivationMeter(), SlowCopies()
    pipe, grads = _run(sched, monkeypatch, engine, meter=meter, auto=1.0)
    _, host_timed = _run(sched, monkeypatch, SlowCopies(), meter=ActivationMeter())
    sizes = meter.stage_activation_bytes(sched.num_stages)
    planned = simulate(sched, CostModel(stage_activation_bytes=sizes)).peak_bytes
    largest = max(sizes)
    assert 0 < pipe.offloader.max_pending_bytes_seen <= largest
    assert engine.compute_waits
    assert all(meter.peak_bytes(r) <= planned[r] + largest for r in range(2))
    assert all(torch.equal(a, b) for a, b in zip(grads, host_timed))


def test_poll_releases_completed_copies_in_queue_order(monkeypatch) -> None:
    engine = SlowCopies()
    meter = ActivationMeter()
    config = OffloadConfig(min_offload_elements=0, pending_copy_activations=None)
    offloader = ActivationOffloader(torch.device("cpu"), config, [], meter, copies=engine)
    x = torch.randn(64, 64, dtype=torch.float64, requires_grad=True)
    for key in range(3):
        with offloader.scope(key, 0):
            (x * (key + 1)).exp().sum()
        offloader.offload(key)
    before = meter.resident_bytes(0)
    assert offloader.pending_copy_bytes == before > 0
    engine.events[1].done = True  # done out of order: a later copy cannot finish first
    offloader.poll()
    assert meter.resident_bytes(0) == before
    engine.events[0].done = True
    offloader.poll()
    assert meter.resident_bytes(0) < before and offloader.pending_copy_bytes < before
    offloader.wait_offloaded(2)  # stream order: the compute stream waits, memory goes now
    assert engine.compute_waits == [engine.events[-1]]
    assert meter.resident_bytes(0) == 0 and offloader.pending_copy_bytes == 0
    for key in range(3):
        offloader.discard(key)
    offloader.finish()


class NormStage(nn.Module):
    """RMSNorm by hand and F.rms_norm, small attention, a head with cross_entropy: ops that save
    their own (small) outputs, which the offloader keeps on the device."""

    def __init__(self, width: int = 8, last: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width, dtype=torch.float64)
        self.scale = nn.Parameter(torch.ones(width, dtype=torch.float64))
        self.last = last
        self.seen: list[weakref.ref] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(weakref.ref(x))
        rms = x.pow(2).mean(-1, keepdim=True).add(1e-6).rsqrt()
        self.seen.append(weakref.ref(rms))
        h = self.proj(x * rms)
        h = nn.functional.rms_norm(h, (h.shape[-1],), self.scale)
        q = h.unsqueeze(1)
        a = nn.functional.scaled_dot_product_attention(q, q, q).squeeze(1)
        self.seen.append(weakref.ref(a))
        return a + x


@pytest.mark.parametrize("name", ["zbv", "zb-h1"])
def test_no_reference_cycle_keeps_a_graph_alive_after_step(name: str) -> None:
    sched = with_offload(build_schedule(name, pp=2, microbatches=2))
    stages = {s: NormStage() for s in range(sched.num_stages)}
    pipe = pipeline_module.Pipeline(stages, sched, lambda out, t: nn.functional.cross_entropy(
        out.flatten(0, 1), t.flatten()))
    x = torch.randn(4, 3, 8, dtype=torch.float64)
    target = torch.randint(0, 8, (4, 3))
    pipe.step(x, target=target)
    gc.collect()
    alive = [(s, i) for s, m in stages.items() for i, r in enumerate(m.seen) if r() is not None]
    assert alive == []
    assert all(p.grad is not None for m in stages.values() for p in m.parameters())


def test_autocast_weight_casts_stay_on_the_device() -> None:
    linear = nn.Linear(64, 64)
    params = list(linear.parameters())
    offloader = ActivationOffloader(torch.device("cpu"), OffloadConfig(min_offload_elements=0),
                                    params)
    x = torch.randn(16, 64, requires_grad=True)  # so the weight is saved for its gradient
    with torch.autocast("cpu", dtype=torch.bfloat16), offloader.scope(0, 0):
        out = linear(x)
    assert out.dtype is torch.bfloat16
    offloader.offload(0)
    # Only the bf16 cast of the input moved; the bf16 weight (64 * 64 * 2 bytes) stayed.
    assert offloader.host_bytes(0) == 16 * 64 * 2
    offloader.reload(0)
    out.float().sum().backward()
    offloader.discard(0)
    assert linear.weight.grad is not None


def test_pool_reuses_a_larger_ready_buffer_before_allocating() -> None:
    pool = HostBufferPool(pin_memory=False)
    small, large = pool.take(100), pool.take(200)
    pool.give_back(small, Event(done=False))  # its copy has not finished
    pool.give_back(large, Event(done=True))
    allocated = pool.allocated_bytes
    view = pool.take(100)
    assert pool.allocated_bytes == allocated and view.numel() == 100


def test_recompute_captures_the_rng_of_the_pipelines_device(monkeypatch) -> None:
    seen = []
    real = RngState.capture
    def capture(device: torch.device) -> RngState:
        seen.append(device)
        return real(torch.device("cpu"))

    monkeypatch.setattr(RngState, "capture", staticmethod(capture))
    sched = build_schedule("gpipe", pp=1, microbatches=1)
    lowered = with_comms(sched.with_ranks([[Action(0, Kind.F, 0), Action(0, Kind.RECOMPUTE, 0),
                                            Action(0, Kind.B, 0)]]))
    runner = StageRunner(0, nn.Dropout(0.5), True, True, lambda out: out.sum(), 1)
    assert runner.device == torch.device("cpu")  # parameter-free: it cannot tell
    device = torch.device("cuda", 3)
    executor = RankExecutor(0, lowered, {0: runner}, LocalTransport(), None, None, True,
                            device=device)
    executor.run(Action(0, Kind.F, 0), StepData([(torch.ones(4, requires_grad=True),)], [()]))
    assert seen == [device]


def test_pageable_host_memory_on_cuda_warns() -> None:
    from pipeoffload.runtime.copies import HostCopies

    with pytest.warns(UserWarning, match="pin_memory=False on CUDA"):
        ActivationOffloader(torch.device("cuda", 0), OffloadConfig(pin_memory=False), [],
                            copies=HostCopies())
