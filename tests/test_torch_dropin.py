"""pipeoffload.torch's drop-in classes in the scenarios of torch's own pipelining tests, on one
process (a one-rank gloo group, as torch's single-stage tests use one): every class with one
rank's stages, evaluation then training, custom callbacks (``OVERLAP_F_B`` for DualPipeV), the
compile guard, stages built with ``device="cpu"``; each with and without offload, gradients
bitwise those of torch's own class. Multi-rank runs: tests/test_torch_adapter.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from torch import nn  # noqa: E402

from pipeoffload.api import build_schedule  # noqa: E402
from pipeoffload.core.actions import Kind  # noqa: E402
from pipeoffload.errors import IntegrationError  # noqa: E402
from pipeoffload.runtime.config import OffloadConfig  # noqa: E402

try:
    import pipeoffload.torch as ours
except IntegrationError as refusal:
    pytest.skip(str(refusal), allow_module_level=True)
from torch.distributed.pipelining import PipelineStage, schedules  # noqa: E402

WIDTH, BATCH, MICROBATCHES = 8, 8, 4
# torch's class name -> stages on the one rank
CLASSES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 1, "LoopedBFS": 1,
           "InterleavedZeroBubble": 1, "ZBVZeroBubble": 2, "DualPipeV": 2}
SPLIT = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_CLASSES = ("ZBVZeroBubble", "DualPipeV")
# On one rank, offload "all" plans OFFLOAD where a backward is not next: not in 1F1B's F B F B.
OFFLOADS_ON_ONE_RANK = ("GPipe", "LoopedBFS", "ZBVZeroBubble", "DualPipeV")
OFFLOAD = {"offload": "all", "offload_config": OffloadConfig(min_offload_elements=0)}


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def modules(count: int) -> list[nn.Module]:
    out = []
    for index in range(count):
        torch.manual_seed(10 + index)
        out.append(nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(),
                                 nn.Linear(2 * WIDTH, WIDTH)).double())
    return out


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return (torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64),
            torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float64))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def build(name: str, theirs: bool, mods: list[nn.Module], **options):
    stages = [PipelineStage(m, s, len(mods), "cpu") for s, m in enumerate(mods)]
    if theirs:
        cls = getattr(schedules, f"Schedule{name}")
        single = issubclass(cls, schedules.PipelineScheduleSingle)
        return cls(stages[0] if single else stages, MICROBATCHES, loss_fn=mse,
                   **{k: v for k, v in options.items() if k == "scale_grads"})
    return getattr(ours, f"Schedule{name}")(stages, MICROBATCHES, loss_fn=mse, **options)


def train(name: str, theirs: bool, steps: int = 2, evaluate: bool = False, **options):
    """Gradients, the last step's output and losses (after ``evaluate`` runs of eval())."""
    mods = modules(CLASSES[name])
    pipe = build(name, theirs, mods, **options)
    x, y = batch()
    for _ in range(2 if evaluate else 0):
        eval_losses: list[torch.Tensor] = []
        pipe.eval(x, target=y, losses=eval_losses)
        assert len(eval_losses) == MICROBATCHES
        assert all(p.grad is None for m in mods for p in m.parameters())
    for _ in range(steps):
        for m in mods:
            m.zero_grad()
        losses: list[torch.Tensor] = []
        out = pipe.step(x, target=y, losses=losses)
    return [p.grad for m in mods for p in m.parameters()], out, losses, pipe


def reference(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and mean loss of the unsplit stages on the whole batch."""
    x, y = batch()
    h = x
    for m in modules(CLASSES[name]):
        h = m(h)
    return h, mse(h, y)


@pytest.mark.parametrize("offload", [False, True], ids=["plain", "offload"])
@pytest.mark.parametrize("name", sorted(CLASSES))
def test_one_rank_every_class_is_torchs_bitwise(name: str, offload: bool) -> None:
    """torch's test_schedule_with_single_stage (the V classes with their two stages), stages
    built with ``device="cpu"``: output and losses as the unsplit model's, gradients as torch's
    own class's."""
    grads, out, losses, pipe = train(name, False, **(OFFLOAD if offload else {}))
    native, native_out, native_losses, _ = train(name, True)
    assert all(torch.equal(a, b) for a, b in zip(grads, native, strict=True))
    assert torch.equal(out, native_out)
    assert torch.equal(torch.stack(losses), torch.stack(native_losses))
    ref_out, ref_loss = reference(name)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.stack(losses).mean(), ref_loss, rtol=0, atol=1e-12)
    planned = offload and name in OFFLOADS_ON_ONE_RANK
    assert pipe.schedule.has_kind(Kind.OFFLOAD) == planned
    assert (pipe.offloader is not None) == planned
    if planned:
        assert pipe.offloader.host_pool_bytes > 0


