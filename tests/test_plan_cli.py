"""`pipeoffload plan` says what it assumed (issue 37): the framework that priced it
(``--framework``, which reproduces every published row of benchmarks/planner_published.py),
MFU under both conventions, the limits train puts on a Hugging Face model with what they cost
(GPT-2 is searched with TP > 1), and no command that drops part of the plan."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from pipeoffload.cli.plan import add_plan_parser
from pipeoffload.planner.frameworks import FRAMEWORKS
from pipeoffload.planner.published import PUBLISHED, PublishedRun, predict
from pipeoffload.planner.transformer import TransformerSpec


def _plan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    parser = argparse.ArgumentParser(prog="pipeoffload")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv, "--json", "--quiet"])
    code = args.handler(args)
    return code, json.loads(capsys.readouterr().out)


def _spec_file(spec: TransformerSpec, folder: Path) -> str:
    """``spec`` as a JSON file of our keys (TransformerSpec's field names)."""
    data = {key: getattr(value, "value", value)
            for key, value in dataclasses.asdict(spec).items() if value is not None}
    path = folder / f"{spec.name}.json"
    path.write_text(json.dumps(data))
    return str(path)


def _published_argv(run: PublishedRun, model: str) -> list[str]:
    """The run's every dimension as `plan` flags, priced as its framework ran it."""
    argv = ["--model", model, "--gpus", str(run.gpus), "--hardware", run.hardware,
            "--global-batch", str(run.global_batch), "--tp", str(run.tp), "--pp", str(run.pp),
            "--schedules", run.schedule, "--micro-batch-sizes", str(run.micro_batch),
            "--recompute", run.recompute.value, "--offload", "none",
            "--framework", run.framework_name, "--memory", "1000000", "--host-memory", "0"]
    if run.chunks > 1:
        argv += ["--chunks", str(run.chunks)]
    argv += ["--cp", str(run.cp)]
    if run.optimizer.sharded:
        argv.append("--sharded-optimizer")
    return argv


@pytest.mark.parametrize("run", PUBLISHED, ids=[run.label for run in PUBLISHED])
def test_framework_reproduces_every_published_row_from_the_cli(
        run: PublishedRun, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    preset = FRAMEWORKS[run.framework_name]
    # the row is priced exactly as its named framework runs it
    assert (run.framework, run.optimizer) == (preset.framework,
                                              preset.with_sharding(run.optimizer.sharded))
    code, data = _plan(_published_argv(run, _spec_file(run.spec, tmp_path)), capsys)
    assert code == 0 and data["fixed"]
    assert data["inputs"]["framework"] == run.framework_name
    best, expected = data["best"], predict(run)
    assert (best["tp"], best["pp"], best["dp"], best["cp"], best["microbatches"]) == (
        run.tp, run.pp, run.dp, run.cp, run.microbatches)
    assert best["step_time"] == pytest.approx(expected.step_time, rel=1e-12)
    assert best["mfu_megatron"] == pytest.approx(expected.mfu, rel=1e-12)
    assert any(preset.name in note for note in data["notes"]) == (preset.name != "current")


def test_both_mfu_conventions_are_in_the_json(capsys: pytest.CaptureFixture[str]) -> None:
    """Megatron's count (the full s x s attention square, as the published tables count) and
    the causal half a causal kernel runs: the gap grows with s / 6h."""
    gaps = []
    for seq in (2048, 16384):
        code, data = _plan(["--model", "gpt3-2.7b", "--seq", str(seq), "--gpus", "8",
                            "--global-batch", "32", "--top", "2", "--no-verdict"], capsys)
        assert code == 0
        for plan in [data["best"], *data["candidates"]]:
            assert plan["mfu"] == plan["mfu_megatron"] > plan["mfu_causal"] > 0
        gaps.append(data["best"]["mfu_megatron"] / data["best"]["mfu_causal"])
    assert 1 < gaps[0] < gaps[1]
    # 72 b s l h^2 (1 + s/6h + V/12lh) against the same with half of s/6h (GPT-3 2.7B)
    h, vocab, layers, seq = 2560, 50257, 32, 16384
    full = 1 + seq / (6 * h) + vocab / (12 * layers * h)
    assert gaps[1] == pytest.approx(full / (full - seq / (12 * h)), rel=1e-9)


def _gpt2_config(folder: Path, dropout: float) -> str:
    path = folder / "config.json"
    path.write_text(json.dumps({
        "model_type": "gpt2", "n_layer": 32, "n_embd": 8192, "n_head": 64, "n_positions": 2048,
        "vocab_size": 50257, "activation_function": "gelu_new", "resid_pdrop": dropout,
        "embd_pdrop": dropout, "attn_pdrop": dropout}))
    return str(path)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_gpt2_config_is_searched_with_tp_and_its_limits_are_notes_with_their_cost(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], dropout: float) -> None:
    """train splits GPT-2's fused c_attn by head, so the search tries TP > 1; what train cannot
    run (lgd recompute; any recompute with dropout) is a note and a JSON entry with the best
    plan the search would have chosen without it."""
    argv = ["--model", _gpt2_config(tmp_path, dropout), "--gpus", "64", "--global-batch", "128",
            "--top", "20"]
    code, data = _plan(argv, capsys)
    assert code == 0
    assert data["best"]["tp"] > 1 and f"--tp {data['best']['tp']}" in data["best"]["command"]
    assert all(plan["command_refused"] is None for plan in data["candidates"])
    kept = ["none"] if dropout else ["none", "full"]
    assert {plan["recompute"] for plan in data["candidates"]} <= set(kept)
    limits = data["restrictions"]["limits"]
    assert [limit["flags"] for limit in limits] == [f"--recompute {' or '.join(kept)}"]
    free = data["restrictions"]["unlimited_best"]
    assert free is not None and free["step_time"] <= data["best"]["step_time"] * 1.005 + 1e-9
    assert any("the search kept to --recompute" in note for note in data["notes"])


def test_sharded_optimizer_plans_train_with_zero_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, data = _plan(["--model", "gpt3-2.7b", "--seq", "4096", "--gpus", "8",
                        "--global-batch", "32", "--sharded-optimizer", "--top", "5",
                        "--no-verdict"], capsys)
    assert code == 0 and data["inputs"]["sharded_optimizer"]
    plans = [data["best"], *data["candidates"]]
    assert any(plan["dp"] > 1 for plan in plans)
    for plan in plans:
        assert plan["command_refused"] is None
        assert ("--zero 1" in plan["command"]) == (plan["dp"] * plan["cp"] > 1), plan["command"]
    if data["best"]["dp"] > 1:  # what sharding saves, in words
        assert data["sharding"].startswith("sharding: --zero 1 keeps"), data["sharding"]


def test_zero3_plans_are_priced_as_zero1_and_print_zero_3(
        capsys: pytest.CaptureFixture[str]) -> None:
    """plan --zero 3 searches tp 1 and cp 1 (what train runs it with), prices each plan as
    --zero 1 term by term (planner/optimizer.py Note [zero 3 terms]: the same memory parts and
    step time) and prints --zero 3 where dp > 1; its sharding line says the peak is no lower."""
    argv = ["--model", "gpt3-2.7b", "--seq", "4096", "--gpus", "8", "--global-batch", "32",
            "--top", "5", "--no-verdict"]
    code, data = _plan([*argv, "--zero", "3"], capsys)
    code1, data1 = _plan([*argv, "--zero", "1", "--tp", "1", "--cp", "1"], capsys)
    assert code == code1 == 0 and data["inputs"]["zero"] == 3 and data1["inputs"]["zero"] == 1
    plans = [data["best"], *data["candidates"]]
    assert any(plan["dp"] > 1 for plan in plans)
    for plan in plans:
        assert (plan["tp"], plan["cp"]) == (1, 1)
        if plan["dp"] > 1:
            assert plan["command_refused"] is None and "--zero 3" in plan["command"], plan
        else:
            assert plan["command"] is None and "dp 1" in plan["command_refused"], plan
    keys = ("pp", "dp", "schedule", "microbatch_size", "microbatches", "recompute", "offload",
            "step_time", "dp_time", "optimizer_time", "memory_gib", "memory_split_gib")
    assert [[p[k] for k in keys] for p in plans] == [
        [p[k] for k in keys] for p in [data1["best"], *data1["candidates"]]]
    assert data["sharding"].startswith("sharding: --zero 3 keeps"), data["sharding"]
    assert "peak is no lower than --zero 1's" in data["sharding"]
    code, data = _plan([*argv, "--zero", "3", "--tp", "2"], capsys)
    assert data["best"]["command"] is None
    assert "tp 1 and cp 1 only" in data["best"]["command_refused"]


def test_zero3_with_another_framework_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeoffload.cli.main import main

    assert main(["plan", "--model", "gpt3-2.7b", "--gpus", "8", "--zero", "3",
                 "--framework", "megatron-2022"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--zero 3" in err and "megatron-2022" in err, err


def test_an_unknown_framework_is_refused_and_the_help_names_every_one(
        capsys: pytest.CaptureFixture[str]) -> None:
    from pipeoffload.cli.main import main

    assert main(["plan", "--model", "gpt3-2.7b", "--gpus", "8", "--framework", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown framework 'nope'" in err and "megatron-2022" in err
    parser = argparse.ArgumentParser(prog="pipeoffload")
    subcommands = parser.add_subparsers(dest="command", required=True)
    add_plan_parser(subcommands)
    text = " ".join(subcommands.choices["plan"].format_help().split())
    assert all(name in text for name in FRAMEWORKS)
