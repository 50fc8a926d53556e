"""How far the class search's bounded answer is from an exhaustive search over uniform class
choices (issue 36, item 2: "say whether exact or bounded, and by how much").

For each row (the grid of benchmarks/offload_vs_megatron.py: same model shapes, 4 layers per
stage, m = 4p, copy ratio k): every uniform choice, keep / offload / recompute per class with
one choice for every (stage, microbatch) (2 x 3^7 = 4374 at 8 classes, layer_input not
recomputable), each planned by the chunk planner (`all`) and simulated; the lowest peak within
2% of the plain makespan among them, against the class search's (offload/class_plan.py
ClassSearch(slack=0.02), which may also choose per microbatch). Peaks are the largest over
ranks, in M_a units.

    python benchmarks/class_search_gap.py                   # p = 4, the four schedules, k 1 and 3
    python benchmarks/class_search_gap.py --pp 8 --k 2
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

from offload_vs_megatron import SCHEDULES, SLACK  # the grid's (this folder)

from pipeoffload import build_schedule
from pipeoffload.core.classes import ClassChoice
from pipeoffload.offload.class_plan import ClassSearch, plan_classes, uniform
from pipeoffload.offload.plan import add_offload
from pipeoffload.planner.tensor_classes import layer_classes
from pipeoffload.planner.transformer import TransformerSpec
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.simulator import simulate


def exhaustive(schedule, costs, classes, limit):  # noqa: ANN001, ANN201
    """The lowest peak (then makespan) within ``limit`` over every uniform choice, and how
    many choices were planned."""
    options = [("keep", "offload", "recompute") if c.recompute_time is not None
               else ("keep", "offload") for c in classes]
    best, count = None, 0
    for assignment in itertools.product(*options):
        choice = ClassChoice(tuple(c for c, a in zip(classes, assignment) if a == "offload"),
                             tuple(c for c, a in zip(classes, assignment) if a == "recompute"))
        result = add_offload(schedule.with_classes(uniform(schedule, choice)), costs,
                             "all").result
        count += 1
        if result.makespan <= limit * (1 + 1e-9):
            key = (max(result.peak_activation), result.makespan)
            if best is None or key < best[0]:
                best = (key, choice)
    return best, count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[4])
    parser.add_argument("--k", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096)
    args = parser.parse_args(argv)
    spec = TransformerSpec(num_layers=4, hidden=args.hidden, heads=args.hidden // 128,
                           kv_heads=args.hidden // 128, ffn_hidden=4 * args.hidden,
                           vocab=32000, seq_len=args.seq)
    classes = layer_classes(spec)
    print("| schedule | p | k | exhaustive uniform: peak | its choice | plans | class search: "
          "peak | its choice | plans | search vs exhaustive |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    gaps, started = [], time.process_time()
    for (name, options), pp, k in itertools.product(SCHEDULES, args.pp, args.k):
        schedule = build_schedule(name, pp=pp, microbatches=4 * pp, **options)
        costs = CostModel(offload_ratio=k / 2)
        limit = simulate(schedule, costs).makespan * (1 + SLACK)
        best, count = exhaustive(schedule, costs, classes, limit)
        found = plan_classes(schedule, costs, classes, ClassSearch(slack=SLACK))
        if best is None:
            raise SystemExit(f"{name} p {pp} k {k}: no uniform choice within the slack")
        (peak, _), choice = best
        gap = found.peak / peak - 1
        gaps.append(gap)

        def shown(c: ClassChoice) -> str:
            off, rec = c.names
            return f"{'+'.join(off) or '-'}{' rc=' + '+'.join(rec) if rec else ''}"

        print(f"| {name} | {pp} | {k:g} | {peak:.4g} | {shown(choice)} | {count} | "
              f"{found.peak:.4g} | {shown(found.choice)} | {len(found.tried)} | {gap:+.1%} |")
        sys.stdout.flush()
    print(f"\nworst: class search {max(gaps):+.1%} vs the exhaustive uniform optimum; "
          f"rows above it: {sum(g > 1e-9 for g in gaps)} of {len(gaps)}")
    print(f"CPU time: {time.process_time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
