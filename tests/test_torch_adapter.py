"""pipeoffload.torch: our schedules, offload included, inside torch.distributed.pipelining's
runtime over real PipelineStages (gloo), against the same schedule without offload, torch's own
schedule and plain autograd; what each tested torch version adds (send waits, pre-split step()
inputs). On a torch the adapter was not tested on, the module is skipped with the adapter's
refusal as the reason (tests/test_torch_versions.py checks the refusal itself)."""

from __future__ import annotations

import inspect

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
from pipeoffload.core.validate import validate
from pipeoffload.errors import ConfigError, IntegrationError
from pipeoffload.offload.plan import OffloadPolicy
from pipeoffload.runtime.config import OffloadConfig

try:
    from pipeoffload.torch import PipeOffloadSchedule
except IntegrationError as refusal:
    pytest.skip(str(refusal), allow_module_level=True)
from pipeoffload.integrations.torch_schedule import _check_send_waits
from pipeoffload.integrations.torch_versions import torch_pipelining

TORCH = torch_pipelining(torch.__version__)

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


def run(rank: int, schedule, torch_class: str | None = None, device: str = "cpu",
        pre_split: dict | None = None):
    """Gradients per stage of this rank after one step, and the schedule object used.
    ``pre_split``: step with the microbatches already split (torch >= 2.14's ``arg_mbs`` /
    ``target_mbs``), plus these keyword arguments."""
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
    if pre_split is None:
        args = (x,) if first else ()
        pipe.step(*args, target=y if last else None, losses=losses if last else None)
    else:
        pipe.step(arg_mbs=[(xm,) for xm in x.chunk(MICROBATCHES)] if first else None,
                  target_mbs=list(y.chunk(MICROBATCHES)) if last else None,
                  losses=losses if last else None, **pre_split)
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


def _two_ranks(rank: int, world: int) -> tuple[list[tuple], list[str], dict]:
    report = _cases(rank, world, CASES_2)
    bitwise, moved = _from_torch_case(rank, world)
    report.append(("from_torch", bitwise, None, 0.0, moved))
    return report, _misuse(rank, world), _this_torch(rank, world)


def _this_torch(rank: int, world: int) -> dict:
    """What the installed torch adds, on po-f with offload: on a torch that retires sends by
    WAIT_SEND (2.15), each SEND of our spliced lists has its wait after it and torch's
    pending-send tracker is empty when the step ends; on a torch whose step() takes pre-split
    microbatches (2.14) they give the same gradients as the whole batch, and so does
    finalize_gradients=False (2.15; it defers only FSDP stages)."""
    from torch.distributed.pipelining import schedules

    left_at_end: list[int] = []
    if TORCH.send_waits:
        class Recording(schedules._PendingSendTracker):
            def assert_empty(self) -> None:
                left_at_end.append(len(self._pending))
                super().assert_empty()

        schedules._PendingSendTracker = Recording  # this process is this test's alone
    schedule = build_schedule("po-f", pp=world, microbatches=MICROBATCHES, offload_ratio=0.5)
    whole, pipe = run(rank, schedule)
    row = [(a.stage_index, str(a.computation_type.value), a.microbatch_index)
           for a in pipe.pipeline_order_with_comms[rank]]
    sends = [i for i, (_, kind, _) in enumerate(row) if kind in ("SEND_F", "SEND_B")]
    waited = [i for i in sends if (row[i][0], "WAIT_" + row[i][1], row[i][2]) in row[i:]]
    out = {"sends": len(sends), "waited": len(waited), "left_at_end": left_at_end,
           "transfers": sum(kind in ("OFFLOAD", "RELOAD") for _, kind, _ in row)}
    if TORCH.send_waits:
        broken = {r: [a for a in actions if a.computation_type != schedules.WAIT_SEND_F]
                  for r, actions in pipe.pipeline_order_with_comms.items()}
        with pytest.raises(IntegrationError) as refused:
            _check_send_waits(broken)
        out["refused"] = str(refused.value)
    step = inspect.signature(pipe.step).parameters
    for name, extra in (("pre_split", {}), ("finalize_gradients", {"finalize_gradients": False})):
        if "arg_mbs" in step and all(k in step for k in extra):
            grads, _ = run(rank, schedule, pre_split=extra)
            out[name] = all(torch.equal(a, b) for s in grads for a, b in zip(grads[s], whole[s]))
    return out


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
        this = outcome["ok"][2]
        assert this["sends"] > 0 and this["transfers"] > 0, this
        if TORCH.send_waits:
            assert this["waited"] == this["sends"] and set(this["left_at_end"]) == {0}, this
            assert "fail torch's send-wait check" in this["refused"], this
            assert "have no matching wait: " in this["refused"], this
        else:
            assert this["waited"] == 0 and "refused" not in this, this
        steps = inspect.signature(torch.distributed.pipelining.schedules
                                  .PipelineScheduleMulti.step).parameters
        assert this.get("pre_split", "arg_mbs" not in steps) is True, this
        assert this.get("finalize_gradients", "finalize_gradients" not in steps) is True, this
    _check({r: {"ok": o["ok"][0]} for r, o in results.items()}, 2)