@pytest.mark.parametrize("offload", [False, True], ids=["plain", "offload"])
@pytest.mark.parametrize("name", sorted(CLASSES))
def test_eval_then_train_every_class(name: str, offload: bool) -> None:
    """torch's test_schedule_eval_then_train: two eval() runs change no gradient, and training
    after them is torch's. torch's V classes fail in eval() where a rank hands a backward to its
    own other stage (Note: [forwards only]); ours run, so they compare with torch's training."""
    grads, _, _, _ = train(name, False, evaluate=True, **(OFFLOAD if offload else {}))
    native, _, _, _ = train(name, True, evaluate=name not in V_CLASSES)
    assert all(torch.equal(a, b) for a, b in zip(grads, native, strict=True))
    if name in V_CLASSES:
        with pytest.raises(AssertionError, match="doesn't have backward"):
            train(name, True, steps=0, evaluate=True)


def test_forward_only_runs_forwards_and_refuses_a_loss() -> None:
    mods = modules(1)
    pipe = ours.ScheduleForwardOnly(PipelineStage(mods[0], 0, 1, "cpu"), MICROBATCHES)
    x, y = batch()
    out = pipe.step(x)
    torch.testing.assert_close(out, mods[0](x), rtol=0, atol=1e-12)
    assert all(p.grad is None for p in mods[0].parameters())
    with pytest.raises(RuntimeError, match="does not support loss computation"):
        pipe.step(x, target=y)


def _forward_callback(calls: list):
    """torch's test_custom_function_callback's FORWARD callback: the forward as torch's runtime
    runs it, on stages of one rank (no receives), counted."""
    def forward(action, ctx) -> None:  # noqa: ANN001
        schedule = ctx.schedule_ref
        by_index = {s.stage_index: s for s in schedule._stages}
        stage, mb = by_index[action.stage_index], action.microbatch_index
        calls.append((action.stage_index, mb))
        output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb])
        schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
        if action.stage_index + 1 in by_index:
            by_index[action.stage_index + 1].set_local_fwd_input(output, mb)
    return forward


def _overlap_callback(forward, pairs: list):
    """torch's test's OVERLAP_F_B callback: the pair's forward through ``forward``, then its full
    backward as torch's runtime runs it."""
    def overlap(action, ctx) -> None:  # noqa: ANN001
        schedule = ctx.schedule_ref
        by_index = {s.stage_index: s for s in schedule._stages}
        f, b = action.sub_actions
        forward(f, ctx)
        pairs.append((f.stage_index, f.microbatch_index, b.stage_index, b.microbatch_index))
        stage, mb = by_index[b.stage_index], b.microbatch_index
        loss = schedule._maybe_get_loss(stage, mb)
        schedule.backward_counter[b.stage_index] += 1
        last = schedule.backward_counter[b.stage_index] == schedule._n_microbatches
        stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last)
        if b.stage_index - 1 in by_index:
            by_index[b.stage_index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)
    return overlap


@pytest.mark.parametrize("offload", [False, True], ids=["plain", "offload"])
@pytest.mark.parametrize("name", sorted(CLASSES))
def test_custom_callbacks_run_as_in_torch(name: str, offload: bool) -> None:
    """torch's test_custom_function_callback for every class: a FORWARD callback runs every
    forward (and, for DualPipeV, an OVERLAP_F_B callback every overlapped pair) with torch's
    gradients (torch's single-stage classes take no callbacks: theirs run without)."""
    results = {}
    for theirs in (False, True):
        calls: list = []
        pairs: list = []
        mods = modules(CLASSES[name])
        pipe = build(name, theirs, mods, scale_grads=False,
                     **(OFFLOAD if offload and not theirs else {}))
        if hasattr(pipe, "register_custom_function"):
            forward = _forward_callback(calls)
            pipe.register_custom_function(schedules.FORWARD, forward)
            if name == "DualPipeV":
                pipe.register_custom_function(schedules.OVERLAP_F_B,
                                              _overlap_callback(forward, pairs))
        x, y = batch()
        pipe.step(x, target=y)
        results[theirs] = ([p.grad for m in mods for p in m.parameters()], calls, pairs)
    (grads, calls, pairs), (native, native_calls, native_pairs) = results[False], results[True]
    assert all(torch.equal(a, b) for a, b in zip(grads, native, strict=True))
    assert len(calls) == CLASSES[name] * MICROBATCHES
    assert calls == native_calls or name in ("GPipe", "1F1B")
    assert pairs == native_pairs and (len(pairs) > 0) == (name == "DualPipeV")


