"""The offload planner over the authors' group-interleaved offload grid, against a bound.

Run: python benchmarks/offload_grid.py            (a few minutes on one core)
     python benchmarks/offload_grid.py --quick    (a small grid, seconds; tests use it)

Grid (docs/method.md section 6; the authors' planner's dimensions): grouped-interleaved with
p ranks, v chunks per rank, groups of g microbatches, m = 2p microbatches, the K longest-lived
chunks of every rank offloaded (``chunks:K``), one-way copy time = ratio x (F+I+W), unit
costs (F = I = W = 1) or I = 2F (F = 1, I = 2, W = 1), P2P latency 0 or 0.1 F. Peaks are the
largest over ranks, in chunk units (v x M_a).

The bound ("reference"): what a plain schedule-aware reload placement reaches at equal
makespan, written here independently of the planner under test (``reference_plan``). Each
chosen activation is copied out right after its forward and copied back just in time on a
serial host-to-device queue; the plan is simulated, and what would stall (grow the makespan)
is dropped and the rest simulated again. The bound is that simulated peak, at the same
makespan as no offload. "ours <= bound" on a row means the planner is at least as good as
that placement; the table of worst rows shows where it is not.

Planning time is the planner's CPU time (time.process_time: on a shared machine wall-clock
time measures the neighbours); nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from pipeoffload.core import registry
from pipeoffload.core.actions import OFFLOAD_KINDS, Action, Kind
from pipeoffload.core.schedule import Schedule
from pipeoffload.offload.plan import add_offload
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.simulator import SimResult, simulate

COSTS = {"unit": (1.0, 1.0, 1.0), "I=2F": (1.0, 2.0, 1.0)}
P2P = (0.0, 0.1)
RATIOS = (0.25, 0.5, 0.75)
TOLERANCE = 1e-9


@dataclass(frozen=True)
class Config:
    pp: int
    chunks: int
    group: int
    microbatches: int
    k: int
    ratio: float
    costs: str
    p2p: float

    def label(self) -> str:
        return (f"p={self.pp} v={self.chunks} g={self.group} m={self.microbatches} "
                f"K={self.k} ratio={self.ratio:g} {self.costs} p2p={self.p2p:g}")

    def cost_model(self) -> CostModel:
        f, i, w = COSTS[self.costs]
        return CostModel(f_time=f, i_time=i, w_time=w, p2p_time=self.p2p,
                         offload_ratio=self.ratio)


@dataclass(frozen=True)
class Row:
    config: Config
    before: float  # chunk units, largest over ranks, no offload
    ours: float
    bound: float
    growth: float  # ours' makespan / no offload's - 1
    bound_growth: float
    plan_s: float


def grid(quick: bool) -> Iterator[Config]:
    """The configurations, small first."""
    pps = (4, 8) if quick else (4, 8, 16, 32)
    for pp in pps:
        groups = sorted({math.ceil(pp / 2), pp})
        for v in ((2, 3) if quick else (2, 3, 4)):
            for g in groups:
                for k in range(1, v + 1):
                    for ratio in ((0.25, 0.75) if quick else RATIOS):
                        for costs in COSTS:
                            for p2p in P2P:
                                yield Config(pp, v, g, 2 * pp, k, ratio, costs, p2p)


def chosen_items(base: SimResult, k: int) -> list[tuple[int, int]]:
    """The K chunks of every rank with the longest total lifespan (F start to last backward
    end), all their microbatches: what ``chunks:K`` asks for."""
    schedule = base.schedule
    start = {t.action: t.start for rank in base.timeline for t in rank}
    end = {t.action: t.end for rank in base.timeline for t in rank}
    items = []
    for rank in range(schedule.num_ranks):
        total: dict[int, float] = {}
        for a in schedule.ranks[rank]:
            if a.kind is Kind.F:
                last = end.get(Action(a.stage, Kind.W, a.microbatch),
                               end.get(Action(a.stage, Kind.B, a.microbatch)))
                total[a.stage] = total.get(a.stage, 0.0) + last - start[a]
        keep = sorted(total, key=lambda s: (-total[s], s))[:k]
        items += [(a.stage, a.microbatch) for a in schedule.ranks[rank]
                  if a.kind is Kind.F and a.stage in keep]
    return items


def reference_plan(schedule: Schedule, costs: CostModel, k: int) -> SimResult:
    """The bound's plan (see the module docstring), simulated."""
    bare = schedule.without(*OFFLOAD_KINDS)
    base = simulate(bare, costs)
    items = set(chosen_items(base, k))
    dropped: set[tuple[int, int]] = set()
    result = base
    for _ in range(len(items) + 1):
        planned = _place(bare, base, costs, items - dropped)
        result = simulate(planned, costs)
        if result.makespan <= base.makespan + TOLERANCE and result.total_stall_time <= TOLERANCE:
            return result
        stalled = {(t.action.stage, t.action.microbatch) for rank in result.timeline
                   for t in rank if t.stall > TOLERANCE} & items
        if not stalled:
            break
        dropped |= stalled
    return base  # nothing hides at equal makespan


