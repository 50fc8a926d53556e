"""DualPipe and DualPipeV next to 1F1B, ZB1P (zb-h1) and ZB-V, against DeepSeek-V3's Table 2,
torch's DualPipeV order, and with offload planned into them.

Run: python benchmarks/dualpipe_table.py [--pp 4 8 16] [--per-rank 4] [--costs 1,1,1]
Times are in units of one forward of 1/p of the model (a V-placed stage, 1/(2p) of the
model, costs half); ``--costs F,I,W`` gives F, I (input gradient) and W for such a chunk, and
DeepSeek's B is I + W. Activation peaks are in microbatches of activation of 1/p of the model
(Table 2's unit), parameters in copies of 1/p of the model. "bubble" is the largest idle time
of a rank from time 0 to the makespan; Table 2's formula beside it with F&B = F + B (no
overlap gain). The "DeepSeek pair" rows time each overlapped pair as one unit whose outputs
leave at its end (CostModel.overlap_f_b = 0); the other rows as our runtime runs, back to back.
torch's order is dumped with ScheduleDualPipeV._dump_csv (compute only) and read back
through the CSV loader, as `pipeoffload simulate --from-csv` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

from pipeoffload.api import build_schedule
from pipeoffload.core.schedule import Schedule
from pipeoffload.core.text import read_csv
from pipeoffload.offload.plan import add_offload
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.simulator import simulate


def torch_dualpipev_csv(pp: int, microbatches: int, folder: Path) -> Path | None:
    """torch's DualPipeV per-rank compute order as CSV, or None without torch 2.13's class.

    The class needs PipelineStages on a process group only to learn pp and the microbatch
    count; its order is a pure function of those two, so we set them and ask for it (private
    API, checked on torch 2.13)."""
    try:
        from torch.distributed.pipelining.schedules import ScheduleDualPipeV
    except ImportError:
        return None
    schedule = ScheduleDualPipeV.__new__(ScheduleDualPipeV)
    schedule.pp_group_size, schedule._n_microbatches = pp, microbatches
    schedule.pipeline_order = {r: schedule._calculate_single_rank_operations(r)
                               for r in range(pp)}
    path = folder / f"torch_dualpipev_p{pp}_m{microbatches}.csv"
    schedule._dump_csv(str(path), format="compute_only")
    return path


def model_share(schedule: Schedule) -> float:
    """How many 1/p-of-the-model parts one of this schedule's stages is."""
    return schedule.num_ranks / len(schedule.route_of(0))


def table2(name: str, pp: int, f: float, i: float, w: float) -> tuple[str, str]:
    """DeepSeek-V3 Table 2: (bubble, activation) for 1F1B, ZB1P and DualPipe (B = I + W)."""
    b = i + w
    if name == "1f1b":
        return f"{(pp - 1) * (f + b):g}", f"{pp}"
    if name == "zb-h1":
        return f"{(pp - 1) * (f + b - 2 * w):g}", f"{pp}"
    if name == "dualpipe":
        return f"{(pp / 2 - 1) * (f + b + b - 3 * w):g}", f"{pp + 1}"
    return "-", "-"


def row(label: str, schedule: Schedule, f: float, i: float, w: float,
        overlap: float | None = None) -> list[str]:
    share = model_share(schedule)
    costs = CostModel(f_time=f * share, i_time=i * share, w_time=w * share, overlap_f_b=overlap)
    result = simulate(schedule, costs)
    idle = max(result.makespan - busy for busy in result.compute_time)
    peak = max(result.peak_activation) * schedule.chunks * share
    paper_bubble, paper_peak = table2(label, schedule.num_ranks, f, i, w)
    return [label, f"{schedule.chunks * share:g}x", f"{idle:g}", paper_bubble, f"{peak:g}",
            paper_peak, f"{result.bubble_rate:.3f}"]


def offload_rows(pp: int, microbatches: int, ratios: list[float]) -> list[list[str]]:
    rows = []
    for name in ("dualpipe", "dualpipev"):
        bare = build_schedule(name, pp=pp, microbatches=microbatches)
        for ratio in ratios:
            for target in ("chunks:1", "all"):
                costs = CostModel(offload_ratio=ratio)
                plan = add_offload(bare, costs, target)
                report = plan.report
                share = bare.chunks * model_share(bare)
                growth = report.makespan_after / report.makespan_before - 1
                rows.append([name, f"{ratio:g}", target, f"{max(report.peak_before) * share:g}",
                             f"{max(report.peak_after) * share:.3g}",
                             f"{report.offloaded_fraction:.0%}", f"{growth:+.1%}",
                             f"{sum(report.stall_time):g}"])
    return rows


def markdown(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--per-rank", type=int, default=4, help="microbatches = per-rank * pp")
    parser.add_argument("--costs", default="1,1,1", help="F,I,W of a 1/p-of-the-model chunk")
    parser.add_argument("--offload-ratio", type=float, nargs="+", default=[0.25, 0.5])
    args = parser.parse_args()
    f, i, w = (float(x) for x in args.costs.split(","))
    headers = ["schedule", "params", "bubble", "Table 2 bubble", "peak act.",
               "Table 2 act.", "bubble rate"]
    with tempfile.TemporaryDirectory() as folder:
        for pp in args.pp:
            m = args.per_rank * pp
            print(f"\npp={pp}, microbatches={m}, F,I,W = {f:g},{i:g},{w:g}\n")
            rows = [row(name, build_schedule(name, pp=pp, microbatches=m), f, i, w)
                    for name in ("1f1b", "zb-h1", "dualpipe")]
            pair = row("dualpipe", build_schedule("dualpipe", pp=pp, microbatches=m), f, i, w, 0.0)
            rows.append(["dualpipe (DeepSeek pair)", *pair[1:]])
            for name in ("zbv", "dualpipev"):
                rows.append(row(name, build_schedule(name, pp=pp, microbatches=m), f, i, w))
            ours = build_schedule("dualpipev", pp=pp, microbatches=m)
            csv = torch_dualpipev_csv(pp, m, Path(folder))
            if csv is not None:
                theirs = read_csv(csv)
                same = theirs.ranks == ours.ranks
                theirs = dataclasses.replace(theirs, name="dualpipev")
                rows.append(["torch DualPipeV (--from-csv)", *row("", theirs, f, i, w)[1:]])
                print(f"torch's DualPipeV order equals ours on every rank: {same}\n")
            print(markdown(headers, rows))
            print(f"\noffload planned into them (pp={pp}, microbatches={m}, unit costs; ratio = "
                  "one-way copy / (F+I+W); peaks as above)\n")
            print(markdown(["schedule", "ratio", "target", "peak before", "peak after",
                            "offloaded", "makespan", "stall"],
                           offload_rows(pp, m, args.offload_ratio)))


if __name__ == "__main__":
    main()
