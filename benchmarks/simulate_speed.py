"""How long building, validating, simulating and offload planning take at a large size.

Run: python benchmarks/simulate_speed.py [--pp 32] [--chunks 2] [--microbatches 256]
Prints one row per schedule: actions, and seconds for build / validate / simulate (one core,
best of --repeat runs). The target from the schedule-core issue: simulate under 1 s at
pp=32, chunks=2, m=256.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

from pipeoffload import build_schedule, plan_schedule, simulate, validate


def best_of(repeat: int, fn):
    best, value = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - start)
    return best, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--plan", action="store_true", help="also time po-f offload planning")
    args = parser.parse_args()
    pp, v, m = args.pp, args.chunks, args.microbatches
    rows = []
    for name, options in (("interleaved-1f1b", {"chunks": v}), ("grouped-interleaved",
                          {"chunks": v}), ("zbv", {}), ("1f1b", {})):
        t_build, sched = best_of(args.repeat, partial(build_schedule, name, pp, m, **options))
        t_valid, _ = best_of(args.repeat, partial(validate, sched))
        t_sim, res = best_of(args.repeat, partial(simulate, sched))
        actions = sum(len(r) for r in sched.ranks)
        rows.append((name, actions, t_build, t_valid, t_sim, res.bubble_rate))
    if args.plan:
        t_plan, plan = best_of(1, lambda: plan_schedule("po-f", pp, m, chunks=v,
                                                         offload_ratio=0.5))
        actions = sum(len(r) for r in plan.schedule.ranks)
        t_sim, res = best_of(args.repeat, lambda: simulate(plan.schedule, plan.result.costs))
        rows.append(("po-f (planning)", actions, t_plan, float("nan"), t_sim, res.bubble_rate))
    print(f"pp={pp} chunks={v} microbatches={m}")
    print(f"{'schedule':<22}{'actions':>9}{'build s':>10}{'validate s':>12}{'simulate s':>12}"
          f"{'bubble':>9}")
    for name, actions, tb, tv, ts, bubble in rows:
        print(f"{name:<22}{actions:>9}{tb:>10.3f}{tv:>12.3f}{ts:>12.3f}{bubble:>9.3f}")


if __name__ == "__main__":
    main()
