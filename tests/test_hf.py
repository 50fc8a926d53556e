"""pipeoffload.hf: random-weight Hugging Face causal LMs split into stages by split_causal_lm
and pipelined (local mode and gloo ranks, tied and untied embeddings) give the loss and every
gradient of a single-process run in float64; and the runtime contract's input handling."""

from __future__ import annotations

import copy
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from patience import PATIENCE_S
from test_runtime_support import launch, one_thread  # noqa: F401 - fixture

from pipeoffload import OffloadConfig, Pipeline, RuntimeConfig, build_schedule
from pipeoffload.errors import ConfigError, IntegrationError
from pipeoffload.hf import balanced_layers, causal_lm_loss, split_causal_lm

MICROBATCHES, BATCH, SEQ, VOCAB = 4, 8, 6, 32
CASES = (("1f1b", {}), ("zbv", {}), ("po-f", {"offload_ratio": 0.5}))


def make_model(family: str, tied: bool, layers: int = 8) -> torch.nn.Module:
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=layers, n_head=2,
                                         n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0, tie_word_embeddings=tied)
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config).double()
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    extra = {"sliding_window": 3} if family == "mistral" else {}
    config = config_class(vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
                          num_hidden_layers=layers, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=8, max_position_embeddings=SEQ,
                          tie_word_embeddings=tied, **extra)
    torch.manual_seed(0)
    return model_class(config).double()


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding in one sequence: the mask travels with the hidden states
    mask[5, :1] = 0
    return {"input_ids": ids, "attention_mask": mask}


