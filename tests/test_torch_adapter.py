"""pipeoffload.torch: our schedules, offload included, inside torch.distributed.pipelining's
runtime over real PipelineStages (gloo), against the same schedule without offload, torch's own
schedule and plain autograd; and torch-written CSVs with FSDP / DP markers."""

from __future__ import annotations

import csv
import io

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from patience import PATIENCE_S
from test_runtime_support import launch, one_thread  # noqa: F401 - fixture
from torch import nn

from pipeoffload.api import build_schedule
from pipeoffload.core.actions import OFFLOAD_KINDS, Action, Kind
from pipeoffload.core.text import parse_rows, schedule_from_rows, to_csv_text
from pipeoffload.core.validate import validate
from pipeoffload.errors import ConfigError, IntegrationError
from pipeoffload.offload.plan import OffloadPolicy
from pipeoffload.runtime.config import OffloadConfig
from pipeoffload.sim.simulator import simulate
from pipeoffload.torch import PipeOffloadSchedule, check_torch_version

WIDTH, BATCH, MICROBATCHES = 8, 8, 4
FETCH = OffloadPolicy(fetch_on_use=True)
# (name, build options, torch's schedule class with the same placement and order, or None);
# "+wait": an OFFLOAD_WAIT right after every OFFLOAD.
CASES_2 = (
    ("1f1b", {"offload": "all"}, "Schedule1F1B"),
    ("interleaved-1f1b", {"offload": "all", "chunks": 2}, "ScheduleInterleaved1F1B"),
    ("zbv", {"offload": "all"}, "ScheduleZBVZeroBubble"),
    ("po-h", {"offload_ratio": 0.5}, None),
    ("po-f", {"offload_ratio": 0.5}, None),
    ("po-f", {"policy": FETCH}, None),
    ("1f1b+wait", {"offload": "all"}, "Schedule1F1B"),
    ("zbv", {"offload": "all", "policy": FETCH}, "ScheduleZBVZeroBubble"),
)
CASES_4 = (
    ("zbv", {"offload": "all"}, "ScheduleZBVZeroBubble"),
    ("po-f", {"policy": FETCH}, None),
)


def with_waits(schedule):
    rows = [[b for a in row for b in ((a, Action(a.stage, Kind.OFFLOAD_WAIT, a.microbatch))
                                      if a.kind is Kind.OFFLOAD else (a,))]
            for row in schedule.ranks]
    return validate(schedule.with_ranks(rows))


def stage_module(index: int) -> nn.Module:
    torch.manual_seed(100 + index)
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH),
                         nn.LayerNorm(WIDTH)).double()


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return (torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64),
            torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64))


def reference(num_stages: int) -> list[list[torch.Tensor]]:
    modules = [stage_module(s) for s in range(num_stages)]
    x, y = batch()
    for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
        h = xm
        for m in modules:
            h = m(h)
        (mse(h, ym) / MICROBATCHES).backward()
    return [[p.grad for p in m.parameters()] for m in modules]


def run(rank: int, schedule, torch_class: str | None = None, device: str = "cpu"):
    """Gradients per stage of this rank after one step, and the schedule object used."""
    from torch.distributed.pipelining import PipelineStage, schedules

    mods = {s: stage_module(s) for s in schedule.stages_on_rank(rank)}
    stages = [PipelineStage(mods[s], s, schedule.num_stages, torch.device(device))
              for s in sorted(mods)]
    config = OffloadConfig(min_offload_elements=0)
    if torch_class is None:
        pipe = PipeOffloadSchedule(stages, schedule, loss_fn=mse, offload_config=config)
    elif torch_class == "from_torch":
        native = schedules.ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=mse)
        pipe = PipeOffloadSchedule.from_torch(native, schedule, offload_config=config)
    else:
        cls = getattr(schedules, torch_class)
        pipe = cls(stages if len(stages) > 1 or torch_class != "Schedule1F1B" else stages[0],
                   MICROBATCHES, loss_fn=mse)
    x, y = batch()
    losses: list[torch.Tensor] = []
    first, last = 0 in mods, schedule.num_stages - 1 in mods
    args = (x,) if first else ()
    pipe.step(*args, target=y if last else None, losses=losses if last else None)
    return {s: [p.grad.clone() for p in m.parameters()] for s, m in mods.items()}, pipe


