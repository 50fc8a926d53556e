"""The runtime moves and recomputes tensor classes (issue 36): saved tensors tagged by the
module that saved them, only the chosen classes offloaded, the recomputed ones made again at
the first backward pass; gradients bitwise equal to no offload; the meter equals the simulator
per class (relative 1e-12: the simulator multiplies a stage's bytes by each class's share).
Local mode, pp = 2, the reference model and a Hugging Face Llama config."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_runtime_support import one_thread  # noqa: F401 - autouse fixture

import pipeoffload as po
from pipeoffload.core.actions import OFFLOAD_KINDS, Kind
from pipeoffload.core.classes import ClassChoice, TensorClass
from pipeoffload.errors import ConfigError
from pipeoffload.hf import causal_lm_loss, split_causal_lm
from pipeoffload.offload.class_plan import ClassSearch, plan_classes
from pipeoffload.offload.plan import add_offload
from pipeoffload.planner.tensor_classes import TRAIN_RECOMPUTES
from pipeoffload.runtime.classes import OTHER
from pipeoffload.runtime.config import OffloadConfig, RuntimeConfig
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.pipeline import Pipeline
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.simulator import simulate
from pipeoffload.training.model import lm_loss
from pipeoffload.training.model_config import ModelConfig
from pipeoffload.training.split import build_stage_modules

MICROBATCHES, BATCH, SEQ, VOCAB = 4, 8, 6, 32
CHOSEN = ("layer_input", "qkv", "mlp_hidden")
CONFIG = RuntimeConfig(offload=OffloadConfig(min_offload_elements=0, measure_classes=True))


def reference_model(schedule):  # noqa: ANN001, ANN201
    config = ModelConfig(vocab_size=VOCAB, dim=16, n_layers=4, n_heads=2, n_kv_heads=1,
                         ffn_hidden=24, max_seq_len=SEQ)
    stages = build_stage_modules(config, schedule.num_stages, range(schedule.num_stages), 0,
                                 dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return stages, lm_loss, ids, ids


def llama(schedule):  # noqa: ANN001, ANN201
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
                                      num_hidden_layers=4, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=8,
                                      max_position_embeddings=SEQ)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return split_causal_lm(model, schedule), causal_lm_loss, {"input_ids": ids}, ids


def step(make, schedule, meter=None):  # noqa: ANN001, ANN201
    """One step on fresh, identical stages: their gradients and the pipeline."""
    stages, loss_fn, inputs, target = make(schedule)
    pipe = Pipeline(stages, schedule, loss_fn, config=CONFIG, meter=meter)
    pipe.step(inputs, target=target)
    return [p.grad for s in stages.values() for p in s.parameters()], pipe


RECOMPUTED = ("attn_norm", "mlp_norm", "mlp_hidden", "mlp_act")


def with_recompute(schedule, sizes, moved, recomputed):  # noqa: ANN001, ANN201
    """``schedule`` with every item moving ``moved`` (where it offloads) and recomputing
    ``recomputed``, each class's share its measured bytes over its stage's."""
    choices = {}
    for (stage, mb), tags in sizes.items():
        total = sum(tags.values())
        classes = {name: TensorClass(name, nbytes / total, 0.01 if name in recomputed else None)
                   for name, nbytes in sorted(tags.items())}
        choices[(stage, mb)] = ClassChoice(
            tuple(c for name, c in classes.items() if name in moved),
            tuple(c for name, c in classes.items() if name in recomputed))
    return schedule.with_classes(choices)


@pytest.mark.parametrize("make", [reference_model, llama], ids=["reference", "llama"])
@pytest.mark.parametrize("name", ["1f1b", "po-f"])
def test_class_offload_is_bitwise_and_meter_equals_simulator(make, name: str) -> None:
    options = {"offload_ratio": 0.5} if name == "po-f" else {"offload": "all"}
    offloaded = po.build_schedule(name, pp=2, microbatches=MICROBATCHES, **options)
    assert offloaded.has_kind(Kind.OFFLOAD)
    bare = offloaded.without(*OFFLOAD_KINDS)
    expected, _ = step(make, bare)
    # every class moved: what whole-chunk offload does, with the classes measured
    everything = offloaded.with_classes({})
    grads, pipe = step(make, everything)
    assert all(torch.equal(a, b) for a, b in zip(expected, grads))
    sizes = {key: tags for key, tags in pipe.offloader.class_bytes.items()}
    tags = set().union(*map(set, sizes.values()))
    # (HF's attention output is the attention core's own output storage, saved first by the
    # core: one storage, one class, qkv)
    assert {"layer_input", "attn_norm", "qkv", "mlp_input", "mlp_norm", "mlp_hidden",
            "mlp_act"} <= tags and OTHER in tags
    # some classes moved
    chosen = with_recompute(offloaded, sizes, CHOSEN, ())
    meter = ActivationMeter()
    grads, pipe = step(make, chosen, meter)
    assert all(torch.equal(a, b) for a, b in zip(expected, grads))
    assert pipe.offloader.kept_bytes.get("kept by class choice", 0) > 0
    per_stage = meter.stage_activation_bytes(chosen.num_stages)
    for (stage, _), measured in sizes.items():
        assert sum(measured.values()) == per_stage[stage]
    predicted = simulate(chosen, CostModel(stage_activation_bytes=per_stage)).peak_bytes
    measured_peaks = [meter.peak_bytes(r) for r in range(chosen.num_ranks)]
    assert measured_peaks == pytest.approx(predicted, rel=1e-12)
    whole = simulate(offloaded, CostModel(stage_activation_bytes=per_stage)).peak_bytes
    none = simulate(bare, CostModel(stage_activation_bytes=per_stage)).peak_bytes
    assert all(w <= m <= n for w, m, n in zip(whole, measured_peaks, none))
    assert whole[0] < measured_peaks[0] < none[0]  # rank 0 offloads, in part


@pytest.mark.parametrize("make", [reference_model, llama], ids=["reference", "llama"])
@pytest.mark.parametrize("name", ["1f1b", "po-f", "zbv"])
@pytest.mark.parametrize("offload", [True, False], ids=["offload", "recompute-only"])
def test_recomputed_classes_are_bitwise_and_meter_equals_simulator(make, name: str,
                                                                   offload: bool) -> None:
    """Classes dropped after the forward and made again at the first backward pass (with
    other classes moved, or alone): gradients bitwise, meter == simulator per rank, and rank
    0's peak below the same plan without the recompute, no rank's above."""
    options = {"offload_ratio": 0.5} if name == "po-f" else {"offload": "all"}
    offloaded = po.build_schedule(name, pp=2, microbatches=MICROBATCHES, **options)
    bare = offloaded.without(*OFFLOAD_KINDS)
    expected, _ = step(make, bare)
    _, pipe = step(make, offloaded.with_classes({}))
    sizes = pipe.offloader.class_bytes
    base = offloaded if offload else bare
    moved = ("layer_input", "qkv") if offload else ()
    peaks = []
    for recomputed in (RECOMPUTED, ()):
        chosen = with_recompute(base, sizes, moved, recomputed)
        meter = ActivationMeter()
        grads, pipe = step(make, chosen, meter)
        assert all(torch.equal(a, b) for a, b in zip(expected, grads))
        per_stage = meter.stage_activation_bytes(chosen.num_stages)
        for (stage, _), measured in sizes.items():
            assert sum(measured.values()) == per_stage[stage]
        predicted = simulate(chosen, CostModel(stage_activation_bytes=per_stage)).peak_bytes
        peaks.append([meter.peak_bytes(r) for r in range(chosen.num_ranks)])
        assert peaks[-1] == pytest.approx(predicted, rel=1e-12)
    # (the last rank of 1f1b peaks at a B's start, all of one activation back)
    assert all(a <= b for a, b in zip(*peaks)) and peaks[0][0] < peaks[1][0]


def test_a_chunk_recomputed_whole_and_by_class_is_refused() -> None:
    schedule = po.build_schedule("1f1b", pp=2, microbatches=MICROBATCHES,
                                 offload="recompute-chunks:1+all")
    item = next((a.stage, a.microbatch) for actions in schedule.ranks for a in actions
                if a.kind is Kind.RECOMPUTE)
    choice = ClassChoice((), (TensorClass("attn_norm", 0.1, 0.01),))
    with pytest.raises(ConfigError, match=rf"{re.escape(str(item))} has a RECOMPUTE of its "
                                          "whole chunk and a class choice"):
        step(reference_model, schedule.with_classes({item: choice}))


def test_class_recompute_under_context_parallelism_is_refused() -> None:
    """A context-parallel forward all-gathers keys and values, which a recompute on one rank
    cannot repeat: refused as the Pipeline is made, before any step."""
    from pipeoffload.runtime.sequence import SequenceSplit

    bare = po.build_schedule("1f1b", pp=2, microbatches=MICROBATCHES)
    choice = ClassChoice((), (TensorClass("mlp_act", 0.1, 0.01),))
    stages, loss_fn, _, _ = reference_model(bare)
    with pytest.raises(ConfigError, match="without tensor or context parallelism"):
        Pipeline(stages, bare.with_classes({(0, 0): choice}), loss_fn, config=CONFIG,
                 context=SequenceSplit(2, 0))


def test_a_recompute_runs_only_the_steps_between_saved_tensors() -> None:
    """Each class's recompute runs the ops from the saved tensors before it: a norm's scaling,
    the activation's multiply, the MLP's first matmuls, never the whole forward."""
    bare = po.build_schedule("1f1b", pp=2, microbatches=MICROBATCHES)
    ran = {}
    for name in ("attn_norm", "mlp_act", "mlp_hidden"):
        choice = ClassChoice((), (TensorClass(name, 0.1, 0.01),))
        schedule = bare.with_classes({(s, m): choice for s in range(2)
                                      for m in range(MICROBATCHES)})
        _, pipe = step(reference_model, schedule)
        ran[name] = pipe.offloader.recomputed_ops[(1, MICROBATCHES - 1)]
    # stage 1 has two layers: each op twice
    assert sorted(set(ran["attn_norm"])) == ["aten.mul.Tensor", "aten.view.default"]
    assert ran["mlp_act"].count("aten.mul.Tensor") == 2 and "aten.mm.default" not in ran["mlp_act"]
    assert ran["mlp_hidden"].count("aten.mm.default") == 4  # w1 and w3 of each layer
    assert ran["mlp_hidden"].count("aten.silu.default") == 2


def test_recomputed_attention_with_dropout_draws_the_same_numbers() -> None:
    """An attention core with dropout, recomputed: its random draws are replayed from the
    generator's state as they ran, so the gradients equal the plain step's bit for bit."""
    def dropout_llama(seed):  # noqa: ANN001, ANN202
        def make(schedule):  # noqa: ANN001, ANN202
            stages, loss_fn, inputs, target = llama(schedule)
            for stage in stages.values():
                for module in stage.modules():
                    if hasattr(module, "attention_dropout"):
                        module.attention_dropout = 0.5
                stage.train()
            torch.manual_seed(seed)
            return stages, loss_fn, inputs, target
        return make

    bare = po.build_schedule("1f1b", pp=2, microbatches=MICROBATCHES)
    expected, _ = step(dropout_llama(5), bare)
    choice = ClassChoice((), (TensorClass("qkv", 0.3, 0.1),))
    grads, pipe = step(dropout_llama(5), bare.with_classes(
        {(s, m): choice for s in range(2) for m in range(MICROBATCHES)}))
    assert any("bernoulli" in op for op in pipe.offloader.recomputed_ops[(0, 0)])
    assert all(torch.equal(a, b) for a, b in zip(expected, grads))
    other, _ = step(dropout_llama(6), bare)  # the dropout is live: other draws, other grads
    assert not all(torch.equal(a, b) for a, b in zip(expected, other))


@pytest.mark.parametrize("recompute", [False, True], ids=["offload", "offload+recompute"])
def test_budget_plan_meets_its_budget_in_the_measured_peak(recompute: bool) -> None:
    """A byte budget between whole-chunk offload's peak and none's, at a copy ratio where whole
    chunks cannot hide: the class plan meets it in the simulator and in the meter. With
    recompute, a budget at the last rank's floor, which moving classes alone does not meet."""
    offloaded = po.build_schedule("1f1b", pp=2, microbatches=MICROBATCHES, offload="all")
    bare = offloaded.without(*OFFLOAD_KINDS)
    _, pipe = step(reference_model, offloaded)
    measured = {stage: tags for (stage, mb), tags in pipe.offloader.class_bytes.items()
                if mb == 0}
    classes = {stage: [TensorClass(t, n / sum(tags.values()),
                                   0.02 if t in TRAIN_RECOMPUTES else None)
                       for t, n in sorted(tags.items())]
               for stage, tags in measured.items()}
    meter = ActivationMeter()
    expected, _ = step(reference_model, bare, meter)
    sizes = meter.stage_activation_bytes(bare.num_stages)
    costs = CostModel(stage_activation_bytes=sizes, offload_ratio=0.4)
    none = simulate(bare, costs).peak_bytes
    free = add_offload(bare, CostModel(stage_activation_bytes=sizes), "all").result.peak_bytes
    assert max(add_offload(bare, costs, "all").result.peak_bytes) == max(none)  # none hides
    budget = max(none[1:]) if recompute else max((none[0] + free[0]) / 2, *none[1:])
    found = plan_classes(bare, costs, classes, ClassSearch(budget=budget, in_bytes=True,
                                                            recompute=recompute))
    assert found.met and found.plan.schedule.classes
    assert bool(found.choice.recomputed) == recompute
    if recompute:
        assert not plan_classes(bare, costs, classes, ClassSearch(
            budget=budget, in_bytes=True, recompute=False)).met
    meter = ActivationMeter()
    grads, _ = step(reference_model, found.plan.schedule, meter)
    assert all(torch.equal(a, b) for a, b in zip(expected, grads))
    assert max(meter.peak_bytes(r) for r in range(bare.num_ranks)) <= budget


@pytest.mark.parametrize("recomputed", [(), ("attn_norm", "mlp_norm", "mlp_act")],
                         ids=["moved", "moved+recomputed"])
def test_fetched_classes_are_bitwise_and_meter_equals_simulator(recomputed) -> None:  # noqa: ANN001
    """FETCH of the chosen classes (read on use), the rest kept or recomputed (the replay
    reads fetched tensors as the backward does): the same exactness."""
    from test_runtime_support import with_offload

    plain = po.build_schedule("1f1b", pp=2, microbatches=MICROBATCHES)
    fetched = with_offload(plain, stages={0}, back=Kind.FETCH)
    expected, _ = step(reference_model, plain)
    _, pipe = step(reference_model, fetched)
    chosen = with_recompute(fetched, pipe.offloader.class_bytes, CHOSEN, recomputed)
    meter = ActivationMeter()
    grads, _ = step(reference_model, chosen, meter)
    assert all(torch.equal(a, b) for a, b in zip(expected, grads))
    sizes = meter.stage_activation_bytes(chosen.num_stages)
    predicted = simulate(chosen, CostModel(stage_activation_bytes=sizes)).peak_bytes
    assert [meter.peak_bytes(r) for r in range(2)] == pytest.approx(predicted, rel=1e-12)
