"""The op recorder and replay under class recompute (runtime/class_recompute.py, Note: [class
recompute]): what a replay makes equals what the forward made, random draws included; what it
reads is a saved tensor where one is given; an op changing an outside tensor in place is
refused by name."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pipeoffload.errors import PipelineRuntimeError
from pipeoffload.runtime.class_recompute import OpRecorder, replay


def test_a_replay_makes_the_same_tensors_random_draws_and_in_place_fills_included() -> None:
    weight = torch.randn(4, 4)
    with OpRecorder() as recorder:
        x = torch.arange(8.0).reshape(2, 4)
        h = x @ weight
        mask = torch.empty_like(h).bernoulli_(0.5)  # a draw, into a tensor the forward made
        out = torch.nn.functional.dropout(h * mask, 0.3)
    torch.rand(100)  # the generator moves on before the replay
    ran: list[str] = []
    ref = recorder.ref_of(out)
    assert ref is not None
    again = replay([ref], {}, ran)[ref]
    assert torch.equal(again, out) and again.data_ptr() != out.data_ptr()
    assert any("bernoulli" in op for op in ran)


def test_a_replay_reads_a_saved_tensor_instead_of_making_it() -> None:
    with OpRecorder() as recorder:
        x = torch.randn(3, 3)
        h = x.exp()
        out = h * 2
    h_ref, out_ref = recorder.ref_of(h), recorder.ref_of(out)
    assert h_ref is not None and out_ref is not None
    given = torch.full((3, 3), 7.0)  # read, not recomputed: the replay runs the multiply only
    ran: list[str] = []
    again = replay([out_ref], {h_ref: lambda: given}, ran)[out_ref]
    assert ran == ["aten.mul.Tensor"] and torch.equal(again, given * 2)


def test_a_replay_refuses_an_op_that_changes_an_outside_tensor_in_place() -> None:
    outside = torch.ones(3)
    with OpRecorder() as recorder:
        y = outside.add_(1)
        out = y * 2
    ref = recorder.ref_of(out)
    assert ref is not None
    with pytest.raises(PipelineRuntimeError, match=r"aten\.add_\.Tensor.*in place"):
        replay([ref], {})
    assert torch.equal(outside, torch.full((3,), 2.0))  # untouched by the refused replay


def test_a_replay_refuses_a_collective(tmp_path) -> None:
    """A recompute through a collective (context parallelism's all-gather) would run it on
    one rank alone: refused by name before anything runs."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}",
                                rank=0, world_size=1)
    try:
        with OpRecorder() as recorder:
            x = torch.randn(4) * 2
            gathered = torch.empty(4 * dist.get_world_size())
            dist.all_gather_single(gathered, x)
            out = gathered * 3
        ref = recorder.ref_of(out)
        assert ref is not None
        with pytest.raises(PipelineRuntimeError, match=r"c10d.*a collective"):
            replay([ref], {})
    finally:
        if started:
            dist.destroy_process_group()
