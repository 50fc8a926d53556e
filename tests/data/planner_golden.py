"""Record (or check) the plans `pipeoffload plan` chooses for a fixed set of searches.

Run: python tests/data/planner_golden.py            rewrite planner_golden.json
     python tests/data/planner_golden.py --check    compare the current code with it

The file pins each search's chosen plan (every dimension), its step time and memory, so that
work on the search's speed can show it changed no answer
(tests/test_planner_golden.py). The plans depend on the cost model: a change meant to alter
them (planner/transformer.py, layer_time.py, gemm.py, costing.py, hardware.py, presets.py,
evaluate.py's pricing) rewrites the file, and the commit says so; a speed change must not.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pipeoffload.planner.costing import GIB
from pipeoffload.planner.evaluate import Plan
from pipeoffload.planner.hardware import hardware_preset
from pipeoffload.planner.presets import model_preset
from pipeoffload.planner.search import SearchConfig, SearchSpace, search
from pipeoffload.planner.transformer import MlpKind, TransformerSpec

GOLDEN = Path(__file__).with_name("planner_golden.json")

SMALL = TransformerSpec(num_layers=16, hidden=2048, heads=16, kv_heads=16, ffn_hidden=8192,
                        vocab=32000, seq_len=4096, mlp=MlpKind.GELU, name="small")

# name -> (model, hardware, search config, search space): small enough for the test suite, and
# between them every schedule family, offload targets and the nothing-fits path.
CASES: dict[str, tuple[TransformerSpec, str, SearchConfig, SearchSpace]] = {
    "small-8gpu-20gib": (SMALL, "a100-80gb", SearchConfig(gpus=8, global_batch=32,
                                                          budget_bytes=20 * GIB), SearchSpace()),
    "gpt3-2.7b-seq4096-8gpu-40gib": (
        model_preset("gpt3-2.7b", seq_len=4096), "a100-80gb",
        SearchConfig(gpus=8, global_batch=32, budget_bytes=40 * GIB), SearchSpace()),
    "gpt3-13b-8gpu-24gib-nothing-fits": (
        model_preset("gpt3-13b"), "a100-80gb",
        SearchConfig(gpus=8, global_batch=32, budget_bytes=24 * GIB), SearchSpace()),
    "pipeoffload-5.8b-seq16384-16gpu": (
        model_preset("pipeoffload-5.8b", seq_len=16384), "a100-80gb",
        SearchConfig(gpus=16, global_batch=64), SearchSpace()),
    "llama3-8b-16gpu-h100-24gib": (
        model_preset("llama3-8b"), "h100-80gb",
        SearchConfig(gpus=16, global_batch=128, budget_bytes=24 * GIB), SearchSpace()),
    "pipeoffload-42.9b-16-layers-seq16384-8gpu-tp1": (
        model_preset("pipeoffload-42.9b", seq_len=16384, num_layers=16), "a100-80gb",
        SearchConfig(gpus=8, global_batch=16), SearchSpace(tp=(1,))),
}


def plan_record(plan: Plan) -> dict[str, Any]:
    """A plan's dimensions and figures (floats as repr: exact)."""
    c = plan.candidate
    return {"schedule": c.schedule, "dp": c.dp, "tp": c.tp, "cp": c.cp, "pp": c.pp,
            "chunks": c.chunks,
            "group_size": c.group_size, "micro_batch": c.micro_batch,
            "microbatches": c.microbatches, "recompute": c.recompute.value,
            "offload": c.offload, "step_time": repr(plan.step_time),
            "memory_bytes": repr(plan.memory.total), "feasible": plan.feasible,
            "simulated_microbatches": list(plan.simulated_microbatches)}


def outcome(name: str) -> dict[str, Any]:
    """What the search ``name`` chooses: its best plan (the other rows of its table are the
    plans it happened to simulate on the way, which speed work may change)."""
    spec, hardware, config, space = CASES[name]
    result = search(spec, hardware_preset(hardware), config, space)
    return {"best": plan_record(result.best) if result.best else None}


def load() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of rewriting")
    args = parser.parse_args(argv)
    got = {name: outcome(name) for name in CASES}
    if args.check:
        want = load()
        differ = [name for name in CASES if want.get(name) != got[name]]
        print("same plans" if not differ else f"changed: {', '.join(differ)}")
        return 1 if differ else 0
    GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN} ({len(got)} searches)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