def _place(bare: Schedule, base: SimResult, costs: CostModel,
           items: set[tuple[int, int]]) -> Schedule:
    """OFFLOAD after each item's F; RELOAD at the last program point from which a copy back,
    queued behind the later ones (latest deadline first), ends by its backward's start in
    ``base``. Items whose copy back would start before the copy out ends are left alone."""
    timing = {t.action: t for rank in base.timeline for t in rank}
    ranks = []
    for actions in bare.ranks:
        compute = [a for a in actions if a.kind.is_compute]
        first_backward = {(a.stage, a.microbatch): i for i, a in enumerate(compute)
                          if a.kind in (Kind.I, Kind.B)}
        forward_at = {(a.stage, a.microbatch): i for i, a in enumerate(compute)
                      if a.kind is Kind.F}
        mine = [it for it in items if it in forward_at]
        out_end = _copies_out(mine, compute, timing, costs)
        reload_before: dict[int, list[Action]] = {}
        offloaded = set()
        queue_free = math.inf
        for item in sorted(mine, key=lambda it: -first_backward[it]):
            b = first_backward[item]
            deadline = min(timing[compute[b]].start, queue_free)
            latest = deadline - costs.transfer_time(item[0], Kind.RELOAD)
            j = b
            while j > forward_at[item] + 1 and timing[compute[j - 1]].end > latest + TOLERANCE:
                j -= 1
            issue = timing[compute[j - 1]].end
            if j <= forward_at[item] + 1 or issue <= out_end[item] + TOLERANCE:
                continue
            offloaded.add(item)
            reload_before.setdefault(j, []).append(Action(item[0], Kind.RELOAD, item[1]))
            queue_free = issue
        out: list[Action] = []
        position = 0
        for a in actions:
            if a.kind.is_compute:
                out.extend(reversed(reload_before.get(position, ())))
                position += 1
            out.append(a)
            if a.kind is Kind.F and (a.stage, a.microbatch) in offloaded:
                out.append(Action(a.stage, Kind.OFFLOAD, a.microbatch))
        ranks.append(out)
    return bare.with_ranks(ranks)


def _copies_out(items: list[tuple[int, int]], compute: list[Action], timing: dict,
                costs: CostModel) -> dict[tuple[int, int], float]:
    """When each item's copy out ends: FIFO on the rank's device-to-host queue, streaming from
    the forward's start, never before the forward's end."""
    free, ends, chosen = 0.0, {}, set(items)
    for action in compute:
        item = (action.stage, action.microbatch)
        if action.kind is Kind.F and item in chosen:
            f = timing[action]
            start = max(f.start, free)
            free = ends[item] = max(start + costs.transfer_time(action.stage, Kind.OFFLOAD),
                                    f.end)
    return ends