def reference_grads(model: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean over microbatches of the per-microbatch loss, by plain autograd on a copy."""
    ref = copy.deepcopy(model)
    inputs = batch()
    losses = []
    for ids, mask in zip(inputs["input_ids"].chunk(MICROBATCHES),
                         inputs["attention_mask"].chunk(MICROBATCHES)):
        losses.append(causal_lm_loss(ref(input_ids=ids, attention_mask=mask).logits, ids))
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in ref.named_parameters()}


def run(model: torch.nn.Module, schedule, rank: int | None) -> tuple[float | None, float]:
    """One Pipeline step over ``model``'s stages (all, or this rank's); the loss (where the last
    stage is) and the largest relative gradient error over the parameters held here."""
    loss_ref, grads_ref = reference_grads(model)
    stages = split_causal_lm(model, schedule, rank=rank)
    config = RuntimeConfig(p2p_timeout_s=PATIENCE_S, offload=OffloadConfig(min_offload_elements=0))
    pipe = Pipeline(stages, schedule, causal_lm_loss, config=config)
    model.zero_grad(set_to_none=True)
    loss = pipe.step(batch(), target=batch()["input_ids"])
    held = {id(p) for m in stages.values() for p in m.parameters()}
    worst = 0.0
    for name, p in model.named_parameters():
        if id(p) in held:
            assert p.grad is not None, f"{name} has no gradient"
            ref = grads_ref[name]
            worst = max(worst, ((p.grad - ref).norm() / ref.norm()).item())
    loss_error = None if loss is None else abs(loss.item() - loss_ref) / loss_ref
    return loss_error, worst


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("name,options", CASES, ids=[c[0] for c in CASES])
def test_llama_local_matches_single_process(name, options, tied):
    schedule = build_schedule(name, pp=2, microbatches=MICROBATCHES, **options)
    loss_error, worst = run(make_model("llama", tied, layers=4), schedule, None)
    assert loss_error < 1e-10 and worst < 1e-10


@pytest.mark.parametrize("family,tied", [("mistral", False), ("qwen2", False), ("qwen3", False),
                                         ("gpt2", True)])
def test_other_families_split_exactly(family, tied):
    schedule = build_schedule("1f1b", pp=2, microbatches=MICROBATCHES)
    loss_error, worst = run(make_model(family, tied=tied, layers=2), schedule, None)
    assert loss_error < 1e-10 and worst < 1e-10


def _ranks(rank: int, world: int, cases: tuple) -> list[tuple]:
    report = []
    for name, options, tied in cases:
        schedule = build_schedule(name, pp=world, microbatches=MICROBATCHES, **options)
        report.append((name, tied, *run(make_model("llama", tied), schedule, rank)))
    return report


def _check(results: dict, world: int) -> None:
    assert sorted(results) == list(range(world)), results
    for rank, outcome in results.items():
        assert "ok" in outcome, f"rank {rank}: {outcome.get('trace')}"
        for name, tied, loss_error, worst in outcome["ok"]:
            assert worst < 1e-10, f"rank {rank} {name} tied={tied}: gradient error {worst:.2e}"
            assert loss_error is None or loss_error < 1e-10, (rank, name, tied, loss_error)


@pytest.mark.slow
def test_llama_two_gloo_ranks_tied_and_untied(tmp_path):
    cases = tuple((name, options, tied) for name, options in CASES for tied in (True, False))
    _check(launch(_ranks, 2, tmp_path, cases, join_timeout_s=PATIENCE_S), 2)


@pytest.mark.slow
def test_llama_four_gloo_ranks(tmp_path):
    cases = (("1f1b", {}, True), ("zbv", {}, False), ("po-f", {"offload_ratio": 0.5}, True))
    _check(launch(_ranks, 4, tmp_path, cases, join_timeout_s=PATIENCE_S), 4)


def test_balanced_layers_and_too_few_layers():
    assert [len(r) for r in balanced_layers(10, 4)] == [3, 3, 2, 2]
    with pytest.raises(ConfigError, match="3 decoder layers but the schedule has 4 stages"):
        balanced_layers(3, 4)


def test_split_places_embedding_first_head_last_and_declares_the_tie():
    schedule = build_schedule("1f1b", pp=2, microbatches=2)
    model = make_model("llama", tied=True, layers=4)
    stages = split_causal_lm(model, schedule)
    assert stages[0].embed_tokens is model.model.embed_tokens and stages[0].lm_head is None
    assert stages[1].lm_head is model.lm_head and stages[1].embed_tokens is None
    tie = {"embed_tokens.weight": {0: "embed_tokens.weight", 1: "lm_head.weight"}}
    assert stages[0].tied_parameters == tie and stages[1].tied_parameters == tie
    assert list(split_causal_lm(model, schedule, rank=1)) == [1]
    untied = split_causal_lm(make_model("llama", tied=False, layers=4), schedule)
    assert not untied[0].tied_parameters and not untied[1].tied_parameters


def test_unknown_models_are_refused_with_what_to_do():
    schedule = build_schedule("1f1b", pp=2, microbatches=2)
    with pytest.raises(IntegrationError, match="stage contract"):
        split_causal_lm(torch.nn.Linear(2, 2), schedule)


def test_causal_lm_loss_shifts_keeps_dtype_and_ignores_padding():
    logits = torch.randn(2, 4, 5, dtype=torch.float64)
    labels = torch.tensor([[1, 2, 3, -100], [0, -100, 4, 4]])
    loss = causal_lm_loss(logits, labels)
    assert loss.dtype == torch.float64
    kept = [(b, t) for b in range(2) for t in range(3) if labels[b, t + 1] != -100]
    manual = torch.stack([torch.nn.functional.cross_entropy(logits[b, t], labels[b, t + 1])
                          for b, t in kept]).mean()
    assert torch.allclose(loss, manual, rtol=1e-14, atol=0)


def test_dict_and_non_tensor_inputs_get_clear_messages():
    schedule = build_schedule("1f1b", pp=2, microbatches=2)
    model = make_model("llama", tied=False, layers=2)
    pipe = Pipeline(split_causal_lm(model, schedule), schedule, causal_lm_loss)
    ids = batch()["input_ids"][:4]
    with pytest.raises(ConfigError, match=r"inputs\['attention_mask'\] is a list"):
        pipe.step({"input_ids": ids, "attention_mask": [1, 1]}, target=ids)
    pipe.step({"input_ids": ids}, target=ids)
    with pytest.raises(ConfigError, match=r"set up for a dict with keys \['input_ids'\]"):
        pipe.step(ids, target=ids)


def test_stage_kwargs_reach_the_stage_every_microbatch():
    seen = []

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 3).double()

        def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            seen.append(scale)
            return self.lin(x) * scale

    schedule = build_schedule("1f1b", pp=2, microbatches=2)
    stages = {0: Scaled(), 1: Scaled()}
    pipe = Pipeline(stages, schedule, lambda out, t: ((out - t) ** 2).mean(),
                    stage_kwargs={1: {"scale": 0.5}})
    x = torch.randn(4, 3, dtype=torch.float64)
    pipe.step(x, target=x)
    assert sorted(seen) == [0.5, 0.5, 1.0, 1.0]
    with pytest.raises(ConfigError, match="stage_kwargs names stages \\[7\\]"):
        Pipeline(stages, schedule, torch.nn.functional.mse_loss, stage_kwargs={7: {}})
