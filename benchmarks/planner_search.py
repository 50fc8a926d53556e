"""Whole `pipeoffload plan` searches at scale, timed, against the exhaustive search's answer.

    python benchmarks/planner_search.py                  # the seven searches (about a minute)
    python benchmarks/planner_search.py --only 42.9b     # one of them
    python benchmarks/planner_search.py --reference      # re-record the exhaustive answers (hours)
    python benchmarks/planner_search.py --reduced-error 42.9b   # every candidate reduced vs full
    python benchmarks/planner_search.py --public-call    # issue 22's single offload plan, 3 times

Each search runs in this process as `pipeoffload plan ... --json --quiet` (nothing fixed but
the model, GPUs, hardware and batch), one after the other; the table gives its wall and CPU
seconds (time.perf_counter / time.process_time), its best plan and step time, and next to them
the exhaustive search's, recorded in planner_search_reference.json by ``--reference``:
`plan --no-extrapolate --tolerance 0`, which simulates every candidate in full unless a tested
lower bound shows it cannot win (planner/search.py, Note: [branch and bound]). The times
include the verdict line's second, narrower search (planner/verdict.py). The last columns run
`plan --no-extrapolate` with every dimension of the chosen plan fixed (tp, pp, schedule,
chunks, group size, recompute, offload, microbatch size; dp and m follow) and compare its step
time.

``--reduced-error CASE`` evaluates every candidate of that search twice, reduced (the search's
default) and with all microbatches, and prints the worst relative step-time and memory errors
over those the reduced simulation kept (planner/reduced.py), and how the search's first-count
look at offloaded plans compares with their full peak (wrongly over: over the budget by more
than ``Extrapolation.memory_tolerance`` at the first count, as the search prunes, yet fitting in
full); it stores them in the same file.

The recorded answers depend on the planner's cost model: after a change to it (transformer.py,
layer_time.py, gemm.py, costing.py, hardware.py, presets.py, evaluate.py's pricing), rerun
``--reference`` and ``--reduced-error 42.9b`` and update docs/planner.md. Timing is noisy on a
shared machine: CPU seconds are the steadier figure.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from pipeoffload.cli.main import main as cli_main

REFERENCE = Path(__file__).resolve().with_name("planner_search_reference.json")

# The searches of issue 37, each at the scale and global batch a published run used.
# gpt3-175b's shape (GeLU, MHA, vocab 50257, seq 2048) with the layers and hidden size of
# Narayanan et al. 2021's Table 1 rows (1008B on 3072 GPUs, batch 3072; 529.6B on 2520, batch
# 2520; 310.1B on 1920, batch 2160; --hidden keeps a head width of 128); GPT-3 175B on 12288
# GPUs at batch 6144; Llama 3 405B as Dubey et al. 2024 (Table 4) ran it, 16384 H100s and 16M
# tokens (2048 sequences of 8192); Llama 3 70B on 2048 H100s at 4096 x 8192; the paper's 42.9B
# at seq 16384 on 32 A100s, batch 256 (docs/planner.md, (b)).
CASES: dict[str, list[str]] = {
    "1t": ["--model", "gpt3-175b", "--layers", "128", "--hidden", "25600", "--gpus", "3072",
           "--global-batch", "3072"],
    "530b": ["--model", "gpt3-175b", "--layers", "105", "--hidden", "20480", "--gpus", "2520",
             "--global-batch", "2520"],
    "310b": ["--model", "gpt3-175b", "--hidden", "16384", "--gpus", "1920",
             "--global-batch", "2160"],
    "175b": ["--model", "gpt3-175b", "--gpus", "12288", "--global-batch", "6144"],
    "405b": ["--model", "llama3-405b", "--hardware", "h100-80gb", "--gpus", "16384",
             "--seq", "8192", "--global-batch", "2048"],
    "70b": ["--model", "llama3-70b", "--hardware", "h100-80gb", "--gpus", "2048",
            "--seq", "8192", "--global-batch", "4096"],
    "42.9b": ["--model", "pipeoffload-42.9b", "--seq", "16384", "--gpus", "32",
              "--global-batch", "256"],
}


def run_plan(argv: list[str]) -> tuple[dict[str, Any], float, float]:
    """`pipeoffload plan ARGV --json --quiet` in this process: (its JSON, wall s, CPU s)."""
    out = io.StringIO()
    wall, cpu = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(out):
        cli_main(["plan", *argv, "--json", "--quiet"])
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return json.loads(out.getvalue()), wall, cpu


def describe(plan: dict[str, Any] | None) -> str:
    if plan is None:
        return "nothing fits"
    group = f" g{plan['group_size']}" if plan["group_size"] else ""
    return (f"{plan['schedule']} tp{plan['tp']} pp{plan['pp']} dp{plan['dp']} "
            f"v{plan['chunks']}{group} b{plan['microbatch_size']} m{plan['microbatches']} "
            f"{plan['recompute']} {plan['offload']}")


def describe_plan(plan: Any) -> str:
    """``describe`` for a planner Plan object."""
    from pipeoffload.planner.report import plan_json

    return describe(plan_json(plan))


def fixed_flags(plan: dict[str, Any]) -> list[str]:
    """The flags that pin every dimension of a plan (dp and m follow from the GPUs and the
    global batch)."""
    schedule = "grouped-interleaved" if plan["schedule"] in ("po-h", "po-f") else plan["schedule"]
    flags = ["--tp", str(plan["tp"]), "--pp", str(plan["pp"]), "--schedules", schedule,
             "--recompute", plan["recompute"], "--offload", plan["offload"],
             "--micro-batch-sizes", str(plan["microbatch_size"]),
             "--chunks", str(plan["chunks"])]
    if plan["group_size"]:
        flags += ["--group-sizes", "max" if plan["group_size"] == plan["pp"] else "min"]
    return flags


def load_reference() -> dict[str, Any]:
    return json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {}


def save_reference(data: dict[str, Any]) -> None:
    REFERENCE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def record_reference(names: list[str]) -> None:
    data = load_reference()
    for name in names:
        result, wall, cpu = run_plan([*CASES[name], "--no-extrapolate", "--tolerance", "0"])
        best = result["best"] if result["feasible"] else None
        data.setdefault("searches", {})[name] = {
            "argv": CASES[name], "best": best and describe(best),
            "step_time": best and best["step_time"], "wall_s": wall, "cpu_s": cpu,
            "search": result["search"]}
        save_reference(data)
        print(f"{name}: {describe(best)} {best and best['step_time']:.4f} s "
              f"(exhaustive search: {wall:.0f} s wall, {cpu:.0f} s CPU)", flush=True)


def reduced_error(name: str) -> None:
    """Every candidate of search ``name``: reduced against full (see the module docstring)."""
    from pipeoffload.cli.main import build_parser
    from pipeoffload.cli.plan import _space, _spec
    from pipeoffload.errors import ConfigError
    from pipeoffload.planner.costing import MemoryConfig
    from pipeoffload.planner.evaluate import Evaluator
    from pipeoffload.planner.frameworks import framework_preset
    from pipeoffload.planner.hardware import load_hardware
    from pipeoffload.planner.search import SearchConfig, configurations

    args = build_parser().parse_args(["plan", *CASES[name]])
    spec, hw = _spec(args, framework_preset(args.framework)), load_hardware(args.hardware)
    space = _space(args)
    global_batch = args.global_batch if args.global_batch is not None else 4 * args.gpus
    config = SearchConfig(gpus=args.gpus, global_batch=global_batch)
    evaluator = Evaluator(spec, hw, MemoryConfig(), hw.hbm_bytes,
                          host_budget_bytes=hw.host_bytes_per_node)  # as the search prices
    started = time.process_time()
    rows = []
    best = None  # every candidate simulated in full: the exhaustive answer, for comparison
    screens = []
    candidates = [c for group in configurations(spec, hw, config, space) for c in group]
    for index, candidate in enumerate(candidates):
        try:
            reduced = evaluator.evaluate(candidate)
            full = evaluator.evaluate(candidate, full=True) if reduced.extrapolated else reduced
        except ConfigError:
            continue
        rows.append((reduced.extrapolated, reduced.step_time / full.step_time - 1,
                     reduced.memory.total / full.memory.total - 1,
                     reduced.feasible != full.feasible, candidate))
        first = evaluator.first_count_memory(candidate) if candidate.offload != "none" else None
        if first is not None:  # the search's look at an offloaded plan (planner/search.py)
            over = evaluator.budget_bytes * (1 + evaluator.extrapolation.memory_tolerance)
            screens.append((first / full.memory.total - 1, first > over and full.feasible,
                            candidate))
        if full.feasible and (best is None or (full.step_time, full.memory.total)
                              < (best.step_time, best.memory.total)):
            best = full
        if index % 200 == 0:
            print(f"  {index}/{len(candidates)} candidates, {time.process_time() - started:.0f} s",
                  file=sys.stderr, flush=True)
    kept = [row for row in rows if row[0]]
    worst_time = max(kept, key=lambda row: abs(row[1]), default=None)
    worst_memory = max(kept, key=lambda row: abs(row[2]), default=None)
    print(f"every candidate simulated in full: best {best and describe_plan(best)} "
          f"{best and best.step_time}", flush=True)
    summary = {
        "search": name, "argv": CASES[name], "candidates": len(rows), "reduced": len(kept),
        "worst_step_time_error": worst_time and worst_time[1],
        "worst_step_time_candidate": worst_time and repr(worst_time[4]),
        "worst_memory_error": worst_memory and worst_memory[2],
        "worst_memory_candidate": worst_memory and repr(worst_memory[4]),
        "feasibility_flips": sum(row[3] for row in kept),
        "first_count_screens": len(screens),
        "first_count_worst_memory_error": max((row[0] for row in screens), key=abs,
                                              default=None),
        "first_count_largest_overshoot": max((row[0] for row in screens), default=None),
        "first_count_wrongly_over_budget": sum(row[1] for row in screens),
        "first_count_wrongly_over_candidates": [repr(row[2]) for row in screens if row[1]],
        "every_candidate_best": best and describe_plan(best),
        "every_candidate_step_time": best and best.step_time,
        "cpu_s": time.process_time() - started}
    data = load_reference()
    data["reduced_error"] = summary
    save_reference(data)
    print(json.dumps(summary, indent=1))


def compare(names: list[str]) -> None:
    reference = load_reference().get("searches", {})
    header = ("| search | wall s | CPU s | of which verdict, wall s | best plan | step s | "
              "exhaustive best | step s | vs exhaustive | fixed, --no-extrapolate: step s | "
              "vs search |")
    print(header)
    print("|" + "---|" * header.count(" | ") + "---|")
    for name in names:
        result, wall, cpu = run_plan(CASES[name])
        best = result["best"] if result["feasible"] else None
        ref = reference.get(name)
        vs_ref = "-"
        if best and ref and ref["step_time"]:
            vs_ref = f"{best['step_time'] / ref['step_time'] - 1:+.3%}"
        fixed_step, vs_fixed = "-", "-"
        if best:
            fixed, _, _ = run_plan([*CASES[name], *fixed_flags(best), "--no-extrapolate"])
            same = fixed["fixed"] and describe(fixed["best"]) == describe(best)
            fixed_step = f"{fixed['best']['step_time']:.4f}" + ("" if same else " (other plan)")
            vs_fixed = f"{best['step_time'] / fixed['best']['step_time'] - 1:+.3%}"
        verdict = wall - result["search"]["seconds"]  # what the verdict's search added
        print(f"| {name} | {wall:.1f} | {cpu:.1f} | {verdict:.1f} | {describe(best)} | "
              f"{best['step_time'] if best else math.nan:.4f} | "
              f"{ref['best'] if ref else '(not recorded)'} | "
              f"{ref['step_time'] if ref and ref['step_time'] else math.nan:.4f} | {vs_ref} | "
              f"{fixed_step} | {vs_fixed} |", flush=True)
    summary = load_reference().get("reduced_error")
    if summary:
        print(f"\nreduced simulation over the whole {summary['search']} search "
              f"({' '.join(summary.get('argv', ['(flags not recorded)']))}): "
              f"{summary['reduced']} of {summary['candidates']} candidates reduced, worst "
              f"step-time error {summary['worst_step_time_error']:+.2e}, worst memory error "
              f"{summary['worst_memory_error']:+.2e}, {summary['feasibility_flips']} "
              f"feasibility flips; {summary['first_count_screens']} offloaded plans looked at "
              f"at their first count: worst memory error "
              f"{summary['first_count_worst_memory_error']:+.2e}, "
              f"{summary['first_count_wrongly_over_budget']} wrongly over the budget")


def public_call(repeats: int = 3) -> None:
    """Time ``po.plan_schedule`` on issue 22's case (p = 32, m = 256, v = 4, g = 16, offload
    all at ratio 0.5): CPU and wall seconds of each call, in this process."""
    import pipeoffload as po

    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        plan = po.plan_schedule("grouped-interleaved", pp=32, microbatches=256, chunks=4,
                                group_size=16, offload="all", offload_ratio=0.5)
        print(f"plan_schedule p32 m256 v4 g16 all: {time.process_time() - cpu:.2f} s CPU, "
              f"{time.perf_counter() - wall:.2f} s wall, offloaded "
              f"{plan.report.offloaded_fraction:.1%}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(CASES), action="append")
    parser.add_argument("--reference", action="store_true",
                        help="record the exhaustive searches' answers (hours)")
    parser.add_argument("--reduced-error", choices=sorted(CASES), default=None, metavar="CASE",
                        help="reduced against full simulation over one search's candidates")
    parser.add_argument("--public-call", action="store_true",
                        help="time issue 22's po.plan_schedule call three times")
    args = parser.parse_args(argv)
    names = args.only or list(CASES)
    if args.public_call:
        public_call()
    elif args.reference:
        record_reference(names)
    elif args.reduced_error:
        reduced_error(args.reduced_error)
    else:
        compare(names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
