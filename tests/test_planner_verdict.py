"""The verdict on offload (planner/verdict.py, Note [verdict and the chosen plan]): it compares
the best plan without offload with the best plan with it, each within the budget, and its line
never contradicts the chosen plan: never "not needed" beside a faster feasible offloading plan,
never offload chosen beside a faster plan without it."""

from __future__ import annotations

import argparse
import json

import pytest

from pipeoffload.cli.plan import add_plan_parser
from pipeoffload.planner.costing import GIB
from pipeoffload.planner.hardware import hardware_preset
from pipeoffload.planner.presets import model_preset
from pipeoffload.planner.reduced import Extrapolation
from pipeoffload.planner.search import SearchConfig, SearchSpace, search
from pipeoffload.planner.transformer import MlpKind, TransformerSpec
from pipeoffload.planner.verdict import offload_verdict, offloads, settled

A100 = hardware_preset("a100-80gb")
SMALL = TransformerSpec(num_layers=16, hidden=2048, heads=16, kv_heads=16, ffn_hidden=8192,
                        vocab=32000, seq_len=4096, mlp=MlpKind.GELU, name="small")
GPT3_2_7B = model_preset("gpt3-2.7b", seq_len=4096)
LONG = model_preset("pipeoffload-42.9b", seq_len=32768, num_layers=16)

# (model, GPUs, global batch, budget GiB, tolerance, space): between them the first search's
# plan standing, the second search's faster plan replacing it (a tolerance of 5% lets the first
# search stop early), offload not needed, chosen though not needed, and needed.
CASES = {
    "small-30gib": (SMALL, 8, 32, 30, 0.005, SearchSpace()),
    "small-14gib-tolerance-5%": (SMALL, 8, 32, 14, 0.05, SearchSpace()),
    "gpt3-2.7b-20gib-tolerance-5%": (GPT3_2_7B, 8, 32, 20, 0.05, SearchSpace()),
    "gpt3-2.7b-30gib-tolerance-20%": (GPT3_2_7B, 8, 32, 30, 0.2, SearchSpace()),
    "long-sequence-40gib-needed": (LONG, 8, 16, 40, 0.005,
                                   SearchSpace(tp=(1,), recompute=("none", "lgd"))),
}


def _verdict(name: str):  # -> (SearchResult settled, Verdict, SearchConfig, SearchSpace)
    spec, gpus, batch, budget, tolerance, space = CASES[name]
    config = SearchConfig(gpus=gpus, global_batch=batch, budget_bytes=budget * GIB,
                          tolerance=tolerance)
    result = search(spec, A100, config, space)
    verdict = offload_verdict(spec, A100, config, space, result)
    return settled(result, verdict), verdict, config, space


def _exhaustive_best(name: str, offload: tuple[str, ...]):  # -> Plan | None
    spec, gpus, batch, budget, _, space = CASES[name]
    config = SearchConfig(gpus=gpus, global_batch=batch, budget_bytes=budget * GIB,
                          tolerance=0.0, top_k=1, extrapolation=Extrapolation(enabled=False))
    options = tuple(o for o in space.offload if (o == "none") == ("none" in offload))
    best = search(spec, A100, config, SearchSpace(
        schedules=space.schedules, recompute=space.recompute, tp=space.tp,
        offload=options)).best
    return best if best is not None and best.feasible else None


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_verdict_never_contradicts_the_chosen_plan(name: str) -> None:
    result, verdict, config, _ = _verdict(name)
    best, other = verdict.best, verdict.other
    assert best is not None and best.feasible
    assert result.best is best  # the table and --json lead with the plan the verdict chose
    line = verdict.line()
    if other is not None:
        assert other.feasible and offloads(other) != offloads(best)
        # the other kind's best is never faster: it would have been chosen
        assert (best.step_time, best.memory.total) <= (other.step_time, other.memory.total)
        assert "faster" not in line
    if not offloads(best):
        assert line.startswith("verdict: offload not needed")
    elif other is None:
        assert line.startswith("verdict: offload needed") and verdict.needed
    else:
        assert line.startswith("verdict: offload chosen, not needed") and not verdict.needed
    # like with like: each kind's plan is within the tolerance of that kind's exhaustive best
    for plan in (best, other):
        if plan is None:
            continue
        kind = ("all",) if offloads(plan) else ("none",)
        exhaustive = _exhaustive_best(name, kind)
        assert exhaustive is not None
        assert plan.step_time <= exhaustive.step_time * (1 + config.tolerance) + 1e-12
    if other is None and offloads(best):  # needed: truly nothing fits without offload
        assert _exhaustive_best(name, ("none",)) is None


def test_a_faster_plan_of_the_other_kind_replaces_the_first_searchs() -> None:
    """The tolerance lets the first search stop at a plan without offload; the second search
    finds a faster offloading plan, which becomes the chosen one and leads the ranking."""
    swapped = [name for name in CASES if _verdict(name)[1].swapped]
    assert "small-14gib-tolerance-5%" in swapped and "small-30gib" not in swapped
    result, verdict, _, _ = _verdict("small-14gib-tolerance-5%")
    assert offloads(verdict.best) and not offloads(verdict.other)
    assert verdict.other.step_time > verdict.best.step_time
    assert [plan.candidate for plan in result.candidates].count(verdict.best.candidate) == 1


def test_plan_json_carries_the_chosen_plan_and_the_verdict(
        capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="pipeoffload")
    add_plan_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", "--model", "gpt3-2.7b", "--seq", "4096", "--gpus", "8",
                              "--global-batch", "32", "--memory", "20", "--tolerance", "0.05",
                              "--json", "--quiet"])
    assert args.handler(args) == 0
    data = json.loads(capsys.readouterr().out)
    verdict = data["verdict"]
    assert verdict["chosen_by_verdict"] and verdict["best_offloads"]
    assert data["best"]["offload"] != "none" and verdict["other"]["offload"] == "none"
    assert verdict["other"]["step_time"] > data["best"]["step_time"]
    assert data["best"] == data["candidates"][0]
    assert verdict["line"].startswith("verdict: offload chosen, not needed")