def _cases(rank: int, world: int, cases: tuple) -> list[tuple]:
    report = []
    ref = None
    for name, options, torch_class in cases:
        schedule = build_schedule(name.removesuffix("+wait"), pp=world,
                                  microbatches=MICROBATCHES, **options)
        if name.endswith("+wait"):
            schedule = with_waits(schedule)
        assert schedule.has_kind(Kind.OFFLOAD)
        assert ("policy" in options) == schedule.has_kind(Kind.FETCH)
        plain = schedule.without(*OFFLOAD_KINDS)
        with_offload, pipe = run(rank, schedule)
        without, _ = run(rank, plain)
        bitwise_plain = all(torch.equal(a, b) for s in with_offload
                            for a, b in zip(with_offload[s], without[s]))
        bitwise_torch = None
        if torch_class is not None:
            native, _ = run(rank, plain, torch_class)
            bitwise_torch = all(torch.equal(a, b) for s in with_offload
                                for a, b in zip(with_offload[s], native[s]))
        if ref is None or len(ref) != schedule.num_stages:
            ref = reference(schedule.num_stages)
        error = max(((a - r).norm() / r.norm()).item() for s in with_offload
                    for a, r in zip(with_offload[s], ref[s]))
        fetch = " FETCH" if schedule.has_kind(Kind.FETCH) else ""
        offloader = pipe.offloader
        moved = 0 if offloader is None else offloader.host_pool_bytes + offloader.fetched_bytes
        planned = sum(a.kind is Kind.OFFLOAD for a in schedule.ranks[rank])
        report.append((name + fetch, bitwise_plain, bitwise_torch, error, (planned, moved)))
    return report


def _from_torch_case(rank: int, world: int) -> tuple:
    """from_torch over stages built on "cpu:<rank>" (as torchtitan builds them)."""
    schedule = build_schedule("interleaved-1f1b", pp=world, microbatches=MICROBATCHES, chunks=2,
                              offload="all")
    grads, pipe = run(rank, schedule, "from_torch", device=f"cpu:{rank}")
    plain, _ = run(rank, schedule.without(*OFFLOAD_KINDS))
    bitwise = all(torch.equal(a, b) for s in grads for a, b in zip(grads[s], plain[s]))
    planned = sum(a.kind is Kind.OFFLOAD for a in schedule.ranks[rank])
    return bitwise, (planned, pipe.offloader.host_pool_bytes)


def _two_ranks(rank: int, world: int) -> tuple[list[tuple], list[str]]:
    report = _cases(rank, world, CASES_2)
    bitwise, moved = _from_torch_case(rank, world)
    report.append(("from_torch", bitwise, None, 0.0, moved))
    return report, _misuse(rank, world)


def _four_ranks(rank: int, world: int) -> list[tuple]:
    return _cases(rank, world, CASES_4)


def _check(results: dict, world: int) -> None:
    assert sorted(results) == list(range(world)), results
    for rank, outcome in results.items():
        assert "ok" in outcome, f"rank {rank}: {outcome.get('trace')}"
        for name, bitwise_plain, bitwise_torch, error, (planned, moved) in outcome["ok"]:
            assert bitwise_plain, f"rank {rank} {name}: offload changed the gradients"
            assert bitwise_torch in (None, True), f"rank {rank} {name}: differs from torch's"
            assert error < 1e-12, f"rank {rank} {name}: {error:.2e} from plain autograd"
            assert (planned > 0) == (moved > 0), f"rank {rank} {name}: {planned} OFFLOAD, {moved} B"


