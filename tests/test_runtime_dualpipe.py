"""DualPipe and DualPipeV on real gloo processes: gradients and loss equal plain autograd, with
and without offload, and measured peaks equal the simulator's.

DualPipe runs every model part on two ranks (stage j on rank j, stage p+j on rank p-1-j): each
rank reports its stages' gradients and the test sums the twins, as DeepSeek's all-reduce does.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from patience import PATIENCE_S
from test_runtime_support import (
    launch,
    part_index,
    reference,
    token_batch,
    token_loss,
    transformer_stages,
    with_offload,
)

from pipeoffload.api import build_schedule
from pipeoffload.runtime.config import OffloadConfig, RuntimeConfig
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.pipeline import Pipeline
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.simulator import simulate

pytestmark = pytest.mark.slow

CASES = (("dualpipe", False), ("dualpipe", True), ("dualpipev", False), ("dualpipev", True))


def _schedule(name: str, world: int, offload: bool):
    sched = build_schedule(name, pp=world, microbatches=2 * world)
    return with_offload(sched) if offload else sched


def _run_cases(rank: int, world: int) -> list[tuple]:
    """Per case on this rank: (loss or None, {stage: gradients}, peak bytes, bytes per item)."""
    report = []
    for name, offload in CASES:
        sched = _schedule(name, world, offload)
        parts = transformer_stages(len(sched.route_of(0)))
        mine = {s: parts[part_index(sched, s)] for s in sched.stages_on_rank(rank)}
        meter = ActivationMeter()
        config = RuntimeConfig(p2p_timeout_s=PATIENCE_S,
                               offload=OffloadConfig(min_offload_elements=0))
        pipe = Pipeline(mine, sched, token_loss, config=config, meter=meter,
                        backward_group=dist.new_group(list(range(world))))
        ids, target = token_batch()
        loss = pipe.step(ids, target=target)
        grads = {s: [p.grad.clone() for p in module.parameters()] for s, module in mine.items()}
        report.append((None if loss is None else loss.item(), grads, meter.peak_bytes(rank),
                       meter.scope_bytes))
    return report


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_dualpipe_and_dualpipev_match_autograd_with_and_without_offload(
        world: int, tmp_path) -> None:
    results = launch(_run_cases, world, tmp_path)
    assert sorted(results) == list(range(world)), results
    for outcome in results.values():
        assert "ok" in outcome, outcome.get("trace")
    for index, (name, offload) in enumerate(CASES):
        sched = _schedule(name, world, offload)
        parts = transformer_stages(len(sched.route_of(0)))
        ids, target = token_batch()
        ref_loss, ref_grads = reference(parts, ids, target, sched.microbatches)
        summed: dict[int, list] = {}
        losses = []
        for rank in range(world):
            loss, grads, _, _ = results[rank]["ok"][index]
            if loss is not None:
                losses.append(loss)
            for stage, stage_grads in grads.items():
                part = part_index(sched, stage)
                if part in summed:  # DualPipe's twin: add, as the all-reduce of the pair does
                    summed[part] = [a + b for a, b in zip(summed[part], stage_grads)]
                else:
                    summed[part] = stage_grads
        assert sorted(summed) == list(range(len(parts))), (name, offload)
        for part, grads in summed.items():
            for got, want in zip(grads, ref_grads[part]):
                assert ((got - want).norm() / want.norm()).item() <= 1e-12, (name, offload, part)
        # DualPipe: the two ranks with a last stage return shares that add up to the mean.
        assert len(losses) == len({sched.rank_of(s) for s in range(sched.num_stages)
                                   if sched.is_last_stage(s)})
        assert abs(sum(losses) - ref_loss.item()) <= 1e-12 * ref_loss.item(), (name, offload)
        sizes: dict[int, set[int]] = {}
        for rank in range(world):
            for (stage, _), nbytes in results[rank]["ok"][index][3].items():
                sizes.setdefault(stage, set()).add(nbytes)
        assert all(len(sizes[s]) == 1 for s in range(sched.num_stages))
        per_stage = tuple(sizes[s].pop() for s in range(sched.num_stages))
        expected = simulate(sched, CostModel(stage_activation_bytes=per_stage)).peak_bytes
        measured = tuple(results[r]["ok"][index][2] for r in range(world))
        assert measured == expected, (name, offload)
