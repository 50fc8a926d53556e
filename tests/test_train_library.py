"""The library pieces around Pipeline, in one process: forward-only evaluation, clipping with
tied parameters counted once, cutting blocks into stages, per-stage checkpoints."""

from __future__ import annotations

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")

from hypothesis import given, settings
from hypothesis import strategies as st
from test_runtime_support import one_thread  # noqa: F401 - autouse fixture

import pipeoffload as po
from pipeoffload.errors import ConfigError
from pipeoffload.parallel.checkpoint import CheckpointError
from pipeoffload.runtime.blocks import balanced_ranges
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.training.model import lm_loss
from pipeoffload.training.model_config import model_preset
from pipeoffload.training.split import build_stage_modules

SCHEDULES = (("1f1b", {}), ("zbv", {}), ("interleaved-1f1b", {}), ("po-f", {}),
             ("zb-h1", {"offload": "all"}))


@pytest.mark.parametrize("name,options", SCHEDULES, ids=[s for s, _ in SCHEDULES])
def test_evaluate_gives_the_steps_loss_and_touches_nothing(name, options):
    schedule = po.build_schedule(name, pp=2, microbatches=4, **options)
    stages = build_stage_modules(model_preset("tiny"), schedule.num_stages,
                                 range(schedule.num_stages), 0, dtype=torch.float64)
    meter = ActivationMeter()
    pipe = po.Pipeline(stages, schedule, lm_loss, meter=meter)
    ids = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]
    evaluated = pipe.evaluate(x, target=y)
    assert all(p.grad is None for m in stages.values() for p in m.parameters())
    assert meter.peak_bytes(0) == 0 and not meter.scope_bytes
    assert torch.equal(pipe.step(x, target=y), evaluated)
    grads = [p.grad.clone() for m in stages.values() for p in m.parameters()]
    assert torch.equal(pipe.evaluate(x, target=y), evaluated)  # and again after a step
    assert all(torch.equal(p.grad, g) for p, g in
               zip((p for m in stages.values() for p in m.parameters()), grads))


def _hf_llama(tied: bool):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24,
                                      num_hidden_layers=4, num_attention_heads=2,
                                      num_key_value_heads=1, head_dim=8,
                                      tie_word_embeddings=tied)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_clip_grad_norm_counts_a_tie_once_and_matches_torch(tied):
    from pipeoffload.hf import causal_lm_loss, split_causal_lm

    model = _hf_llama(tied)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(2))
    schedule = po.build_schedule("1f1b", pp=2, microbatches=2)
    stages = split_causal_lm(model, schedule)
    po.Pipeline(stages, schedule, causal_lm_loss).step(ids, target=ids)
    norm = po.clip_grad_norm_(stages, 0.1)
    loss = sum(causal_lm_loss(reference(input_ids=x).logits, x) for x in ids.chunk(2)) / 2
    loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1).item()
    assert abs(norm - expected) < 1e-12 * expected
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-14), name


def test_a_tie_held_as_two_copies_is_counted_once():
    """train's HF stages hold a tie as one copy per stage (Note: [HF stages]): the copy on the
    higher stage is scaled but not counted."""
    from pipeoffload.parallel.gradients import clip_gradients, tie_copies

    a, b = torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False)
    b.weight = torch.nn.Parameter(a.weight.detach().clone())
    stages = {0: torch.nn.Sequential(a), 1: torch.nn.Sequential(b)}
    tie = {"w": {0: "0.weight", 1: "0.weight"}}
    assert tie_copies(stages, tie) == {id(b.weight)}
    for p in (a.weight, b.weight):
        p.grad = torch.full((3, 3), 2.0)
    assert po.clip_grad_norm_(stages, 1.0, tied=tie) == pytest.approx(6.0)
    assert torch.equal(a.weight.grad, b.weight.grad)
    assert a.weight.grad[0, 0].item() == pytest.approx(2.0 / 6.0, rel=1e-6)
    assert clip_gradients([a.weight], None, None) == pytest.approx(1.0, rel=1e-6)


@settings(max_examples=40, deadline=None)
@given(blocks=st.integers(1, 20), stages=st.integers(1, 20))
def test_balanced_ranges_cover_the_blocks_evenly(blocks, stages):
    if blocks < stages:
        with pytest.raises(ConfigError, match="every stage needs at least one"):
            balanced_ranges(blocks, stages)
        return
    ranges = balanced_ranges(blocks, stages)
    assert [i for r in ranges for i in r] == list(range(blocks))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_split_blocks_places_first_and_last_and_keeps_the_modules():
    blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(5))
    first, last = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8)
    schedule = po.build_schedule("zbv", pp=2, microbatches=4)  # V: rank 0 holds 0 and 3
    stages = po.split_blocks(blocks, schedule, first=first, last=last)
    assert [len(stages[s]) for s in range(4)] == [3, 1, 1, 2]
    assert stages[0][0] is first and stages[3][-1] is last and stages[0][1] is blocks[0]
    assert sorted(po.split_blocks(blocks, schedule, rank=0)) == [0, 3]
    with pytest.raises(ConfigError, match="rank=2"):
        po.split_blocks(blocks, schedule, rank=2)
    with pytest.raises(ConfigError, match="DualPipe"):
        po.split_blocks(blocks, po.build_schedule("dualpipe", pp=2, microbatches=4))
    with pytest.raises(ConfigError, match="nn.Modules"):
        po.split_blocks([torch.nn.Linear(2, 2), "relu"], schedule)


def test_stage_checkpoints_round_trip_and_refuse_another_model(tmp_path):
    schedule = po.build_schedule("1f1b", pp=2, microbatches=2)
    stages = build_stage_modules(model_preset("tiny"), 2, range(2), 0)
    optimizers = {s: torch.optim.AdamW(m.parameters(), lr=1e-2) for s, m in stages.items()}
    ids = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(0))
    pipe = po.Pipeline(stages, schedule, lm_loss)
    pipe.step(ids[:, :-1], target=ids[:, 1:])
    for optimizer in optimizers.values():
        optimizer.step()
    folder = po.save_checkpoint(tmp_path, 7, stages, optimizers, info={"model": "tiny"})
    assert folder.name == "step_00000007" and (folder / "manifest.json").is_file()
    fresh = build_stage_modules(model_preset("tiny"), 2, range(2), 1)
    fresh_opt = {s: torch.optim.AdamW(m.parameters(), lr=1e-2) for s, m in fresh.items()}
    assert po.load_checkpoint(tmp_path, fresh, fresh_opt, info={"model": "tiny"}) == 7
    for s in stages:
        for (name, a), b in zip(stages[s].state_dict().items(), fresh[s].state_dict().values()):
            assert torch.equal(a, b), name
        assert fresh_opt[s].state_dict()["state"][0]["step"] == 1
    with pytest.raises(CheckpointError, match="model: checkpoint 'tiny', now 'small'"):
        po.load_checkpoint(folder, fresh, fresh_opt, info={"model": "small"})
