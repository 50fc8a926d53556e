"""--document-mask: a token never attends across a document boundary, so the loss of documents
packed into one row equals the loss of each document trained on its own. The reference model
keeps row positions (rotary positions are relative: equal to float rounding, 1e-5); Hugging Face
Llama / Qwen3 / GPT-2 stages restart positions per document (float64: equal to 1e-12, the
attention's sums over another length being the only difference). Pipeline stages pass the
documents on, and a pipelined run trains with it."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

torch = pytest.importorskip("torch")

from pipeoffload.errors import ConfigError
from pipeoffload.parallel.topology import Topology
from pipeoffload.runtime.inputs import document_segments
from pipeoffload.training.data_config import DataConfig
from pipeoffload.training.model_config import ModelConfig, model_preset
from pipeoffload.training.split import build_full_model, build_stage_modules
from pipeoffload.training.train import TrainConfig
from pipeoffload.training.trainer import train

pytestmark = pytest.mark.torch

EOS = 0
TINY = dataclasses.replace(model_preset("tiny"), vocab_size=64, document_eos=EOS)


def docs(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 64) for _ in range(n)] + [EOS] for n in (6, 1, 9, 4)]


def token_losses(model: torch.nn.Module, row: list[int]) -> torch.Tensor:
    ids = torch.tensor([row[:-1]])
    logits = model(ids)
    return torch.nn.functional.cross_entropy(logits[0], torch.tensor(row[1:]), reduction="none")


def test_packed_documents_lose_what_separate_documents_lose() -> None:
    model = build_full_model(TINY, seed=0)
    parts = docs()
    packed = [t for d in parts for t in d]
    got = token_losses(model, packed + [EOS])
    separate = [token_losses(model, d) for d in parts]
    # Row position p predicts token p+1: a document's predictions are its first len - 1
    # positions' (its EOS's, which predicts the next document's first token, is skipped).
    start = 0
    for d, alone in zip(parts, separate):
        assert torch.allclose(got[start: start + len(d) - 1], alone, atol=1e-5, rtol=0)
        start += len(d)
    unmasked = build_full_model(dataclasses.replace(TINY, document_eos=None), seed=0)
    leaked = token_losses(unmasked, packed + [EOS])
    assert not torch.allclose(leaked[len(parts[0]):], got[len(parts[0]):], atol=1e-3)
    assert document_segments(torch.tensor([[5, 0, 7, 0, 8]]), 0).tolist() == [[0, 0, 1, 1, 2]]


def test_stages_pass_the_documents_on_exactly() -> None:
    full = build_full_model(TINY, seed=0)
    stages = build_stage_modules(TINY, 2, [0, 1], seed=0)
    ids = torch.tensor([[t for d in docs(1) for t in d]] * 2)
    hidden, segments = stages[0](ids)
    assert segments.dtype == torch.int64 and not segments.is_floating_point()
    assert torch.equal(stages[1](hidden, segments), full(ids))
    with pytest.raises(ConfigError, match="document_eos=64 is not an id"):
        dataclasses.replace(TINY, document_eos=64)


def test_a_pipelined_run_trains_with_documents_masked(tmp_path) -> None:
    rng = random.Random(0)
    lines = [json.dumps({"text": "".join(rng.choices("abcdef ", k=rng.randrange(3, 30)))})
             for _ in range(400)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    data = DataConfig(source=tmp_path / "d.jsonl", seq_len=32, batch_size=4, eval_fraction=0)
    model = ModelConfig(**{**dataclasses.asdict(model_preset("tiny")), "document_eos": 0})
    config = TrainConfig(model=model, data=data, pp=2, microbatches=2, steps=2,
                         measure_baseline=False, grad_clip=None)
    masked = train(config, Topology.local(2))
    plain = train(dataclasses.replace(config, model=model_preset("tiny")), Topology.local(2))
    assert all(loss == loss for loss in masked.losses)
    assert masked.losses[0] != plain.losses[0]  # the batch crosses documents


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_hugging_face_stages_mask_documents(family: str) -> None:
    transformers = pytest.importorskip("transformers")
    from pipeoffload.integrations.hf import causal_lm_stages

    shape = (dict(n_layer=2, n_embd=16, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                  attn_pdrop=0.0) if family == "gpt2" else
             dict(num_hidden_layers=2, hidden_size=16, intermediate_size=32,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    config = transformers.AutoConfig.for_model(family, vocab_size=64, bos_token_id=None,
                                               eos_token_id=None, **shape)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).double().eval()
    stages = causal_lm_stages(model, 2, [0, 1])
    for stage in stages.values():
        stage.document_eos = EOS
    parts = docs(2)
    row = torch.tensor([[t for d in parts for t in d]])
    hidden, segments = stages[0](row)
    packed = stages[1](hidden, segments)[0]
    start = 0
    for d in parts:
        alone = model(torch.tensor([d])).logits[0]
        assert torch.allclose(packed[start: start + len(d)], alone, atol=1e-12, rtol=0)
        start += len(d)
    for stage in stages.values():
        stage.document_eos = None
    assert not torch.allclose(stages[1](stages[0](row))[0], packed, atol=1e-3)


def test_train_document_mask_reaches_hugging_face_stages_and_their_checkpoint(tmp_path,
                                                                              monkeypatch,
                                                                              capsys):
    transformers = pytest.importorskip("transformers")
    from pipeoffload.cli.main import main
    from pipeoffload.parallel.checkpoint import read_manifest

    transformers.LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             head_dim=8, max_position_embeddings=64).save_pretrained(tmp_path)
    rng = random.Random(1)
    (tmp_path / "d.jsonl").write_text("".join(
        json.dumps({"text": "".join(rng.choices("abcdef ", k=rng.randrange(3, 30)))}) + "\n"
        for _ in range(300)))
    monkeypatch.chdir(tmp_path)
    recorded, losses = [], []
    for extra in ([], ["--document-mask"]):
        folder = f"ck{len(extra)}"
        argv = ["train", "--model", str(tmp_path / "config.json"), "--pp", "2", "--inline",
                "--schedule", "1f1b", "--steps", "1", "--data", "d.jsonl", "--seq-len", "32",
                "--batch-size", "4", "--eval-fraction", "0", "--no-png", "--no-baseline",
                "--checkpoint-dir", folder, "--json", *extra]
        assert main(argv) == 0
        losses.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["losses"])
        manifest = read_manifest(tmp_path / folder / "step_00000001")
        recorded.append(manifest.info["model"].get("document_eos"))
    assert recorded == [None, 0]  # byte data: NUL ends a document; recorded for resume
    assert losses[0] != losses[1]  # the same model and batch, attention masked
