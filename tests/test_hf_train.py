"""`pipeoffload train --model PATH` with Hugging Face models: trained over gloo processes,
exported, loaded back with ``from_pretrained``, whose held-out loss equals the pipeline's, and
trained again from the export starting at that loss; TP, bf16, Qwen3 and GPT-2 too.

Multi-process runs start the real command (cli/launch.py -> gloo); the rest runs in this process
(Pipeline's local mode, ``Topology.local``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from test_runtime_support import one_thread  # noqa: F401 - autouse fixture

from pipeoffload.cli.train import add_train_parser, config_from_args
from pipeoffload.parallel.topology import Topology
from pipeoffload.training.data import DataConfig, TextDataset
from pipeoffload.training.hf_run import export_checkpoint
from pipeoffload.training.model import lm_loss
from pipeoffload.training.train import build_plan
from pipeoffload.training.trainer import train

SEQ, BATCH = 32, 8
LLAMA = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def write_config(folder: Path, family: str, **changes) -> Path:
    """A tiny config.json of ``family`` (random init: no weights next to it)."""
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=4, n_head=4,
                                         n_positions=64, **changes)
    else:
        cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[family]
        config = cls(**{**LLAMA, "head_dim": 8, **changes})
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    return folder / "config.json"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A text file (a standard-library source, three times) and the configs."""
    root = tmp_path_factory.mktemp("hf_train")
    source = Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py"
    (root / "text.txt").write_bytes(source.read_bytes() * 3)
    write_config(root / "llama", "llama", tie_word_embeddings=True)
    write_config(root / "qwen3", "qwen3", tie_word_embeddings=False)
    write_config(root / "gpt2", "gpt2")  # tied, with GPT-2's default dropout 0.1
    return root


def common(root: Path) -> list[str]:
    return ["--data", str(root / "text.txt"), "--seq-len", str(SEQ), "--batch-size", str(BATCH),
            "--log-every", "5", "--p2p-timeout", "60", "--no-png", "--no-baseline"]


