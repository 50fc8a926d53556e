"""Every collective posts tensors on the device its group serves. NCCL refuses host tensors
(ProcessGroupNCCL checks every tensor is a dense CUDA tensor: "Tensors must be CUDA and
dense"), so a CPU tensor posted on an NCCL group crashes every rank. Without a GPU, a fake
backend does the same: it takes only tensors on cuda:0, which here are CPU tensors that say they
live there (``FakeCuda``), made by a mode that turns ``device=cuda`` factory calls into them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from pipeoffload.api import build_schedule
from pipeoffload.parallel import topology as topology_module
from pipeoffload.parallel.gradients import clip_gradients, sync_gradients
from pipeoffload.runtime.tied import TiedGradients

CUDA = torch.device("cuda", 0)


class FakeCuda(torch.Tensor):
    """A CPU tensor whose ``device`` is cuda:0; operations run on the CPU data."""

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> FakeCuda:
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), dtype=data.dtype, device=CUDA,
            requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor) -> None:
        self.data_ = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        def unwrap(x):  # type: ignore[no-untyped-def]
            if isinstance(x, FakeCuda):
                return x.data_
            if isinstance(x, torch.device) and x.type == "cuda":
                return torch.device("cpu")
            return x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func is torch.ops.aten._local_scalar_dense.default:
            return out
        return tree_map(lambda x: FakeCuda(x) if isinstance(x, torch.Tensor) else x, out)


class FakeCudaMode(TorchFunctionMode):
    """``device=cuda`` in a factory call makes a FakeCuda tensor (there is no real CUDA)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.tolist and isinstance(args[0], FakeCuda):
            return args[0].data_.tolist()
        if func is torch.Tensor.__getitem__ and isinstance(args[0], FakeCuda):
            return FakeCuda(args[0].data_[args[1]])  # read-only use: a copy of the slice
        if func is torch.Tensor.copy_ and isinstance(args[0], FakeCuda):
            source = args[1].data_ if isinstance(args[1], FakeCuda) else args[1]
            args[0].data_.copy_(source)  # copy_ guards the device before dispatching
            return args[0]
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
            return FakeCuda(func(*args, **kwargs))
        return func(*args, **kwargs)


class DeviceOnlyBackend:
    """Like NCCL: every posted tensor must be on cuda:0. A SUM adds an equal peer (x2)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, world: int = 2) -> None:
        self.posted: list[tuple[str, torch.device, torch.dtype]] = []
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        monkeypatch.setattr(dist, "all_reduce", self.all_reduce)
        monkeypatch.setattr(dist, "all_gather", self.all_gather)

    def all_reduce(self, tensor: torch.Tensor, op: object = dist.ReduceOp.SUM,
                   group: object = None, async_op: bool = False) -> object:
        self.posted.append(("all_reduce", tensor.device, tensor.dtype))
        if tensor.device != CUDA:
            raise RuntimeError("Tensors must be CUDA and dense")
        if op == dist.ReduceOp.SUM:
            tensor.mul_(2)
        return _Done() if async_op else None


    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor,
                   group: object = None, async_op: bool = False) -> None:
        self.posted.append(("all_gather", tensor.device, tensor.dtype))
        if any(t.device != CUDA for t in (tensor, *outputs)):
            raise RuntimeError("Tensors must be CUDA and dense")
        for output in outputs:
            output.copy_(tensor)


class _Done:
    def wait(self, timeout: object = None) -> bool:
        return True


def _fake_cuda_module(module: nn.Module) -> nn.Module:
    for name, param in list(module.named_parameters(recurse=False)):
        setattr(module, name, nn.Parameter(FakeCuda(param.detach())))
    for child in module.children():
        _fake_cuda_module(child)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tied_gradients_post_device_tensors(monkeypatch, dtype: torch.dtype) -> None:
    """A tie between stage 0 (this rank) and stage 1 (the peer): the size agreement and the
    gradient sum are posted on cuda:0; with bf16 weights accumulating in float32 the sum is
    float32 (parallel/precision.py Note: [mixed precision])."""
    backend = DeviceOnlyBackend(monkeypatch)
    schedule = build_schedule("1f1b", pp=2, microbatches=2)
    with FakeCudaMode():
        embed = _fake_cuda_module(nn.Embedding(4, 3).to(dtype))
        weight = embed.weight
        if dtype is torch.bfloat16:
            weight.grad_dtype = torch.float32
        grad_dtype = torch.float32
        tied = TiedGradients({"embed": {0: "weight", 1: "weight"}}, {0: embed}, schedule,
                             "the pipeline group", CUDA, True, 5.0)
        tied.begin_step()
        weight.grad = FakeCuda(torch.ones(4, 3, dtype=grad_dtype))
        tied.finish_step()
    assert tied.names == ["embed"]
    assert backend.posted == [("all_reduce", CUDA, torch.int64),
                              ("all_reduce", CUDA, grad_dtype)]
    assert weight.grad.device == CUDA and weight.grad.dtype == grad_dtype
    assert weight.grad.data_.eq(2).all()  # the peer's copy added


def _topology(**changes) -> topology_module.Topology:
    base = topology_module.Topology(pp=2, dp=1, rank=0, distributed=True, device=CUDA,
                           pp_group="pp", dp_group="dp")
    return dataclasses.replace(base, **changes)


def test_a_rank_without_gradients_posts_a_device_zero_for_the_norm(monkeypatch) -> None:
    backend = DeviceOnlyBackend(monkeypatch)
    with FakeCudaMode():
        param = nn.Parameter(FakeCuda(torch.ones(3)))  # never got a gradient
        clip_gradients([param], 1.0, _topology())
    assert backend.posted == [("all_reduce", CUDA, torch.float64)]


def test_data_parallel_gradients_go_on_the_device(monkeypatch) -> None:
    backend = DeviceOnlyBackend(monkeypatch)
    with FakeCudaMode():
        param = nn.Parameter(FakeCuda(torch.ones(3)))
        param.grad = FakeCuda(torch.full((3,), 4.0))
        sync_gradients({0: [param]}, _topology(dp=2))
    assert backend.posted == [("all_reduce", CUDA, torch.float32)]
    assert param.grad.data_.tolist() == [4.0, 4.0, 4.0]  # summed over 2 replicas, averaged


def test_the_fake_backend_refuses_host_tensors(monkeypatch) -> None:
    """What the code before issue 20 did: a host zero for the norm."""
    backend = DeviceOnlyBackend(monkeypatch)
    with pytest.raises(RuntimeError, match="CUDA and dense"):
        backend.all_reduce(torch.zeros((), dtype=torch.float64))


def test_the_training_loops_gather_posts_device_tensors(monkeypatch) -> None:
    from pipeoffload.training.gather import gather_floats

    backend = DeviceOnlyBackend(monkeypatch)
    with FakeCudaMode():
        rows = gather_floats(_topology(), [1.5, 2.0])
    assert backend.posted == [("all_gather", CUDA, torch.float64)]
    assert rows == [[1.5, 2.0], [1.5, 2.0]]
