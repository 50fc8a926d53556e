"""Real processes over gloo: results against plain autograd, and failures that do not hang."""

from __future__ import annotations

import os
import time

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from patience import PATIENCE_S
from test_runtime_support import (
    launch,
    max_relative_error,
    reference,
    token_batch,
    token_loss,
    transformer_stages,
    with_offload,
)

from pipeoffload.api import build_schedule
from pipeoffload.runtime.config import OffloadConfig, RuntimeConfig
from pipeoffload.runtime.groups import new_channel_groups
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.pipeline import Pipeline
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.simulator import simulate

pytestmark = pytest.mark.slow

CASES = (("1f1b", {}, False), ("interleaved-1f1b", {"chunks": 2}, False), ("zbv", {}, False),
         ("zbv", {}, True), ("po-f", {"offload_ratio": 0.25}, False))


def _train_cases(rank: int, world: int, dtype_name: str) -> list[tuple]:
    """Every case of CASES on this rank: (case, max relative gradient error, loss error or
    None, whether this rank holds the last stage, measured peak bytes, bytes per (stage, mb))."""
    dtype = getattr(torch, dtype_name)
    microbatches = 4
    report = []
    for name, options, offload in CASES:
        sched = build_schedule(name, pp=world, microbatches=microbatches, **options)
        sched = with_offload(sched) if offload else sched
        stages = transformer_stages(sched.num_stages, dtype)
        ids, target = token_batch()
        mine = {s: stages[s] for s in sched.stages_on_rank(rank)}
        # Every communicator layout: one group (1f1b), a separate one for gradients (zbv),
        # one per channel as `connect` makes them (interleaved-1f1b, po-f).
        backward_group = dist.new_group(list(range(world))) if name == "zbv" else None
        channels = (new_channel_groups(list(range(world)))
                    if name in ("interleaved-1f1b", "po-f") else None)
        meter = ActivationMeter()
        config = RuntimeConfig(p2p_timeout_s=PATIENCE_S,
                               offload=OffloadConfig(min_offload_elements=0))
        pipe = Pipeline(mine, sched, token_loss, config=config, meter=meter,
                        backward_group=backward_group, channel_groups=channels)
        loss = pipe.step(ids, target=target)  # every rank passes both; each uses what it needs
        ref_loss, ref_grads = reference(stages, ids, target, microbatches)
        loss_error = None if loss is None else abs(loss.item() - ref_loss.item()) / ref_loss.item()
        report.append((f"{name}{'+offload' if offload else ''}",
                       max_relative_error(mine, ref_grads), loss_error,
                       sched.num_stages - 1 in mine, meter.peak_bytes(rank), meter.scope_bytes))
    return report


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_matches_single_process_autograd(world: int, tmp_path) -> None:
    results = launch(_train_cases, world, tmp_path, "float64")
    assert sorted(results) == list(range(world)), results
    for rank, outcome in results.items():
        assert "ok" in outcome, outcome.get("trace")
        assert len(outcome["ok"]) == len(CASES)
        for case, grad_error, loss_error, holds_last, _, _ in outcome["ok"]:
            assert grad_error <= 1e-12, (rank, case)
            if holds_last:
                assert loss_error is not None and loss_error <= 1e-12, (rank, case)
            else:
                assert loss_error is None, (rank, case)
    for index, (name, options, offload) in enumerate(CASES):
        sched = build_schedule(name, pp=world, microbatches=4, **options)
        sched = with_offload(sched) if offload else sched
        per_stage: dict[int, set[int]] = {}
        for outcome in results.values():
            for (stage, _), nbytes in outcome["ok"][index][5].items():
                per_stage.setdefault(stage, set()).add(nbytes)
        assert all(len(per_stage[s]) == 1 for s in range(sched.num_stages))
        sizes = tuple(per_stage[s].pop() for s in range(sched.num_stages))
        expected = simulate(sched, CostModel(stage_activation_bytes=sizes)).peak_bytes
        measured = tuple(results[r]["ok"][index][4] for r in range(world))
        assert measured == expected, (name, offload)


class _DieAt(torch.nn.Module):
    """Wraps a stage; kills the whole process in the forward of one microbatch."""

    def __init__(self, inner: torch.nn.Module, calls_before_death: int) -> None:
        super().__init__()
        self.inner = inner
        self.left = calls_before_death

    def forward(self, x):  # type: ignore[no-untyped-def]
        if self.left == 0:
            os._exit(17)
        self.left -= 1
        return self.inner(x)


def _killed_peer(rank: int, world: int) -> str:
    sched = build_schedule("1f1b", pp=world, microbatches=4)
    stages = transformer_stages(world)
    ids, target = token_batch()
    module = _DieAt(stages[rank], 1) if rank == world - 1 else stages[rank]
    pipe = Pipeline({rank: module}, sched, token_loss, config=RuntimeConfig(p2p_timeout_s=5))
    pipe.step(ids, target=target)
    return "finished"


def test_a_peer_killed_mid_step_makes_every_other_rank_raise(tmp_path) -> None:
    results = launch(_killed_peer, 3, tmp_path)
    assert 2 not in results  # it died before reporting
    for rank in (0, 1):
        assert rank in results, f"rank {rank} did not finish"
        assert results[rank].get("type") == "PipelineRuntimeError", results[rank]
        assert f"rank {rank}: " in results[rank]["error"]
        assert "waited for" in results[rank]["error"]


def _silent_peer(rank: int, world: int, result_dir: str, connects: bool = True) -> str:
    sched = build_schedule("1f1b", pp=world, microbatches=2)
    stages = transformer_stages(world)
    config = RuntimeConfig(p2p_timeout_s=1)
    if rank == 1:  # alive, but never runs its schedule (with ``connects``, after setting up its
        # connections): it stays until rank 0 has reported, so that however slowly rank 0
        # starts, it times out on a live peer (a peer that had exited would end its wait with
        # a closed connection instead)
        pipe = Pipeline({1: stages[1]}, sched, token_loss,
                        config=RuntimeConfig(p2p_timeout_s=PATIENCE_S))
        dist.barrier()  # both ranks start their setup together, however slowly they started
        if connects:
            pipe.connect_peers()
        done = os.path.join(result_dir, "rank0.pt")
        give_up = time.monotonic() + PATIENCE_S
        while not os.path.exists(done) and time.monotonic() < give_up:
            time.sleep(0.05)
        return "waited"
    ids, target = token_batch()
    pipe = Pipeline({0: stages[0]}, sched, token_loss, config=config)
    dist.barrier()
    pipe.step(ids, target=target)
    return "finished"


def _silent_from_the_start(rank: int, world: int, result_dir: str) -> str:
    return _silent_peer(rank, world, result_dir, connects=False)


def test_a_silent_peer_times_out_naming_the_action(tmp_path) -> None:
    results = launch(_silent_peer, 2, tmp_path, str(tmp_path))
    assert results[0].get("type") == "PipelineRuntimeError", results[0]
    assert "rank 0: 0RECV_B0 waited for" in results[0]["error"]


def test_a_peer_that_never_connects_times_out_at_the_connection_setup(tmp_path) -> None:
    """Pipeline.connect_peers (the first thing a first step does) names the connection."""
    results = launch(_silent_from_the_start, 2, tmp_path, str(tmp_path))
    assert results[0].get("type") == "PipelineRuntimeError", results[0]
    assert ("rank 0: connection setup (F_UP, rank 0 -> rank 1) waited for the connection"
            in results[0]["error"])