def run_cli(argv: list[str], cwd: Path, timeout_s: float = 600) -> tuple[dict, str]:
    """The real command in fresh processes; its last stdout line is the --json object."""
    proc = subprocess.run([sys.executable, "-m", "pipeoffload.cli", "train", *argv, "--json"],
                          cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def in_process(argv: list[str]):
    """What `pipeoffload train ARGV --inline` does, in this process."""
    import argparse

    parser = argparse.ArgumentParser(prog="pipeoffload")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    config, _ = config_from_args(parser.parse_args(["train", *argv]))
    return config, train(config, Topology.local(config.pp))


def held_out(root: Path, folder: Path, *, dtype=torch.float32, microbatches: int = 4,
             batches: int = 4) -> float:
    """The exported model's loss on the first held-out batches, as train's evaluation takes
    it: per batch the mean over its microbatches, then the mean over batches."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    data = TextDataset.from_config(DataConfig(source=root / "text.txt", seq_len=SEQ,
                                              batch_size=BATCH))
    losses = []
    with torch.no_grad():
        for _, (inputs, target) in zip(range(batches), data.eval_batches()):
            losses.append(torch.stack([
                lm_loss(model(input_ids=x).logits, y)
                for x, y in zip(inputs.chunk(microbatches), target.chunk(microbatches))]).mean())
    return math.fsum(loss.item() for loss in losses) / len(losses)


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    found = {}
    for file in sorted(folder.glob("*.safetensors")):
        found.update(load_file(file))
    return found


@pytest.mark.slow
def test_llama_tied_pp2_pof_export_loads_with_the_pipelines_loss_and_trains_on(workdir):
    """The issue's case: tied Llama, po-f over 2 gloo processes, 20 steps, --export-hf; then
    the export, trained with another layout (dp 2), starts from the loss it ended with."""
    result, log = run_cli(["--model", str(workdir / "llama" / "config.json"), "--pp", "2",
                           "--schedule", "po-f", "--steps", "20", "--export-hf", "export",
                           "--eval-every", "10", *common(workdir)], workdir)
    size = (workdir / "text.txt").stat().st_size
    assert f"data: {size:,} bytes from 1 file(s)" in log and f"text.txt ({size:,} B)" in log
    assert result["last_loss"] < result["first_loss"] - 0.5
    assert [step for step, _ in result["eval_losses"]] == [0, 10, 20]
    loss = result["eval_loss"]
    assert result["eval_losses"][-1][1] == loss < result["eval_losses"][0][1] - 0.5
    model = transformers.AutoModelForCausalLM.from_pretrained(workdir / "export")
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied again on loading
    assert "lm_head.weight" not in tensors(workdir / "export")
    assert abs(held_out(workdir, workdir / "export") - loss) < 1e-5
    again, _ = run_cli(["--model", str(workdir / "export"), "--pp", "1", "--dp", "2",
                        "--schedule", "1f1b", "--steps", "2", "--eval-every", "1",
                        *common(workdir)], workdir)
    assert again["eval_losses"][0][0] == 0 and abs(again["eval_losses"][0][1] - loss) < 1e-5
    assert again["eval_losses"][-1][1] < loss  # and it keeps learning


@pytest.mark.slow
def test_tensor_parallel_export_consolidates_shards_and_export_command_agrees(workdir, tmp_path):
    cfg = str(workdir / "llama" / "config.json")
    argv = ["--model", cfg, "--pp", "2", "--schedule", "po-f", *common(workdir)]
    result, _ = run_cli([*argv, "--tp", "2", "--steps", "20", "--export-hf",
                         str(tmp_path / "export"), "--checkpoint-dir", str(tmp_path / "ckpt")],
                        tmp_path)
    _, one = in_process([*argv, "--steps", "2", "--inline"])
    assert abs(result["losses"][0] - one.losses[0]) < 1e-6  # the same init on every layout
    assert abs(result["losses"][1] - one.losses[1]) < 1e-5
    loss = result["eval_loss"]
    assert abs(held_out(workdir, tmp_path / "export") - loss) < 1e-5
    folder, step = export_checkpoint(tmp_path / "ckpt", tmp_path / "from_ckpt")
    assert step == 20 and (folder / "model.safetensors").is_file()
    exported, consolidated = tensors(tmp_path / "export"), tensors(folder)
    assert sorted(exported) == sorted(consolidated)
    assert all(torch.equal(exported[k], consolidated[k]) for k in exported)
    _, again = in_process(["--model", str(tmp_path / "export"), "--pp", "2", "--inline",
                           "--steps", "1", "--eval-every", "1", *common(workdir)])
    assert abs(again.eval_losses[0][1] - loss) < 1e-5


@pytest.mark.slow
def test_gpt2_tensor_parallel_trains_exactly_and_exports_in_hugging_faces_layout(workdir,
                                                                                   tmp_path):
    """GPT-2 with TP 2 x PP 2 over 4 gloo processes (its fused c_attn split by head, Note
    [GPT-2 fused QKV]) trains as TP 1 does; both exports (--export-hf and `pipeoffload export`
    of the checkpoint) hold Hugging Face's [Q | K | V] order and load with the run's loss."""
    cfg = str(write_config(tmp_path / "gpt2", "gpt2", resid_pdrop=0.0, embd_pdrop=0.0,
                           attn_pdrop=0.0))
    argv = ["--model", cfg, "--pp", "2", "--schedule", "1f1b", "--steps", "3",
            *common(workdir)]
    sharded, _ = run_cli([*argv, "--tp", "2", "--export-hf", str(tmp_path / "tp2"),
                          "--checkpoint-dir", str(tmp_path / "ckpt")], tmp_path)
    _, whole = in_process([*argv, "--inline", "--export-hf", str(tmp_path / "tp1")])
    assert len(sharded["losses"]) == len(whole.losses) == 3
    for a, b in zip(sharded["losses"], whole.losses):
        assert abs(a - b) < 1e-6
    assert abs(sharded["eval_loss"] - whole.eval_losses[-1][1]) < 1e-6
    folder, _ = export_checkpoint(tmp_path / "ckpt", tmp_path / "from_ckpt")
    reference = tensors(tmp_path / "tp1")
    for exported in (tensors(tmp_path / "tp2"), tensors(folder)):
        assert sorted(exported) == sorted(reference)
        for name, value in reference.items():
            assert torch.allclose(exported[name], value, atol=1e-5), name
    assert abs(held_out(workdir, tmp_path / "tp2") - sharded["eval_loss"]) < 1e-5


def test_fused_qkv_is_grouped_by_rank_and_joined_back() -> None:
    """Rank r's contiguous slice of the regrouped c_attn is [Q | K | V] of its heads; the
    shards join back to Hugging Face's order (weights [in, 3h], bias [3h])."""
    from pipeoffload.integrations.hf_tp_layout import (
        group_fused_qkv,
        join_shards,
        shard_dim,
    )

    hidden, tp = 8, 2
    weight = torch.arange(4 * 3 * hidden, dtype=torch.float32).reshape(4, 3 * hidden)
    grouped = group_fused_qkv(weight, tp, 1)
    shards = list(grouped.chunk(tp, 1))
    for r, shard in enumerate(shards):
        q, k, v = shard.chunk(3, 1)
        heads = slice(r * hidden // tp, (r + 1) * hidden // tp)
        assert torch.equal(q, weight[:, :hidden][:, heads])
        assert torch.equal(k, weight[:, hidden:2 * hidden][:, heads])
        assert torch.equal(v, weight[:, 2 * hidden:][:, heads])
    name = "layers.0.attn.c_attn.weight"
    assert shard_dim(name) == 1 and shard_dim("layers.0.attn.c_attn.bias") == 0
    assert shard_dim("layers.0.attn.c_proj.weight") == 0
    assert shard_dim("layers.0.attn.c_proj.bias") is None
    assert shard_dim("layers.0.mlp.c_fc.weight") == 1
    assert shard_dim("layers.0.self_attn.q_proj.weight") == 0
    assert torch.equal(join_shards(name, shards), weight)
    bias = torch.arange(3 * hidden, dtype=torch.float32)
    assert torch.equal(join_shards("layers.0.attn.c_attn.bias",
                                   list(group_fused_qkv(bias, tp, 0).chunk(tp))), bias)


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_other_families_train_export_and_restart_locally(workdir, tmp_path, family):
    """Qwen3 (untied, q/k norms) and GPT-2 (tied, learnt positions, dropout on while training
    and off for evaluation) in one process, pp 2."""
    argv = ["--model", str(workdir / family / "config.json"), "--pp", "2", "--inline",
            "--schedule", "1f1b", *common(workdir)]
    config, result = in_process([*argv, "--steps", "8", "--export-hf", str(tmp_path / "out")])
    loss = result.eval_losses[-1][1]
    assert result.losses[-1] < result.losses[0]
    assert abs(held_out(workdir, tmp_path / "out") - loss) < 1e-5
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.model_type == family
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == (family == "gpt2")
    _, again = in_process(["--model", str(tmp_path / "out"), *argv[2:], "--steps", "1",
                           "--eval-every", "1"])
    assert abs(again.eval_losses[0][1] - loss) < 1e-5


def test_qwen3_full_recompute_is_bitwise_and_resume_is_bitwise(workdir, tmp_path):
    argv = ["--model", str(workdir / "qwen3" / "config.json"), "--pp", "2", "--inline",
            "--schedule", "1f1b", *common(workdir)]
    _, plain = in_process([*argv, "--steps", "4"])
    _, recomputed = in_process([*argv, "--steps", "4", "--recompute", "full"])
    assert recomputed.losses == plain.losses
    assert recomputed.peak_bytes[0] < plain.peak_bytes[0]
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    in_process([*argv, "--steps", "2", *ckpt])
    _, resumed = in_process([*argv, "--steps", "4", *ckpt, "--resume"])
    assert resumed.start_step == 2 and resumed.losses == plain.losses[2:]
    assert resumed.eval_losses == plain.eval_losses


def test_random_init_is_the_same_for_every_split(workdir):
    from pipeoffload.training.hf_model import build_hf_stages, resolve_model

    source = resolve_model(str(workdir / "llama" / "config.json"))

    def weights(num_stages: int) -> dict[str, torch.Tensor]:
        built = build_hf_stages(source, num_stages, range(num_stages), seed=3,
                                dtype=torch.float32, device=torch.device("cpu"))
        names: dict[int, str] = {}
        for name, param in built.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), name)
        return {names[id(p)]: p for m in built.stages.values() for p in m.parameters()}

    one, four = weights(1), weights(4)
    assert set(four) - set(one) == {"lm_head.weight"}  # a copy of the tie on the last stage
    assert all(torch.equal(one[n], four[n]) for n in one)
    assert torch.equal(four["lm_head.weight"], four["model.embed_tokens.weight"])
    assert not torch.equal(one["model.layers.0.mlp.up_proj.weight"],
                           one["model.layers.1.mlp.up_proj.weight"])