@pytest.mark.slow
def test_two_ranks_every_schedule_with_offload_is_bitwise_torch_and_plain(tmp_path):
    """Also: wrong stages and a wrong microbatch count name what to change."""
    results = launch(_two_ranks, 2, tmp_path, join_timeout_s=PATIENCE_S)
    assert sorted(results) == [0, 1], results
    for rank, outcome in results.items():
        assert "ok" in outcome, f"rank {rank}: {outcome.get('trace')}"
        wrong_stages, wrong_count = outcome["ok"][1]
        assert f"places stages [{rank}, {3 - rank}] there" in wrong_stages
        assert "n_microbatches=3, but schedule 'zbv' has 4 microbatches" in wrong_count
    _check({r: {"ok": o["ok"][0]} for r, o in results.items()}, 2)


@pytest.mark.slow
def test_four_ranks_zbv_and_po_f_fetch_are_bitwise_torch_and_plain(tmp_path):
    _check(launch(_four_ranks, 4, tmp_path, join_timeout_s=PATIENCE_S), 4)


def _misuse(rank: int, world: int) -> list[str]:
    from torch.distributed.pipelining import PipelineStage

    schedule = build_schedule("zbv", pp=world, microbatches=MICROBATCHES)
    wrong = [PipelineStage(stage_module(rank), rank, schedule.num_stages, torch.device("cpu"))]
    right = [PipelineStage(stage_module(s), s, schedule.num_stages, torch.device("cpu"))
             for s in schedule.stages_on_rank(rank)]
    messages = []
    for stages, count in ((wrong, None), (right, 3)):
        with pytest.raises(ConfigError) as error:
            PipeOffloadSchedule(stages, schedule, count, loss_fn=mse)
        messages.append(str(error.value))
    return messages


def test_untested_torch_versions_are_refused_clearly():
    check_torch_version("2.13.1+cpu")
    with pytest.raises(IntegrationError, match=r"tested on torch 2\.13\.x; this is torch 2\.7\.0"):
        check_torch_version("2.7.0")


def test_recompute_points_to_activation_checkpointing():
    schedule = build_schedule("1f1b", pp=1, microbatches=2)
    from pipeoffload.offload.recompute import add_recompute
    from pipeoffload.sim.costs import CostModel

    recomputed = add_recompute(schedule, CostModel(), "all").schedule
    assert recomputed.has_kind(Kind.RECOMPUTE)
    with pytest.raises(ConfigError, match="activation checkpointing"):
        PipeOffloadSchedule([object()], recomputed)


def test_torch_written_csv_with_fsdp_and_dp_markers_simulates_and_round_trips():
    from torch.distributed.pipelining.schedules import (
        _Action,
        _add_reduce_grad,
        _add_send_recv,
        _add_unshard_reshard,
    )

    ours = build_schedule("interleaved-1f1b", pp=2, microbatches=4, chunks=2)
    compute = {r: [_Action.from_str(str(a)) for a in row] for r, row in enumerate(ours.ranks)}
    lowered = {r: _add_reduce_grad(_add_unshard_reshard(row), ours.microbatches)
               for r, row in compute.items()}
    lowered = _add_send_recv(lowered, stage_to_rank=lambda s: ours.stage_to_rank[s],
                             num_stages=ours.num_stages)
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(lowered[r] for r in sorted(lowered))
    text = out.getvalue()
    assert "0REDUCE_GRAD" in text and "1UNSHARD" in text

    loaded = validate(schedule_from_rows(parse_rows(text)))
    assert loaded.has_kind(Kind.REDUCE_GRAD, Kind.UNSHARD, Kind.RESHARD)
    assert to_csv_text(loaded) == text  # written back as torch wrote it
    assert "REDUCE_GRAD" not in to_csv_text(loaded, compute_only=True)
    # markers cost no time: the same makespan and peaks as our schedule without them
    assert simulate(loaded).makespan == simulate(ours).makespan
    assert simulate(loaded).peak_activation == simulate(ours).peak_activation


def test_the_torch_submodule_does_not_shadow_torch_inside_the_package():
    import pipeoffload.runtime.offloader as offloader_module
    import pipeoffload.torch as adapter

    assert adapter.__name__ == "pipeoffload.torch"
    assert offloader_module.torch is torch
    assert adapter.PipeOffloadSchedule.__module__ == "pipeoffload.integrations.torch_schedule"