def test_dualpipev_schedule_runs_pairs_as_overlap_actions() -> None:
    """PipeOffloadSchedule over a dualpipev Schedule issues OVERLAP_F_B for the pairs it is
    told about, offload spliced around them."""
    from pipeoffload.core.families.dualpipev import dualpipev_overlapped

    schedule = build_schedule("dualpipev", pp=1, microbatches=MICROBATCHES, offload="all")
    pairs = dualpipev_overlapped(1, MICROBATCHES)
    stages = [PipelineStage(m, s, 2, "cpu") for s, m in enumerate(modules(2))]
    pipe = ours.PipeOffloadSchedule(stages, schedule, loss_fn=mse, overlapped=pairs,
                                    offload_config=OffloadConfig(min_offload_elements=0))
    lowered = pipe.pipeline_order_with_comms[0]
    overlaps = [a for a in lowered if a.computation_type == schedules.OVERLAP_F_B]
    assert len(overlaps) == len(pairs) > 0
    kinds = [str(a.computation_type.value) for a in lowered]
    assert kinds.count("OFFLOAD") == sum(a.kind is Kind.OFFLOAD for a in schedule.ranks[0]) > 0


@pytest.mark.parametrize("name", SPLIT)
def test_split_backward_classes_refuse_compiled_stages_as_torch(name: str) -> None:
    """torch's test_zero_bubble_schedule_errors_with_compile, and the same guard in
    PipeOffloadSchedule for any schedule with I / W (po-f here); 1F1B's B is allowed."""
    compiled = [torch.compile(m) for m in modules(CLASSES[name])]
    stages = [PipelineStage(m, s, len(compiled), "cpu") for s, m in enumerate(compiled)]
    with pytest.raises(RuntimeError, match="not supported with stage modules that have used "
                                           "torch.compile") as torchs:
        getattr(schedules, f"Schedule{name}")(stages, MICROBATCHES)
    with pytest.raises(RuntimeError) as mine:
        getattr(ours, f"Schedule{name}")(stages, MICROBATCHES)
    assert str(mine.value).replace(name, "") == str(torchs.value).replace(name, "")
    po_f = build_schedule("po-f", pp=1, microbatches=MICROBATCHES)
    one = [PipelineStage(m, s, po_f.num_stages, "cpu") for s, m in enumerate(
        torch.compile(m) for m in modules(po_f.num_stages))]
    with pytest.raises(RuntimeError, match="'po-f' \\(I / W split\\) schedule is not supported"):
        ours.PipeOffloadSchedule(one, po_f, loss_fn=mse)
    ours.Schedule1F1B([PipelineStage(torch.compile(modules(1)[0]), 0, 1, "cpu")], MICROBATCHES)


def test_string_device_with_offload() -> None:
    """A stage built with device="cpu" (a string, as torch's tests pass it), offload on."""
    schedule = build_schedule("po-f", pp=1, microbatches=MICROBATCHES)
    mods = modules(schedule.num_stages)
    stages = [PipelineStage(m, s, len(mods), "cpu") for s, m in enumerate(mods)]
    pipe = ours.PipeOffloadSchedule(stages, schedule, loss_fn=mse,
                                    offload_config=OffloadConfig(min_offload_elements=0))
    x, y = batch()
    pipe.step(x, target=y)
    assert pipe.offloader is not None and pipe.offloader.host_pool_bytes > 0


def test_one_stage_per_rank_under_interleaved_names() -> None:
    """torch's interleaved classes take one stage per rank; so do ours, with torch's order
    (warm-up 2(p-r-1) forwards, tests/test_torch_orders.py)."""
    schedule = build_schedule("interleaved-1f1b", pp=4, microbatches=8, chunks=1)
    assert [sum(a.kind is Kind.F for a in row[:row.index(next(
        a for a in row if a.kind is Kind.B))]) for row in schedule.ranks] == [7, 5, 3, 1]
    for name in ("Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS"):
        pipe = build(name, False, modules(1))
        assert pipe.schedule.num_stages == 1


def test_stand_in_stages_build_the_order() -> None:
    """Stages with only what torch's _PipelineStageBase stand-ins carry (no stage_index, no
    module): the order and its lowering are built, for every rank."""
    from test_torch_orders import StandIn

    schedule = build_schedule("po-f", pp=4, microbatches=8)
    pipe = ours.PipeOffloadSchedule([StandIn(8, 4), StandIn(8, 4)], schedule)
    assert sorted(pipe.pipeline_order_with_comms) == [0, 1, 2, 3]
    assert [len(row) for row in pipe.pipeline_order.values()] == \
        [sum(a.kind.is_compute for a in row) for row in schedule.ranks]


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_same_class_from_a_torch_schedule(name: str) -> None:
    """The torchtitan hook's swap (docs/torchtitan.md): our class of the torch schedule's name
    over its stages and loss, offload added, gives its gradients."""
    mods = modules(CLASSES[name])
    native = build(name, True, mods)
    pipe = ours.get_schedule_class(type(native).__name__).from_torch(native, **OFFLOAD)
    assert type(pipe).__name__ == type(native).__name__
    x, y = batch()
    pipe.step(x, target=y)
    grads = [p.grad.clone() for m in mods for p in m.parameters()]
    expected, _, _, _ = train(name, True, steps=1)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected, strict=True))
