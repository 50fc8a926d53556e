"""Print the tables of docs/planner.md and draw docs/activation_vs_pp.png.

(a) per-device activation memory vs pipeline size (po-f falls, 1F1B and interleaved stay flat);
(b) the paper's case: PP with offload against interleaved 1F1B + TP8 + SP on 32 A100s;
(c) an impossible budget and the nearest plan;
(d) MT-NLG 530B against Megatron's measured MFU (Korthikanti et al. 2022), with its published
    interleaved schedule (benchmarks/planner_published.py has every published run);
(e) the default GEMM curve: linear-layer efficiency by model, TP degree and GPU (roofline and
    tile / wave quantization).

    python benchmarks/planner_tables.py            # all four (a few minutes on 2 cores)
    python benchmarks/planner_tables.py --only a   # one of them
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

from pipeoffload.planner.costing import GIB, MemoryConfig
from pipeoffload.planner.evaluate import Candidate, Evaluator
from pipeoffload.planner.gemm import layer_gemms
from pipeoffload.planner.hardware import Hardware, hardware_preset
from pipeoffload.planner.presets import model_preset
from pipeoffload.planner.published import KORTHIKANTI_2022, predict
from pipeoffload.planner.ratio import RunConfig, layer_cost, offload_ratio
from pipeoffload.planner.report import render_table
from pipeoffload.planner.search import SearchConfig, SearchSpace, search
from pipeoffload.planner.transformer import TransformerSpec

DOCS = Path(__file__).resolve().parent.parent / "docs"
PPS = (4, 8, 16, 32)
MICROBATCHES = 64


#: Table (a)'s sequence: at 32768 a layer's k is 0.71, low enough for two A100s on one PCIe
#: switch to hide full offload; at 16384 (k 0.86) they no longer can and po-f stops falling.
ACTIVATION_SEQ = 32768


def _activation_rows() -> tuple[list[str], dict[str, list[float]]]:
    spec = model_preset("pipeoffload-42.9b", seq_len=ACTIVATION_SEQ, num_layers=64)
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
    header = [f"(a) {spec.name} with 64 layers, seq {spec.seq_len}, b=1, m={MICROBATCHES}, "
              f"tp=1, dp=1, "
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
        ax.set_title(f"GPT 64 layers, h=8192, seq {ACTIVATION_SEQ // 1024}k, A100: "
                     "activation vs pipeline size")
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
    lines = [f"(b) {spec.name}, seq 16384, 32 x {hw.name}, global batch {global_batch}: "
             f"best interleaved 1F1B + TP8 + SP, then the best TP=1 plan with offload within "
             f"its memory ({tp8.memory_gib:.1f} GiB)", "", render_table([tp8, pp]), ""]
    if pp.feasible:
        lines.append(f"MFU {pp.mfu:.1%} vs {tp8.mfu:.1%}: {pp.mfu / tp8.mfu - 1:+.1%} for PP + "
                     f"offload, at {pp.memory_gib:.1f} vs {tp8.memory_gib:.1f} GiB per device")
    else:
        lines.append("no TP=1 plan with offload fits in the TP8 plan's memory")
    lines += [tp_breakdown(spec, hw, 8), "", sensitivity(spec, hw, tp8.candidate, pp.candidate)]
    lines.append(f"bubble: TP8 plan {tp8.bubble_rate:.1%}, PP plan {pp.bubble_rate:.1%}")
    return "\n".join(lines)


def tp_breakdown(spec: TransformerSpec, hw: Hardware, tp: int) -> str:
    """What TP costs one layer (F + I + W, b = 1): its linear matmuls' shape losses against the
    same matmuls unsharded, and the collectives it leaves exposed against the layer without
    them (layer_time.py)."""
    run = RunConfig(tp=tp)
    gemms, whole = layer_gemms(spec, 1, tp).all(), layer_gemms(spec, 1, 1).all()
    sharded = sum(hw.gemm_s(g) for g in gemms) * tp
    unsharded = sum(hw.gemm_s(g) for g in whole)
    cost = layer_cost(spec, hw, run)
    quiet = layer_cost(spec, dataclasses.replace(hw, intra_node_bytes_per_s=1e18), run)
    return (f"TP{tp} per layer: linear matmuls {sharded / unsharded - 1:+.1%} against TP1 "
            f"(GEMM shapes, tile and wave quantization), exposed collectives "
            f"{cost.chunk_s / quiet.chunk_s - 1:+.1%} of the layer (F "
            f"{cost.f_s - quiet.f_s:.2e} s, I {cost.i_s - quiet.i_s:.2e} s, W "
            f"{cost.w_s - quiet.w_s:.2e} s)")


def sensitivity(spec: TransformerSpec, hw: Hardware, tp8: Candidate, pp: Candidate) -> str:
    """The two plans re-priced with TP made dearer: what the paper's 12-19% would need."""
    evaluator = lambda h: Evaluator(spec, h, MemoryConfig(), math.inf)  # noqa: E731
    rows = ["| NVLink busbw | GEMM curve | TP8 MFU | PP + offload MFU | PP + offload lead |",
            "|---|---|---|---|---|"]
    for fraction in (hw.intra_node_busbw_fraction, 0.5, 0.3):
        for ridge, curve in ((hw.gemm_ridge_flops_per_byte, "roofline"),
                             (4 * hw.gemm_ridge_flops_per_byte, "ridge x4")):
            h = dataclasses.replace(hw, intra_node_busbw_fraction=fraction,
                                    gemm_ridge_flops_per_byte=ridge)
            a, b = evaluator(h).evaluate(tp8).mfu, evaluator(h).evaluate(pp).mfu
            rows.append(f"| {fraction * hw.intra_node_bytes_per_s / 1e9:.0f} GB/s | {curve} | "
                        f"{a:.1%} | {b:.1%} | {b / a - 1:+.1%} |")
    return "\n".join(rows)