@pytest.mark.slow
def test_plan_prints_a_command_that_trains_the_config_in_bf16(workdir, tmp_path, capsys):
    """`plan --model cfg.json` names the file, and its command (bf16, zbv: the tie's two stages
    on one rank of a distributed pipeline) trains that model: 20 steps, exported in bf16, and
    the checkpoint's float32 master weights exported by `pipeoffload export`."""
    import shlex

    from pipeoffload.cli.main import main

    cfg = str(workdir / "llama" / "config.json")
    assert main(["plan", "--model", cfg, "--gpus", "2", "--pp", "2", "--hardware", "a100",
                 "--seq", "32", "--global-batch", "8", "--schedules", "zbv", "--json",
                 "--quiet"]) == 0
    best = json.loads(capsys.readouterr().out)["best"]
    argv = shlex.split(best["command"])
    assert argv[:2] == ["pipeoffload", "train"] and f"--model {cfg}" in best["command"]
    assert "--dtype bf16" in best["command"] and best["recompute"] in ("none", "full")
    shrunk = [*argv[2:], "--steps", "20", "--data", str(workdir / "text.txt"), "--no-png",
              "--p2p-timeout", "60", "--export-hf", "bf16", "--checkpoint-dir", "ckpt"]
    result, _ = run_cli(shrunk, tmp_path)
    assert (result["model"], result["schedule"], result["dtype"]) == (cfg, "zbv", "bf16")
    assert result["last_loss"] < result["first_loss"] - 0.5
    loss = result["eval_loss"]
    bf16 = tensors(tmp_path / "bf16")
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16}
    microbatches = result["microbatches"]
    assert abs(held_out(workdir, tmp_path / "bf16", dtype=torch.bfloat16,
                        microbatches=microbatches) - loss) < 1e-5
    folder, _ = export_checkpoint(tmp_path / "ckpt", tmp_path / "fp32", "fp32")
    masters = tensors(folder)
    assert {t.dtype for t in masters.values()} == {torch.float32}
    # the bf16 weights are the float32 masters rounded; the masters are finer than that
    assert all(torch.equal(masters[k].to(torch.bfloat16), bf16[k]) for k in bf16)
    assert any(not torch.equal(masters[k], bf16[k].float()) for k in bf16)
    assert abs(held_out(workdir, folder, microbatches=microbatches) - loss) < 0.05


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gpt2"])
def test_every_family_splits_exports_and_reloads_at_the_same_loss(tmp_path, family):
    """train's stages of each family (Mistral with a sliding window shorter than the sequence,
    Qwen2 with Q/K/V biases) give, forward only, the loss of the exported model reloaded."""
    from pipeoffload import Pipeline, build_schedule
    from pipeoffload.parallel.export import export_pretrained
    from pipeoffload.training.hf_model import build_hf_stages, resolve_model

    if family == "gpt2":
        cfg = write_config(tmp_path / family, "gpt2", tie_word_embeddings=False)
    else:
        cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[family]
        extra = {"sliding_window": 5} if family == "mistral" else {}
        (tmp_path / family).mkdir()
        cls(**{**LLAMA, "head_dim": 8, **extra}).save_pretrained(tmp_path / family)
        cfg = tmp_path / family / "config.json"
    schedule = build_schedule("1f1b", pp=2, microbatches=2)
    built = build_hf_stages(resolve_model(str(cfg)), 2, [0, 1], seed=5, dtype=torch.float64,
                            device=torch.device("cpu"))
    for module in built.stages.values():
        module.eval()
    ids = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    loss = Pipeline(built.stages, schedule, lm_loss).evaluate(ids[:, :-1], target=ids[:, 1:])
    export_pretrained(tmp_path / "out", built.model, built.stages, dtype=torch.float64)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                              dtype=torch.float64)
    with torch.no_grad():
        expected = torch.stack([lm_loss(model(input_ids=x).logits, y) for x, y in
                                zip(ids[:, :-1].chunk(2), ids[:, 1:].chunk(2))]).mean()
    assert abs(loss.item() - expected.item()) < 1e-12


@pytest.mark.parametrize("schedule", ["1f1b", "po-f"])
def test_llama_trains_with_classes_moved_and_recomputed_as_without_offload(workdir,
                                                                           schedule) -> None:
    """`--offload classes:A+B/recompute:C+D` on a Llama model: the losses of a run without
    offload, bit for bit; the measured peak is the one the simulator predicts from the measured
    class shares, and rank 0's is below the run without offload's."""
    argv = ["--model", str(workdir / "llama" / "config.json"), *common(workdir), "--pp", "2",
            "--schedule", schedule, "--steps", "3", "--inline", "--eval-fraction", "0"]
    _, plain = in_process([*argv, "--offload", "none"])
    config, classes = in_process(
        [*argv, "--offload", "classes:layer_input+qkv/recompute:mlp_norm+mlp_hidden+mlp_act"])
    assert {choice.names for _, choice in build_plan(config).schedule.classes} == {
        (("layer_input", "qkv"), ("mlp_norm", "mlp_hidden", "mlp_act"))}
    assert classes.losses == plain.losses
    assert classes.simulation is not None
    assert list(classes.peak_bytes) == [int(b) for b in classes.simulation.peak_bytes]
    assert classes.peak_bytes[0] < plain.peak_bytes[0]
