"""The activation offloader on its own: what moves, what stays, what is freed, and reuse."""

from __future__ import annotations

import weakref

import pytest

torch = pytest.importorskip("torch")

from test_runtime_support import (
    max_relative_error,
    one_thread,  # noqa: F401 - autouse fixture
    reference,
    token_batch,
    token_loss,
    transformer_stages,
    with_offload,
)

from pipeoffload.core.registry import build_schedule
from pipeoffload.errors import PipelineRuntimeError
from pipeoffload.runtime.config import OffloadConfig, RuntimeConfig
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.offloader import ActivationOffloader
from pipeoffload.runtime.pipeline import Pipeline

CPU = torch.device("cpu")


class SaveViews(torch.autograd.Function):
    """Saves two different views of one storage, to check views come back as views."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        ctx.save_for_backward(x[:, :4], x.t())
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        left, transposed = ctx.saved_tensors
        assert transposed.t()[:, :4].equal(left)
        return grad * 2 + transposed.t() * 0


@pytest.mark.parametrize("stream", [False, True], ids=["at-offload", "streamed"])
def test_views_of_one_storage_move_once_and_come_back_as_views(stream: bool) -> None:
    offloader = ActivationOffloader(CPU, OffloadConfig(min_offload_elements=0), [])
    x = torch.randn(8, 8, requires_grad=True)
    with offloader.scope("k", owner=0, stream=stream):
        y = SaveViews.apply(x.exp())
    # One storage of 8 * 8 float32, though two views of it were saved.
    assert offloader.device_bytes("k") + offloader.host_bytes("k") == 8 * 8 * 4
    assert offloader.host_bytes("k") == (8 * 8 * 4 if stream else 0)
    offloader.offload("k")
    assert offloader.device_bytes("k") == 0
    assert offloader.host_bytes("k") == 8 * 8 * 4
    offloader.reload("k")
    y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.exp())
    offloader.discard("k")
    offloader.finish()


@pytest.mark.parametrize("stream", [False, True], ids=["at-offload", "streamed"])
def test_cpu_offload_releases_the_original_storage(stream: bool) -> None:
    linear = torch.nn.Linear(64, 64)
    offloader = ActivationOffloader(CPU, OffloadConfig(), list(linear.parameters()))
    x = torch.randn(32, 64)
    with offloader.scope("k", owner=0, stream=stream):
        hidden = torch.tanh(linear(x))  # tanh saves its output: 32 * 64 elements
        out = hidden.sum()
    alive = weakref.ref(hidden.untyped_storage())
    del hidden
    # Streamed, the copy was made as tanh saved it, so only the forward's reference held it.
    assert (alive() is None) == stream
    offloader.offload("k")
    assert alive() is None  # the host copy is a separate tensor; the device one is gone
    offloader.reload("k")
    out.backward()
    reference = torch.nn.Linear(64, 64)
    reference.load_state_dict(linear.state_dict())
    torch.tanh(reference(x)).sum().backward()
    assert torch.equal(linear.weight.grad, reference.weight.grad)


def test_parameters_and_tiny_tensors_stay() -> None:
    linear = torch.nn.Linear(64, 64)
    offloader = ActivationOffloader(CPU, OffloadConfig(min_offload_elements=1024),
                                    list(linear.parameters()))
    meter = ActivationMeter()
    offloader_with_meter = ActivationOffloader(CPU, OffloadConfig(min_offload_elements=1024),
                                               list(linear.parameters()), meter)
    for off in (offloader, offloader_with_meter):
        with off.scope("small", owner=0):
            small = linear(torch.randn(4, 64))  # saves a 256-element input and the weight
        assert off.device_bytes("small") == 0  # nothing recorded for moving
        small.sum().backward()
        off.discard("small")
    assert meter.peak_bytes(0) == 4 * 64 * 4  # the tiny input counted, the weight never


def test_backward_without_reload_raises_naming_the_activation() -> None:
    offloader = ActivationOffloader(CPU, OffloadConfig(min_offload_elements=0), [])
    x = torch.randn(8, 8, requires_grad=True)
    with offloader.scope((3, 5), owner=0):
        y = torch.tanh(x)
    offloader.offload((3, 5))
    with pytest.raises(PipelineRuntimeError, match=r"\(3, 5\) is on the host.*RELOAD"):
        y.sum().backward()


def test_host_buffers_are_reused_across_steps_and_shapes_may_change() -> None:
    sched = with_offload(build_schedule("1f1b", pp=2, microbatches=2))
    stages = transformer_stages(2)
    pipe = Pipeline(dict(enumerate(stages)), sched, token_loss,
                    config=RuntimeConfig(offload=OffloadConfig(min_offload_elements=0)))
    ids, target = token_batch(batch=4)
    pipe.step(ids, target=target)
    after_first = pipe.offloader.host_pool_bytes
    pipe.step(ids, target=target)
    assert pipe.offloader.host_pool_bytes == after_first
    for stage in stages:
        stage.zero_grad(set_to_none=True)
    # A new Pipeline for new shapes (P2P shapes are fixed per Pipeline), same offloader logic.
    longer_ids, longer_target = token_batch(batch=4, seq=7)
    pipe2 = Pipeline(dict(enumerate(stages)), sched, token_loss)
    pipe2.step(longer_ids, target=longer_target)
    _, grads = reference(stages, longer_ids, longer_target, 2)
    assert max_relative_error(stages, grads) <= 1e-12


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_is_bitwise_and_reuses_pinned_buffers() -> None:
    device = torch.device("cuda")
    grads = []
    for offload in (False, True):
        base = build_schedule("zbv", pp=2, microbatches=4)
        sched = with_offload(base) if offload else base
        stages = [s.to(device) for s in transformer_stages(4, torch.float32)]
        pipe = Pipeline(dict(enumerate(stages)), sched, token_loss,
                        config=RuntimeConfig(offload=OffloadConfig(min_offload_elements=0)))
        ids, target = token_batch()
        pipe.step(ids.to(device), target=target.to(device))
        if offload:
            pooled = pipe.offloader.host_pool_bytes
            for stage in stages:
                stage.zero_grad(set_to_none=True)
            pipe.step(ids.to(device), target=target.to(device))
            assert pipe.offloader.host_pool_bytes == pooled
        torch.cuda.synchronize()
        grads.append([p.grad.cpu() for s in stages for p in s.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