def table_d() -> str:
    """Korthikanti et al. 2022 trained MT-NLG 530B on 2240 A100s, TP8 x PP35 x DP8, interleaved
    with three stages per rank, global batch 2240, microbatch 1, and measured 54.2% MFU
    (selective recompute) / 42.1% (full); on 280 GPUs 56.0% / 43.2%."""
    runs = [run for run in KORTHIKANTI_2022 if run.row.startswith("530B")]
    lines = ["(d) MT-NLG 530B (Korthikanti et al. 2022), TP8 x PP35, interleaved v = 3", "",
             "| GPUs | recompute | predicted MFU | Megatron measured | step s | DP s | bubble |",
             "|---|---|---|---|---|---|---|"]
    for run in runs:
        plan = predict(run)
        lines.append(f"| {run.gpus} | {run.recompute.value} | {plan.mfu:.1%} | "
                     f"{run.measured_mfu:.1%} | {plan.step_time:.2f} | {plan.dp_time:.2f} | "
                     f"{plan.bubble_rate:.1%} |")
    lines += ["", tp_breakdown(runs[0].spec, hardware_preset("a100-80gb"), 8)]
    return "\n".join(lines)


def table_c() -> str:
    spec = model_preset("gpt3-13b")
    hw = hardware_preset("a100-80gb")
    result = search(spec, hw, SearchConfig(gpus=8, global_batch=32, budget_bytes=24 * GIB,
                                           top_k=3))
    lines = [f"(c) {spec.name} on 8 x {hw.name}, global batch 32, budget 24 GiB", "",
             render_table(result.candidates), "", result.shortfall() or "(fits)"]
    return "\n".join(lines)


def table_e() -> str:
    """Time-weighted efficiency of a layer's four linear matmuls (b = 1) under each preset's
    default curve: what the GEMM shape model charges TP shards."""
    models = [(model_preset("pipeoffload-5.8b", seq_len=16384), "s 16384"),
              (model_preset("pipeoffload-42.9b", seq_len=16384), "s 16384"),
              (model_preset("pipeoffload-42.9b", seq_len=4096), "s 4096"),
              (model_preset("llama3-70b"), "s 8192"),
              (KORTHIKANTI_2022[4].spec, "s 2048")]
    tps = (1, 2, 4, 8)
    lines = ["(e) linear-layer GEMM efficiency (fraction of the large-GEMM rate), b = 1", "",
             "| model | hardware | " + " | ".join(f"tp {t}" for t in tps) + " |",
             "|---|---|" + "---|" * len(tps)]
    for spec, note in models:
        for name in ("a100-80gb", "h100-80gb"):
            hw = hardware_preset(name)
            cells = []
            for tp in tps:
                gemms = layer_gemms(spec, 1, tp).all()
                shaped = sum(hw.gemm_s(g) for g in gemms)
                cells.append(f"{sum(g.flops for g in gemms) / hw.bf16_flops_per_s / shaped:.3f}")
            lines.append(f"| {spec.name} ({note}) | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("a", "b", "c", "d", "e"), default=None)
    parser.add_argument("--no-png", action="store_true")
    args = parser.parse_args()
    if args.only in (None, "a"):
        print(table_a(png=not args.no_png), end="\n\n")
    if args.only in (None, "b"):
        for global_batch in (256, 512):
            print(table_b(global_batch), end="\n\n")
    if args.only in (None, "c"):
        print(table_c(), end="\n\n")
    if args.only in (None, "d"):
        print(table_d(), end="\n\n")
    if args.only in (None, "e"):
        print(table_e())


if __name__ == "__main__":
    main()
