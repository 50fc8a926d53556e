"""Exports carry the tokenizer (parallel/tokenizer_files.py): AutoTokenizer.from_pretrained of a
Llama and a Qwen3 export encodes as the training tokenizer does, bos / eos / pad are set within
the vocabulary (also in config.json), the model generates, and given files are copied as given."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from pipeoffload.parallel.export import write_export

pytestmark = pytest.mark.torch

TEXT = ["the quick brown fox jumps over the lazy dog", "pipelines offload activations"]
SHAPE = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, head_dim=8, tie_word_embeddings=False)


def bpe(folder: Path, specials: list[str], bos: str | None) -> Path:
    from tokenizers import models, pre_tokenizers, processors, trainers

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(TEXT * 5, trainers.BpeTrainer(
        vocab_size=290, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos is not None:  # Llama's post-processor puts BOS first
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    folder.mkdir(parents=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


@pytest.mark.parametrize(("family", "specials", "bos", "eos"), [
    ("llama", ["<s>", "</s>"], "<s>", "</s>"),
    ("qwen3", ["<|endoftext|>", "<|im_end|>"], None, "<|endoftext|>"),
])
def test_an_export_encodes_like_training_and_generates(tmp_path, family, specials, bos, eos):
    path = bpe(tmp_path / "tok", specials, bos)
    trained = tokenizers.Tokenizer.from_file(str(path))
    vocab = trained.get_vocab_size(with_added_tokens=True)
    config = transformers.AutoConfig.for_model(family, vocab_size=vocab, eos_token_id=151643,
                                               bos_token_id=None, **SHAPE)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    write_export(tmp_path / "export", model.config, [dict(model.state_dict())], torch.float32,
                 path)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    for text in TEXT:
        assert loaded(text).input_ids == trained.encode(text).ids
    assert loaded.eos_token == eos and loaded.eos_token_id == trained.token_to_id(eos)
    assert loaded.bos_token == bos and loaded.pad_token_id is not None
    written = json.loads((tmp_path / "export" / "config.json").read_text())
    assert written["eos_token_id"] == loaded.eos_token_id < vocab
    assert written["pad_token_id"] == loaded.pad_token_id < vocab
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    prompt = loaded(TEXT[0], return_tensors="pt")
    out = again.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == prompt.input_ids.shape[1] + 3 and int(out.max()) < vocab


def test_given_tokenizer_files_are_copied_as_given(tmp_path):
    path = bpe(tmp_path / "tok", ["<|endoftext|>"], None)
    given = b'{"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",' \
            b' "model_max_length": 77}\n'
    (path.parent / "tokenizer_config.json").write_bytes(given)
    config = transformers.AutoConfig.for_model("llama", vocab_size=290, **SHAPE)
    model = transformers.AutoModelForCausalLM.from_config(config)
    write_export(tmp_path / "export", model.config, [dict(model.state_dict())], torch.float32,
                 path)
    assert (tmp_path / "export" / "tokenizer_config.json").read_bytes() == given
    special = json.loads((tmp_path / "export" / "special_tokens_map.json").read_text())
    assert special["eos_token"] == special["pad_token"] == "<|endoftext|>"
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "export").model_max_length == 77


def test_pipeoffload_export_writes_the_tokenizer_of_a_checkpoint(tmp_path, monkeypatch):
    """`pipeoffload export CHECKPOINT DIR --tokenizer PATH` (from a 1-step Qwen3 run trained
    through that tokenizer) writes the files --export-hf would: AutoTokenizer encodes as
    training did."""
    from pipeoffload.cli.main import main

    path = bpe(tmp_path / "tok", ["<|endoftext|>"], None)
    vocab = tokenizers.Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
    config = transformers.Qwen3Config(vocab_size=vocab, max_position_embeddings=64,
                                      **{**SHAPE, "num_hidden_layers": 2})
    config.save_pretrained(tmp_path / "model")
    (tmp_path / "text.txt").write_text(" ".join(TEXT) * 40)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--model", str(tmp_path / "model"), "--pp", "2", "--inline",
                 "--schedule", "1f1b", "--steps", "1", "--data", "text.txt", "--tokenizer",
                 str(path), "--seq-len", "16", "--batch-size", "4", "--eval-fraction", "0",
                 "--checkpoint-dir", "ck", "--no-png", "--no-baseline"]) == 0
    assert main(["export", "ck", "out", "--tokenizer", str(path.parent)]) == 0
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert type(loaded).__name__ != "Qwen2Tokenizer"
    assert loaded(TEXT[1]).input_ids == tokenizers.Tokenizer.from_file(str(path)).encode(
        TEXT[1]).ids
    assert loaded.eos_token == "<|endoftext|>"
