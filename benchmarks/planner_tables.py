"""Print the tables of docs/planner.md and draw docs/activation_vs_pp.png.

(a) per-device activation memory vs pipeline size (po-f falls, 1F1B and interleaved stay flat);
(b) the paper's case: PP with offload against interleaved 1F1B + TP8 + SP on 32 A100s;
(c) an impossible budget and the nearest plan.

    python benchmarks/planner_tables.py            # all three (a few minutes on 2 cores)
    python benchmarks/planner_tables.py --only a   # one of them
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from pipeoffload.planner.costing import GIB, Layout, MemoryConfig, stage_costs
from pipeoffload.planner.evaluate import Candidate, Evaluator
from pipeoffload.planner.hardware import hardware_preset
from pipeoffload.planner.presets import model_preset
from pipeoffload.planner.ratio import RunConfig, offload_ratio
from pipeoffload.planner.report import render_table
from pipeoffload.planner.search import SearchConfig, SearchSpace, search

DOCS = Path(__file__).resolve().parent.parent / "docs"
PPS = (4, 8, 16, 32)
MICROBATCHES = 64


def _activation_rows() -> tuple[list[str], dict[str, list[float]]]:
    spec = model_preset("pipeoffload-42.9b", seq_len=16384, num_layers=64)
    hw = hardware_preset("a100-80gb")
    evaluator = Evaluator(spec, hw, MemoryConfig(), math.inf)
    columns = {"1f1b": [], "interleaved-1f1b (v=2)": [], "po-h": [], "po-f": []}
    for p in PPS:
        for name, candidate in (
            ("1f1b", Candidate("1f1b", 1, 1, p, 1, 1, MICROBATCHES)),
            ("interleaved-1f1b (v=2)", Candidate("interleaved-1f1b", 1, 1, p, 2, 1,
                                                 MICROBATCHES)),
            ("po-h", Candidate("grouped-interleaved", 1, 1, p, 2, 1, MICROBATCHES,
                               offload="chunks:1", group_size=p // 2)),
            ("po-f", Candidate("grouped-interleaved", 1, 1, p, 2, 1, MICROBATCHES,
                               offload="all", group_size=p // 2)),
        ):
            columns[name].append(evaluator.evaluate(candidate).memory.activations / GIB)
    k = offload_ratio(spec, hw, RunConfig()).k
    header = [f"(a) {spec.name} with 64 layers, seq 16384, b=1, m={MICROBATCHES}, tp=1, dp=1, "
              f"{hw.name} (k = {k:.2f}; two GPUs share a host link): activation GiB on the "
              f"fullest device"]
    return header, columns


def table_a(png: bool = True) -> str:
    header, columns = _activation_rows()
    lines = header + ["", "| p | " + " | ".join(columns) + " |",
                      "|---|" + "---|" * len(columns)]
    for i, p in enumerate(PPS):
        lines.append(f"| {p} | " + " | ".join(f"{columns[c][i]:.1f}" for c in columns) + " |")
    if png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter

        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name, values in columns.items():
            ax.plot(PPS, values, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xticks(PPS, [str(p) for p in PPS])
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.set_xlabel("pipeline ranks p (1 GPU each)")
        ax.set_ylabel("peak activation per device (GiB)")
        ax.set_title("GPT 64 layers, h=8192, seq 16k, A100: activation vs pipeline size")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(DOCS / "activation_vs_pp.png", dpi=120)
        plt.close(fig)
        lines.append(f"\nwrote {DOCS / 'activation_vs_pp.png'}")
    return "\n".join(lines)


def table_b(global_batch: int) -> str:
    spec = model_preset("pipeoffload-42.9b", seq_len=16384)
    hw = hardware_preset("a100-80gb")
    config = SearchConfig(gpus=32, global_batch=global_batch, top_k=1)
    tp8 = search(spec, hw, config, SearchSpace(schedules=("interleaved-1f1b",), tp=(8,),
                                               offload=("none",))).best
    assert tp8 is not None
    pp_config = SearchConfig(gpus=32, global_batch=global_batch, top_k=1,
                             budget_bytes=tp8.memory.total)
    pp = search(spec, hw, pp_config, SearchSpace(tp=(1,), offload=("chunks:1", "all"))).best
    assert pp is not None
    layer = stage_costs(spec, hw, Layout(1, 8, 4, 1, RunConfig(tp=8)))[1]
    compute = layer.flops.total / hw.bf16_flops_per_s
    lines = [f"(b) {spec.name}, seq 16384, 32 x {hw.name}, global batch {global_batch}: "
             f"best interleaved 1F1B + TP8 + SP, then the best TP=1 plan with offload within "
             f"its memory ({tp8.memory_gib:.1f} GiB)", "", render_table([tp8, pp]), ""]
    if pp.feasible:
        lines.append(f"MFU {pp.mfu:.1%} vs {tp8.mfu:.1%}: {pp.mfu / tp8.mfu - 1:+.1%} for PP + "
                     f"offload, at {pp.memory_gib:.1f} vs {tp8.memory_gib:.1f} GiB per device")
    else:
        lines.append("no TP=1 plan with offload fits in the TP8 plan's memory")
    lines.append(f"TP8 + SP collectives add {layer.chunk_s / compute - 1:.1%} to a layer's "
                 f"F+I+W (not overlapped); the TP8 plan's bubble is {tp8.bubble_rate:.1%}, the "
                 f"PP plan's {pp.bubble_rate:.1%}")
    return "\n".join(lines)


def table_c() -> str:
    spec = model_preset("gpt3-13b")
    hw = hardware_preset("a100-80gb")
    result = search(spec, hw, SearchConfig(gpus=8, global_batch=32, budget_bytes=24 * GIB,
                                           top_k=3))
    lines = [f"(c) {spec.name} on 8 x {hw.name}, global batch 32, budget 24 GiB", "",
             render_table(result.candidates), "", result.shortfall() or "(fits)"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("a", "b", "c"), default=None)
    parser.add_argument("--no-png", action="store_true")
    args = parser.parse_args()
    if args.only in (None, "a"):
        print(table_a(png=not args.no_png), end="\n\n")
    if args.only in (None, "b"):
        for global_batch in (256, 512):
            print(table_b(global_batch), end="\n\n")
    if args.only in (None, "c"):
        print(table_c())


if __name__ == "__main__":
    main()
