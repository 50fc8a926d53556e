"""pipeoffload.torch over 2 gloo processes: a tied Hugging Face Llama split by split_causal_lm
trains like the unsplit model (the ties the stages declare are summed), and every drop-in class
with offload gives torch's own class's gradients bitwise, and evaluates (torch's V classes
cannot, Note: [forwards only])."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
transformers = pytest.importorskip("transformers")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from patience import PATIENCE_S  # noqa: E402
from test_runtime_support import launch, one_thread  # noqa: E402, F401 - fixture

from pipeoffload import build_schedule  # noqa: E402
from pipeoffload.errors import IntegrationError  # noqa: E402
from pipeoffload.hf import causal_lm_loss, split_causal_lm  # noqa: E402
from pipeoffload.runtime.config import OffloadConfig  # noqa: E402

try:
    import pipeoffload.torch  # noqa: F401
except IntegrationError as refusal:
    pytest.skip(str(refusal), allow_module_level=True)

MICROBATCHES, BATCH, SEQ, VOCAB, STEPS = 4, 8, 6, 32, 3
CONFIG = OffloadConfig(min_offload_elements=0)


def tied_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24,
                                      num_hidden_layers=4, num_attention_heads=2,
                                      num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


def token_ids(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def plain_training(model: torch.nn.Module) -> tuple[list[float], torch.nn.Module]:
    """Losses per step and the model after STEPS of SGD on the microbatch-mean loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        ids = token_ids(step)
        loss = sum(causal_lm_loss(model(input_ids=mb).logits, mb)
                   for mb in ids.chunk(MICROBATCHES)) / MICROBATCHES
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, model


def _tied_llama(rank: int, world: int) -> dict:
    """Largest difference from plain training (losses of every step, then every parameter of
    this rank's stages) under po-f with offload and under ScheduleInterleaved1F1B."""
    from torch.distributed.pipelining import PipelineStage

    import pipeoffload.torch as ours

    ref_losses, reference = plain_training(tied_llama())
    out = {}
    for name in ("po-f", "Interleaved1F1B"):
        model = tied_llama()
        layout = build_schedule("po-f" if name == "po-f" else "interleaved-1f1b", pp=world,
                                microbatches=MICROBATCHES, chunks=2)
        modules = split_causal_lm(model, layout, rank=rank)
        stages = [PipelineStage(m, s, layout.num_stages, "cpu") for s, m in sorted(modules.items())]
        pipe = ours.get_schedule_class(name)(stages, MICROBATCHES, loss_fn=causal_lm_loss,
                                             offload_config=CONFIG)
        optimizer = torch.optim.SGD([p for m in modules.values() for p in m.parameters()], lr=0.5)
        worst = 0.0
        for step in range(STEPS):
            optimizer.zero_grad()
            ids = token_ids(step)
            losses: list[torch.Tensor] = []
            last = layout.num_stages - 1 in modules
            pipe.step(*((ids,) if 0 in modules else ()), target=ids if last else None,
                      losses=losses if last else None)
            optimizer.step()
            if last:
                worst = max(worst, abs(torch.stack(losses).mean().item() - ref_losses[step]))
        params = dict(reference.named_parameters(remove_duplicate=False))
        for s, module in modules.items():
            for pname, p in module.named_parameters():
                mapped = {"embed_tokens.weight": "model.embed_tokens.weight",
                          "norm.weight": "model.norm.weight",
                          "lm_head.weight": "lm_head.weight"}.get(pname)
                if mapped is None:  # 4 layers over 4 stages: stage s holds layer s
                    assert len(module.layers) == 1, pname
                    mapped = f"model.layers.{s}.{pname.split('.', 2)[2]}"
                worst = max(worst, (p - params[mapped]).abs().max().item())
        out[name] = (worst, pipe.tied, pipe.offloader is not None)
    return out


# torch's class name -> stages per rank; V classes hold stages r and 2p-1-r
CLASSES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "LoopedBFS": 2,
           "InterleavedZeroBubble": 2, "ZBVZeroBubble": 2, "DualPipeV": 2}


def _every_class(rank: int, world: int) -> dict:
    """Per class: gradients with offload bitwise torch's class's, an eval() loss list, and how
    many OFFLOAD actions this rank ran."""
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, schedules

    import pipeoffload.torch as ours

    def run(name: str, theirs: bool) -> tuple[list[torch.Tensor], object]:
        local = CLASSES[name]
        v = name in ("ZBVZeroBubble", "DualPipeV")
        ids = [rank, 2 * world - 1 - rank] if v else [rank + c * world for c in range(local)]
        mods = []
        for s in ids:
            torch.manual_seed(s)
            mods.append(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).double())
        stages = [PipelineStage(m, s, local * world, "cpu") for s, m in zip(ids, mods)]
        mse = nn.functional.mse_loss
        if theirs:
            cls = getattr(schedules, f"Schedule{name}")
            single = issubclass(cls, schedules.PipelineScheduleSingle)
            pipe = cls(stages[0] if single else stages, 2 * world, loss_fn=mse)
        else:
            pipe = getattr(ours, f"Schedule{name}")(stages, 2 * world, loss_fn=mse,
                                                   offload="all", offload_config=CONFIG)
        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(8, 8, generator=g).double(), torch.randn(8, 8, generator=g).double()
        first, last = 0 in ids, local * world - 1 in ids
        pipe.step(*((x,) if first else ()), target=y if last else None)
        return [p.grad for m in mods for p in m.parameters()], pipe

    out = {}
    for name in CLASSES:
        grads, pipe = run(name, False)
        native, _ = run(name, True)
        losses: list = []
        last = any(s.is_last for s in pipe._stages)
        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(8, 8, generator=g).double(), torch.randn(8, 8, generator=g).double()
        pipe.eval(*((x,) if any(s.is_first for s in pipe._stages) else ()),
                  target=y if last else None, losses=losses if last else None)
        out[name] = (all(torch.equal(a, b) for a, b in zip(grads, native, strict=True)),
                     len(losses) if last else None,
                     sum(a.kind.value == "OFFLOAD" for a in pipe.schedule.ranks[rank]))
    return out


def _two_ranks(rank: int, world: int) -> tuple[dict, dict]:
    return _tied_llama(rank, world), _every_class(rank, world)


@pytest.mark.slow
def test_two_ranks_tied_llama_and_every_class(tmp_path):
    """The tied Llama under po-f and ScheduleInterleaved1F1B within 1e-6 of plain training
    (float64: far closer); every class with offload as torch's class, and evaluating."""
    results = launch(_two_ranks, 2, tmp_path, join_timeout_s=PATIENCE_S)
    assert sorted(results) == [0, 1], results
    offloaded = 0
    for rank, outcome in results.items():
        assert "ok" in outcome, f"rank {rank}: {outcome.get('trace')}"
        llama, every = outcome["ok"]
        for name, (bitwise, eval_losses, offloads) in every.items():
            assert bitwise, (rank, name)
            assert eval_losses in (None, 4), (rank, name, eval_losses)
            offloaded += offloads
        assert offloaded > 0
        for name, (worst, tied, offloads) in llama.items():
            assert worst < 1e-6, (rank, name, worst)
            assert tied == ["embed_tokens.weight"], (rank, name, tied)
            assert offloads == (name == "po-f"), (rank, name)
