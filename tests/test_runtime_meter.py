"""The memory meter around a torch.distributed.pipelining step and around our Pipeline."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from test_runtime_support import launch
from torch import nn

pytestmark = pytest.mark.slow


class _Scaled(nn.Module):
    """Its first op (a scalar multiply) saves nothing, so how a schedule slices the batch
    (views of the whole batch in torch, copies in ours) does not change what is saved."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.lin(x * 2)))


def _squared_error(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def _both_peaks(rank: int, world: int) -> dict[str, int]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from pipeoffload.core.registry import build_schedule
    from pipeoffload.runtime.meter import ActivationMeter
    from pipeoffload.runtime.pipeline import Pipeline

    torch.manual_seed(0)
    modules = [_Scaled() for _ in range(world)]
    x, target = torch.randn(16, 16), torch.randn(16, 16)
    theirs = ActivationMeter()
    theirs.exclude(modules[rank].parameters())
    stage = PipelineStage(modules[rank], rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=_squared_error)
    with theirs.observe(owner=rank):
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=target)
    ours = ActivationMeter()
    pipe = Pipeline({rank: modules[rank]}, build_schedule("1f1b", pp=world, microbatches=4),
                    _squared_error, meter=ours)
    pipe.step(x, target=target)
    return {"torch": theirs.peak_bytes(rank), "ours": ours.peak_bytes(rank),
            "torch_left": theirs.resident_bytes(rank), "ours_left": ours.resident_bytes(rank)}


def test_meter_measures_torch_pipelining_and_pipeline_alike(tmp_path) -> None:
    results = launch(_both_peaks, 2, tmp_path)
    for rank in (0, 1):
        assert "ok" in results[rank], results[rank].get("trace")
        peaks = results[rank]["ok"]
        assert peaks["torch"] > 0
        assert peaks["torch"] == peaks["ours"]
        assert peaks["torch_left"] == peaks["ours_left"] == 0
    # 1F1B keeps two microbatches in flight on rank 0 and one on rank 1.
    assert results[0]["ok"]["ours"] > results[1]["ok"]["ours"]