def run_row(config: Config) -> Row:
    schedule = registry.build_schedule("grouped-interleaved", config.pp, config.microbatches,
                                       chunks=config.chunks, group_size=config.group)
    costs = config.cost_model()
    started = time.process_time()
    plan = add_offload(schedule, costs, f"chunks:{config.k}")
    took = time.process_time() - started
    reference = reference_plan(schedule, costs, config.k)
    v = config.chunks
    r = plan.report
    return Row(config, v * max(r.peak_before), v * max(r.peak_after),
               v * max(reference.peak_activation), r.makespan_after / r.makespan_before - 1,
               reference.makespan / r.makespan_before - 1, took)


def distribution(values: list[float]) -> str:
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return (f"min {ordered[0]:.4g}, median {statistics.median(ordered):.4g}, p90 {at(0.9):.4g}, "
            f"p99 {at(0.99):.4g}, max {ordered[-1]:.4g}")


def report(rows: list[Row], worst: int) -> None:
    above = [r for r in rows if r.ours > r.bound + TOLERANCE]
    below = [r for r in rows if r.ours < r.bound - TOLERANCE]
    print(f"rows: {len(rows)}")
    print(f"peak above the bound: {len(above)} rows; equal: {len(rows) - len(above) - len(below)}"
          f"; below: {len(below)}")
    print(f"bound's makespan growth: max {max(r.bound_growth for r in rows):+.4%} "
          "(0 by construction)")
    print("makespan growth (ours): " + distribution([r.growth for r in rows]))
    print(f"rows with growth > 1%: {sum(r.growth > 0.01 for r in rows)}")
    print("planning time s: " + distribution([r.plan_s for r in rows]))
    print("peak (chunk units) ours - bound: " + distribution([r.ours - r.bound for r in rows]))
    print("peak cut by ours (1 - ours / no offload): "
          + distribution([1 - r.ours / r.before for r in rows]))
    header = ("| configuration | no offload | ours | bound | ours - bound | makespan growth "
              "| plan s |\n|---|---|---|---|---|---|---|")
    for title, key in (("highest peak over the bound", lambda r: r.ours - r.bound),
                       ("largest makespan growth", lambda r: r.growth),
                       ("slowest plans", lambda r: r.plan_s)):
        print(f"\nworst rows, {title}:\n\n{header}")
        for r in sorted(rows, key=key, reverse=True)[:worst]:
            print(f"| {r.config.label()} | {r.before:.4g} | {r.ours:.4g} | {r.bound:.4g} | "
                  f"{r.ours - r.bound:+.3g} | {r.growth:+.2%} | {r.plan_s:.2f} |")


def timing_table(quick: bool) -> list[dict]:
    """Planning time of the largest plans: p = 32, m = 256 (full offload, ratio 0.5)."""
    pp, m = (8, 32) if quick else (32, 256)
    print("\n| p | m | v | target | ratio | plan s | peak chunk units before -> after |")
    print("|---|---|---|---|---|---|---|")
    out = []
    for v in (2, 4):
        for target in ("chunks:1", "all"):
            schedule = registry.build_schedule("grouped-interleaved", pp, m, chunks=v,
                                               group_size=pp // 2)
            started = time.process_time()
            plan = add_offload(schedule, CostModel(offload_ratio=0.5), target)
            took = time.process_time() - started
            r = plan.report
            print(f"| {pp} | {m} | {v} | {target} | 0.5 | {took:.2f} | "
                  f"{v * max(r.peak_before):.4g} -> {v * max(r.peak_after):.4g} |")
            out.append({"pp": pp, "microbatches": m, "chunks": v, "target": target,
                        "plan_s": took})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small grid (seconds)")
    parser.add_argument("--worst", type=int, default=5, help="worst rows per table")
    parser.add_argument("--json", help="also write every row to this file")
    args = parser.parse_args(argv)
    rows = [run_row(c) for c in grid(args.quick)]
    report(rows, args.worst)
    timings = timing_table(args.quick)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": [asdict(r) for r in rows], "timing": timings}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
