"""The planner prints only commands `pipeoffload train` accepts, and refuses the rest."""

from __future__ import annotations

import argparse
import dataclasses
import shlex

import pytest

from pipeoffload.planner.evaluate import RECOMPUTE_AND_OFFLOAD, Candidate
from pipeoffload.planner.presets import model_preset as model_spec
from pipeoffload.planner.train_command import train_command
from pipeoffload.planner.transformer import Recompute

BASE = Candidate("grouped-interleaved", dp=2, tp=2, pp=4, chunks=2, micro_batch=1,
                 microbatches=8, recompute=Recompute.LGD, offload="all", group_size=2)


def test_tp_recompute_and_bf16_are_flags_of_the_command() -> None:
    spec = model_spec("pipeoffload-42.9b")
    command = train_command(BASE, spec)
    assert command.refused is None and "#" not in command.argv
    for flag in ("--pp 4", "--dp 2", "--tp 2", "--schedule po-f", "--recompute lgd",
                 "--dtype bf16", "--batch-size 16", f"--kv-heads {spec.kv_heads}"):
        assert flag in command.argv
    mixed = train_command(dataclasses.replace(BASE, offload=RECOMPUTE_AND_OFFLOAD), spec)
    assert f"--offload {RECOMPUTE_AND_OFFLOAD}" in mixed.argv
    full = train_command(dataclasses.replace(BASE, recompute=Recompute.FULL), spec)
    assert "--recompute full" in full.argv  # mixed with po-f's offload, per layer
    fp32 = dataclasses.replace(spec, activation_bytes=4)
    assert "--dtype" not in train_command(BASE, fp32).argv


@pytest.mark.parametrize(("change", "spec_change", "reason"), [
    ({"tp": 16}, {}, "tp=16 does not divide kv_heads=8"),
    ({}, {"activation_bytes": 1}, "1 bytes per element"),
    ({"recompute": Recompute.SELECTIVE}, {}, "recompute option is selective"),
])
def test_what_train_cannot_run_is_refused(change, spec_change, reason) -> None:
    spec = dataclasses.replace(model_spec("pipeoffload-42.9b"), **spec_change)
    command = train_command(dataclasses.replace(BASE, **change), spec)
    assert command.argv is None and reason in command.refused
    assert str(command).startswith("pipeoffload train cannot run this plan: ")


def test_every_printed_command_is_one_train_accepts(capsys) -> None:
    """Each plan of a real search, parsed by train's own parser into a TrainConfig (which
    checks layout, batch, tp divisibility, dtype and recompute) and planned into a schedule."""
    pytest.importorskip("torch")
    import json

    from pipeoffload.cli.plan import add_plan_parser
    from pipeoffload.cli.train import add_train_parser, config_from_args
    from pipeoffload.training.train import build_plan

    parser = argparse.ArgumentParser(prog="pipeoffload")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", "--model", "gpt3-2.7b", "--gpus", "8", "--hardware",
                              "a100", "--seq", "4096", "--memory", "24", "--global-batch", "32",
                              "--json", "--top", "10", "--quiet", "--no-verdict"])
    assert args.handler(args) == 0
    plans = json.loads(capsys.readouterr().out)["candidates"]
    train = argparse.ArgumentParser(prog="pipeoffload")
    add_train_parser(train.add_subparsers(dest="command", required=True))
    assert any(plan["tp"] > 1 for plan in plans) and any(p["recompute"] != "none" for p in plans)
    for plan in plans:
        assert plan["command"] is not None, plan["command_refused"]
        argv = shlex.split(plan["command"])
        assert argv[:2] == ["pipeoffload", "train"]
        config, _ = config_from_args(train.parse_args(argv[1:]))
        assert (config.pp, config.dp, config.tp) == (plan["pp"], plan["dp"], plan["tp"])
        assert (config.recompute, config.dtype) == (plan["recompute"], "bf16")
        schedule = build_plan(config).schedule
        assert schedule.num_ranks == plan["pp"] and schedule.microbatches == plan["microbatches"]


def test_the_command_says_which_optimizer_sharding_the_memory_counted() -> None:
    """train shards the optimizer by default at dp * cp > 1 (--zero 1), so a plan priced with
    it whole says --zero 0; one priced sharded says --zero 1; with nothing to shard, neither."""
    spec = model_spec("pipeoffload-42.9b")
    for change, whole, sharded in (({}, "--zero 0", "--zero 1"),
                                   ({"dp": 1, "cp": 2}, "--zero 0", "--zero 1"),
                                   ({"dp": 1}, None, None)):
        candidate = dataclasses.replace(BASE, **change)
        for flag, sharding in ((whole, False), (sharded, True)):
            argv = train_command(candidate, spec, sharded_optimizer=sharding).argv
            assert argv is not None and ("--zero" in argv) == (flag is not None), argv
            assert flag is None or flag in argv


def test_a_zero3_plan_says_zero_3_where_train_runs_it_and_why_not_elsewhere() -> None:
    """A plan priced as FSDP2 stages (plan --zero 3) carries --zero 3 at dp > 1, tp 1, cp 1;
    at dp 1, tp > 1 or cp > 1 (what train refuses, training/train.py _ZERO3_LIMITS) the
    command is refused in words naming the reason, never printed without --zero 3."""
    spec = model_spec("pipeoffload-42.9b")
    ok = dataclasses.replace(BASE, tp=1, cp=1)
    assert ok.dp > 1
    argv = train_command(ok, spec, sharded_optimizer=True, fsdp=True).argv
    assert argv is not None and "--zero 3" in argv and "--zero 1" not in argv, argv
    for change, words in (({"dp": 1}, "dp 1"), ({"tp": 2}, "tp 2, cp 1"),
                          ({"cp": 2}, "tp 1, cp 2")):
        command = train_command(dataclasses.replace(ok, **change), spec,
                                sharded_optimizer=True, fsdp=True)
        assert command.argv is None and command.refused is not None
        assert "--zero 3" in command.refused and words in command.refused, command.refused
        assert "--zero 1" in command.refused  # what to plan instead
