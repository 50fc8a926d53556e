"""The schedule zoo side by side: bubble, peak activation and offload, from the simulator.

Run: python benchmarks/zoo_table.py [--pp 8] [--microbatches 32] [--offload-ratio 0.5]
Unit costs (T_F = T_I = T_W = 1, free P2P); po-h / po-f copy each chunk's activation in
offload-ratio x (F+I+W). Prints a markdown table (README and docs/schedules.md use it).
"""

from __future__ import annotations

import argparse

from pipeoffload.api import plan_schedule, schedule_names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=32)
    parser.add_argument("--offload-ratio", type=float, default=0.5)
    args = parser.parse_args()
    pp, m = args.pp, args.microbatches
    print(f"pp={pp}, microbatches={m}, T_F=T_I=T_W=1, offload ratio {args.offload_ratio} "
          "for po-h / po-f\n")
    print("| schedule | chunks | bubble | rank-0 peak (M_a) | max peak (M_a) | offloaded "
          "| makespan |")
    print("|---|---|---|---|---|---|---|")
    for name, _ in schedule_names():
        options = {"chunks": 2} if name in ("interleaved-1f1b", "grouped-interleaved") else {}
        plan = plan_schedule(name, pp, m, offload_ratio=args.offload_ratio, **options)
        result, report = plan.result, plan.report
        print(f"| {name} | {plan.schedule.chunks} | {result.bubble_rate:.3f} | "
              f"{result.peak_activation[0]:.3g} | {max(result.peak_activation):.3g} | "
              f"{report.offloaded_fraction:.0%} | {result.makespan:g} |")


if __name__ == "__main__":
    main()
