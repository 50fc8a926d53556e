"""`pipeoffload plan` searches tensor-class offload (issue 36, planner/class_offload.py): where
whole chunks cannot hide behind compute (k near 1, a slow host link), only a class plan fits
the budget; its printed command (`--offload classes:A+B`) trains, shrunk, at a lower measured
peak than without offload, which the simulator predicts exactly from the measured class bytes;
the class plan's train command is refused where train cannot run it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pipeoffload.cli.main import main
from pipeoffload.core.actions import Kind
from pipeoffload.planner.candidate import Candidate
from pipeoffload.planner.class_offload import CLASS_OFFLOAD
from pipeoffload.planner.costing import GIB, MemoryConfig
from pipeoffload.planner.evaluate import Evaluator, Extrapolation
from pipeoffload.planner.hardware import hardware_preset
from pipeoffload.planner.search import SearchConfig, SearchSpace, search
from pipeoffload.planner.train_command import train_command
from pipeoffload.planner.transformer import MlpKind, Recompute, TransformerSpec

TINY = TransformerSpec(num_layers=4, hidden=64, heads=4, kv_heads=2, ffn_hidden=128, vocab=256,
                       seq_len=512, mlp=MlpKind.SWIGLU, name="tiny")
#: An A100 whose host link moves 5 GB/s: k = 0.94 for TINY, so a whole chunk's copies of the
#: 1f1b warm-up cannot hide and the chunk planner offloads nothing.
SLOW = dataclasses.replace(hardware_preset("a100-80gb"), d2h_bytes_per_s=5e9,
                           h2d_bytes_per_s=5e9, name="a100-slow-host")
SPACE = SearchSpace(schedules=("1f1b",), pp=(2,), tp=(1,), cp=(1,), recompute=(Recompute.NONE,),
                    micro_batch_sizes=(1,))
NO_RESERVE = MemoryConfig(reserve_bytes=0)


def _budget(share: float) -> float:
    """The model state plus ``share`` of the peak activation without offload (bytes)."""
    free = search(TINY, SLOW, SearchConfig(gpus=2, global_batch=8, memory=NO_RESERVE),
                  dataclasses.replace(SPACE, offload=("none",))).best
    assert free is not None and free.feasible
    return free.memory.total - (1 - share) * free.memory.activations


def test_only_a_class_plan_fits_and_whole_chunks_do_not() -> None:
    budget = _budget(0.9)
    config = SearchConfig(gpus=2, global_batch=8, budget_bytes=budget, memory=NO_RESERVE)
    result = search(TINY, SLOW, config, SPACE)
    best = result.best
    assert best is not None and best.feasible
    assert best.candidate.offload == CLASS_OFFLOAD
    assert best.offload_spec is not None and best.offload_spec.startswith("classes:")
    evaluator = Evaluator(TINY, SLOW, NO_RESERVE, budget, Extrapolation(enabled=False))
    for option in ("none", "all"):  # the chunk targets of the same configuration do not fit
        plan = evaluator.evaluate(dataclasses.replace(best.candidate, offload=option), full=True)
        assert not plan.feasible and plan.memory.total > best.memory.total
    # the class plan's simulated peak is the uniform classes:A+B plan's (what train runs)
    assert f"--offload {best.offload_spec}" in str(
        train_command(best.candidate, TINY, offload=best.offload_spec))


def test_configurations_over_class_items_are_not_class_searched_and_a_note_says_so() -> None:
    config = SearchConfig(gpus=2, global_batch=8, budget_bytes=_budget(0.9), memory=NO_RESERVE,
                          class_items=15)  # 2 stages x 8 microbatches = 16 items
    result = search(TINY, SLOW, config, SPACE)
    assert result.best is not None and not result.best.feasible  # only a class plan fit
    assert all(p.candidate.offload != CLASS_OFFLOAD for p in result.candidates)
    assert any("tensor-class offload not searched for 1 configurations of more than 15"
               in note for note in result.notes), result.notes


def test_class_plans_are_not_searched_where_whole_chunks_hide(monkeypatch) -> None:
    """A fast host link: `all` fits at the offload-free time, so no class search runs."""
    from pipeoffload.planner import runs

    def refuse(*args: object) -> None:
        raise AssertionError("a class search ran")

    monkeypatch.setattr(runs, "plan_class_offload", refuse)
    fast = hardware_preset("a100-80gb")
    free = search(TINY, fast, SearchConfig(gpus=2, global_batch=8, memory=NO_RESERVE),
                  dataclasses.replace(SPACE, offload=("none",))).best
    assert free is not None
    budget = free.memory.total - 0.3 * free.memory.activations
    result = search(TINY, fast, SearchConfig(gpus=2, global_batch=8, budget_bytes=budget,
                                             memory=NO_RESERVE), SPACE)
    assert result.best is not None and result.best.candidate.offload == "all"
    assert all(p.candidate.offload != CLASS_OFFLOAD for p in result.candidates)


@pytest.mark.parametrize(("change", "reason"), [
    ({"tp": 2}, "tp 1 and cp 1 only"),
    ({"cp": 2}, "tp 1 and cp 1 only"),
])
def test_a_class_plan_train_cannot_run_is_refused(change: dict, reason: str) -> None:
    candidate = dataclasses.replace(Candidate("1f1b", 1, 1, 2, 1, 1, 8, Recompute.NONE,
                                              CLASS_OFFLOAD), **change)
    command = train_command(candidate, TINY, offload="classes:qkv")
    assert command.argv is None and reason in (command.refused or "")
    gpt2 = dataclasses.replace(TINY, train_model="cfg.json", model_type="gpt2")
    refused = train_command(dataclasses.replace(candidate, tp=1, cp=1), gpt2,
                            offload="classes:qkv").refused
    assert refused is not None and "not gpt2" in refused
    # a class search that chose whole chunks runs as --offload all
    assert "--offload all" in str(train_command(dataclasses.replace(candidate, tp=1, cp=1),
                                                TINY, offload="all"))


@pytest.mark.parametrize(("share", "recomputes"), [(0.9, False), (0.7, True)])
def test_plan_prints_a_class_command_that_trains_shrunk(tmp_path: Path, capsys, share: float,
                                                        recomputes: bool) -> None:
    """At 90% of the offload-free peak moving classes fits; at 70% the plan also recomputes
    one (``/recompute:``). Either command trains with the losses of a run without offload,
    bit for bit, at the peak the simulator predicts from the measured class bytes."""
    pytest.importorskip("torch")
    (tmp_path / "hw.json").write_text(SLOW.to_json())
    model = {"num_layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn_hidden": 128,
             "vocab": 256, "seq_len": 512, "mlp": "swiglu", "name": "tiny"}
    (tmp_path / "tiny.json").write_text(json.dumps(model))
    memory = _budget(share) / GIB
    assert main(["plan", "--model", str(tmp_path / "tiny.json"), "--hardware",
                 str(tmp_path / "hw.json"), "--gpus", "2", "--pp", "2", "--tp", "1", "--cp", "1",
                 "--schedules", "1f1b", "--recompute", "none", "--micro-batch-sizes", "1",
                 "--global-batch", "8", "--reserve", "0", "--memory", repr(memory), "--json",
                 "--quiet"]) == 0
    best = json.loads(capsys.readouterr().out)["best"]
    assert best["offload"] == CLASS_OFFLOAD and best["offload_run"].startswith("classes:"), best
    assert ("/recompute:" in best["offload_run"]) == recomputes, best
    argv = shlex.split(best["command"])
    assert argv[:2] == ["pipeoffload", "train"] and f"--offload {best['offload_run']}" in \
        best["command"]
    text = (Path(json.__file__).parent / "decoder.py").read_bytes()
    (tmp_path / "text.txt").write_bytes(text)
    shrunk = [*argv[2:], "--steps", "3", "--data", str(tmp_path / "text.txt"), "--no-png",
              "--eval-fraction", "0", "--p2p-timeout", "120", "--json"]
    results = []
    for offload in (best["offload_run"], "none"):
        at = argv.index("--offload") - 2  # shrunk is argv[2:]
        proc = subprocess.run([sys.executable, "-m", "pipeoffload.cli", "train",
                               *shrunk[:at + 1], offload, *shrunk[at + 2:]],
                              cwd=tmp_path, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    result, plain = results
    print(f"\n{best['offload_run']}: measured {result['peak_activation_bytes']}, predicted "
          f"{result['predicted_peak_activation_bytes']}, without offload (measured) "
          f"{result['peak_activation_without_offload_bytes']}, --offload none "
          f"{plain['peak_activation_bytes']}")
    assert len(result["losses"]) == 3 and result["losses"] == plain["losses"]
    measured, without = result["peak_activation_bytes"], \
        result["peak_activation_without_offload_bytes"]
    assert measured[0] < without[0]  # the first rank holds two microbatches: classes moved
    assert all(m <= w for m, w in zip(measured, without))
    # the simulator, given the measured share each stage's classes move, predicts the meter
    assert measured == [int(b) for b in result["predicted_peak_activation_bytes"]]


@pytest.mark.parametrize(("spec", "change", "says"), [
    ("classes:mlp_norm/recompute:qkv", {}, "not 'qkv' (layer_input is what the others"),
    ("classes:qkv/recompute:layer_input", {}, "not 'layer_input'"),
    ("classes:qkv/recompute:qkv", {}, "not 'qkv'"),
    ("classes:qkv/mlp_act", {}, "write classes:A+B/recompute:C+D"),
    ("classes:mlp_act/recompute:mlp_act", {}, "'mlp_act' is both moved and recomputed"),
    ("classes:qkv+bogus", {}, "unknown tensor class 'bogus'"),
    ("classes:", {}, "no class"),
    ("classes:qkv", {"tp": 2}, "tp 1 and cp 1 only (got tp 2, cp 1)"),
    # lgd / full regions save outside the modules that name the classes: nothing would move
    ("classes:qkv", {"recompute": "lgd"}, "does not recompute (got --recompute lgd"),
    ("classes:qkv", {"recompute": "full"}, "does not recompute (got --recompute full"),
])
def test_train_refuses_class_offload_it_cannot_run(spec: str, change: dict, says: str) -> None:
    from pipeoffload.errors import ConfigError
    from pipeoffload.training.train import TrainConfig, build_plan

    with pytest.raises(ConfigError, match=re.escape(says)):
        TrainConfig(offload=spec, **change)
    plan = build_plan(TrainConfig(offload=" classes:qkv+mlp_hidden", pp=2))
    chosen = {choice.names for _, choice in plan.schedule.classes}
    assert chosen == {(("qkv", "mlp_hidden"), ())}
    plan = build_plan(TrainConfig(offload="classes:qkv/recompute:mlp_norm+mlp_act", pp=2))
    chosen = {choice.names for _, choice in plan.schedule.classes}
    assert chosen == {(("qkv",), ("mlp_norm", "mlp_act"))}
    plan = build_plan(TrainConfig(offload="classes:/recompute:attn_norm", pp=2))
    assert {choice.names for _, choice in plan.schedule.classes} == {((), ("attn_norm",))}
    assert not plan.schedule.has_kind(Kind.OFFLOAD)  # nothing moves: no copies planned


def test_train_refuses_class_offload_of_a_family_it_does_not_tag(tmp_path: Path) -> None:
    from pipeoffload.errors import ConfigError
    from pipeoffload.training.data_config import DataConfig
    from pipeoffload.training.train import TrainConfig, build_plan

    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 4, "n_head": 4,
        "n_positions": 64, "architectures": ["GPT2LMHeadModel"]}))
    config = TrainConfig(hf_model=str(tmp_path / "gpt2"), offload="classes:qkv", pp=2,
                         data=DataConfig(seq_len=32, batch_size=8))
    with pytest.raises(ConfigError, match="tags tensor classes of llama models and the "
                                          "reference model, not gpt2"):
        build_plan(config)