@pytest.mark.slow
def test_four_ranks_zbv_and_po_f_fetch_are_bitwise_torch_and_plain(tmp_path):
    _check(launch(_four_ranks, 4, tmp_path, join_timeout_s=PATIENCE_S), 4)


class _Head(nn.Module):
    """A last stage like torchtitan's: the final norm; the output layer runs inside the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.out = nn.RMSNorm(WIDTH), nn.Linear(WIDTH, 3 * WIDTH, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)


class _GivenGrad(torch.autograd.Function):
    """A loss value whose backward hands ``h`` a gradient computed beforehand."""

    @staticmethod
    def forward(ctx, h, grad, loss):  # noqa: ANN001
        ctx.save_for_backward(grad)
        return loss.detach()

    @staticmethod
    def backward(ctx, _):  # noqa: ANN001
        return ctx.saved_tensors[0], None, None


def _split_backward_under_fsdp(rank: int, world: int) -> dict:
    """One process, two stages: the last stage's norm and output layer are one FSDP group,
    which the loss reshards (as torchtitan's chunked loss does), and a nested FSDP unit with
    reshard_after_forward=True: every gradient of our schedules with I / W split (po-f with
    offload, zbv) against torch's Interleaved1F1B (full backward). Note: [split FSDP]."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, schedules

    def build(kind: str):
        torch.manual_seed(0)
        body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))
        head = _Head()
        fully_shard(body[1], reshard_after_forward=True)
        fully_shard(body)
        fully_shard([head.norm, head.out])
        fully_shard(head)

        def chunked_loss(h, y):  # noqa: ANN001
            head.out.unshard()
            leaf = h.detach().requires_grad_(True)
            loss = nn.functional.cross_entropy(head.out(leaf), y)
            loss.backward()
            head.out.reshard()  # and with it head.norm
            return _GivenGrad.apply(h, leaf.grad, loss.detach())

        stages = [PipelineStage(body, 0, 2, torch.device("cpu")),
                  PipelineStage(head, 1, 2, torch.device("cpu"))]
        if kind == "torch":
            pipe = schedules.ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=chunked_loss)
        else:
            schedule = build_schedule(kind, pp=1, microbatches=MICROBATCHES)
            pipe = PipeOffloadSchedule(stages, schedule, loss_fn=chunked_loss,
                                       offload_config=OffloadConfig(min_offload_elements=0))
        x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(3))
        y = torch.randint(0, 3 * WIDTH, (BATCH,), generator=torch.Generator().manual_seed(4))
        pipe.step(x, target=y)
        return {name: None if p.grad is None else p.grad.full_tensor()
                for module in (body, head) for name, p in module.named_parameters()}

    native = build("torch")
    return {kind: {name: grad is not None and torch.equal(grad, native[name])
                   for name, grad in build(kind).items()}
            for kind in ("po-f", "zbv")}


@pytest.mark.slow
def test_split_backward_gets_the_gradients_of_fsdp_groups_resharded_before_it(tmp_path):
    results = launch(_split_backward_under_fsdp, 1, tmp_path, join_timeout_s=240)
    assert "ok" in results.get(0, {}), results.get(0, {}).get("trace", results)
    for kind, bitwise in results[0]["ok"].items():
        assert len(bitwise) == 6 and all(bitwise.values()), (kind, bitwise)


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


def test_recompute_points_to_activation_checkpointing():
    schedule = build_schedule("1f1b", pp=1, microbatches=2)
    from pipeoffload.offload.recompute import add_recompute
    from pipeoffload.sim.costs import CostModel

    recomputed = add_recompute(schedule, CostModel(), "all").schedule
    assert recomputed.has_kind(Kind.RECOMPUTE)
    with pytest.raises(ConfigError, match="activation checkpointing"):
        PipeOffloadSchedule([object()], recomputed)


def test_the_torch_submodule_does_not_shadow_torch_inside_the_package():
    import pipeoffload.runtime.offloader as offloader_module
    import pipeoffload.torch as adapter

    assert adapter.__name__ == "pipeoffload.torch"
    assert offloader_module.torch is torch
    assert adapter.PipeOffloadSchedule.__module__ == "pipeoffload.integrations.torch_schedule"
