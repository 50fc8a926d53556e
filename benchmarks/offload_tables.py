"""The offload planner's numbers for docs/offload.md, all from the simulator.

Run: python benchmarks/offload_tables.py            (about a minute on one core)
Unit costs (T_F = T_I = T_W = 1, free P2P); "ratio" is the one-way copy time of one chunk's
activation over its F+I+W time (docs/method.md: ratio 0.5 is k = 1).
"""

from __future__ import annotations

import time

from pipeoffload.api import plan_schedule
from pipeoffload.core.actions import Kind
from pipeoffload.core.schedule import Schedule
from pipeoffload.offload.plan import OffloadPolicy


def full_offload_table() -> None:
    print("### po-f at ratio 0.5 (k = 1), m = 4p\n")
    print("| p | v | rank-0 peak before (M_a) | after | max over ranks after | makespan change "
          "| stall | plan time s |")
    print("|---|---|---|---|---|---|---|---|")
    for pp in (4, 8, 16, 32):
        for v in (2, 3, 4):
            start = time.process_time()
            plan = plan_schedule("po-f", pp, 4 * pp, chunks=v, offload_ratio=0.5)
            took = time.process_time() - start
            r = plan.report
            change = r.makespan_after / r.makespan_before - 1
            print(f"| {pp} | {v} | {r.peak_before[0]:.3g} | {r.peak_after[0]:.3g} | "
                  f"{max(r.peak_after):.3g} | {change:+.2%} | {sum(r.stall_time):g} | "
                  f"{took:.1f} |")


def selective_table() -> None:
    print("\n### Selective offload, p = 8, v = 2, g = 4, m = 32 (rank 0: 12 chunk units "
          "= 6 M_a without offload)\n")
    print("| target | ratio | --fetch-on-use | back by | rank-0 peak (chunk units) | cut "
          "| bytes offloaded | makespan change |")
    print("|---|---|---|---|---|---|---|---|")
    for target in ("chunks:1", "fraction:0.5", "limit:2", "limit:1.5", "all"):
        for ratio in (0.0, 0.25, 0.5):
            for fetch in (False, True):
                plan = plan_schedule("grouped-interleaved", 8, 32, target, chunks=2,
                                     group_size=4, offload_ratio=ratio,
                                     policy=OffloadPolicy(fetch_on_use=fetch))
                r = plan.report
                cut = 1 - r.peak_after[0] / r.peak_before[0]
                change = r.makespan_after / r.makespan_before - 1
                print(f"| {target} | {ratio:g} | {'yes' if fetch else 'no'} | "
                      f"{_back_by(plan.schedule)} | "
                      f"{2 * r.peak_after[0]:.3g} | {cut:.0%} | {r.offloaded_fraction:.0%} | "
                      f"{change:+.2%} |")


def _back_by(schedule: Schedule) -> str:
    """How the plan brings activations back: RELOAD, FETCH or both (FETCH only where it hides)."""
    kinds = [k.value for k in (Kind.RELOAD, Kind.FETCH) if schedule.has_kind(k)]
    return " + ".join(kinds) or "-"


def authors_table() -> None:
    print("\n### Against the authors' planner (docs/method.md section 6), m = 4p\n")
    print("| p | v | g | ratio | offload | authors (chunk units) | ours, RELOAD | ours, "
          "--fetch-on-use |")
    print("|---|---|---|---|---|---|---|---|")
    cases = [(8, 2, 4, 0.25, "chunks:1", "7"), (8, 2, 4, 0.5, "chunks:1", "8"),
             (8, 2, 4, 0.25, "all", "4"), (8, 2, 4, 0.5, "all", "unable to schedule"),
             (8, 2, 8, 0.25, "all", "never schedulable"),
             (16, 3, 8, 0.25, "chunks:1", "19"), (16, 3, 8, 0.25, "chunks:2", "11"),
             (16, 3, 8, 0.25, "all", "3")]
    for pp, v, g, ratio, target, theirs in cases:
        ours = []
        for fetch in (False, True):
            plan = plan_schedule("grouped-interleaved", pp, 4 * pp, target, chunks=v,
                                 group_size=g, offload_ratio=ratio,
                                 policy=OffloadPolicy(fetch_on_use=fetch))
            ours.append(f"{v * plan.report.peak_after[0]:.3g} "
                        f"(from {v * plan.report.peak_before[0]:.3g})")
        print(f"| {pp} | {v} | {g} | {ratio:g} | {target} | {theirs} | {ours[0]} | {ours[1]} |")


def scaling_table() -> None:
    print("\n### Per-device activation as stages are added (m = 4p, ratio 0.5), in units of "
          "one microbatch through the whole model\n")
    print("| p | 1f1b | interleaved-1f1b v=2 | grouped-interleaved v=2 | po-h | po-f |")
    print("|---|---|---|---|---|---|")
    for pp in (4, 8, 16, 32):
        cells = []
        for name, options in (("1f1b", {}), ("interleaved-1f1b", {"chunks": 2}),
                              ("grouped-interleaved", {"chunks": 2}), ("po-h", {}),
                              ("po-f", {})):
            plan = plan_schedule(name, pp, 4 * pp, offload_ratio=0.5, **options)
            # A rank holds 1/p of the layers: M_a is 1/p of a whole-model microbatch.
            cells.append(f"{max(plan.result.peak_activation) / pp:.3f}")
        print(f"| {pp} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    full_offload_table()
    selective_table()
    authors_table()
    scaling_table()
