"""Our per-class offload plan against Megatron-Core's fine-grained activation offloading, both
in the simulator, on a grid of schedules, pipeline sizes, copy ratios and model shapes.

For each row: the plain schedule's makespan and peak; Megatron's best knob setting (the lowest
peak among the settings searched whose makespan is within 2% of the plain schedule's; its
policy as offload/megatron.py models it); ours (offload/class_plan.py, the lowest peak within
the same 2%). Peaks are the largest over ranks, in M_a units (one microbatch through a rank's
layers). k is the copy time of one chunk's whole activation over its forward time... here as
the papers' ratio: one-way copy time over F + I + W, k = 2 x ratio (k = 1 at ratio 0.5).

    python benchmarks/offload_vs_megatron.py            # p = 4, 8 (64 rows)
    python benchmarks/offload_vs_megatron.py --full     # p = 4, 8, 16, 32
    python benchmarks/offload_vs_megatron.py --quick    # p = 4, k = 0.5 and 2 (tests)
    python benchmarks/offload_vs_megatron.py --pp 16 32 --k 2 --one-shape
    python benchmarks/offload_vs_megatron.py --pp 16 --long-shape   # seq 32k, hidden 16k
    python benchmarks/offload_vs_megatron.py --schedules zbv --fetch-on-use   # ours by FETCH
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time

from pipeoffload import build_schedule
from pipeoffload.offload.class_plan import ClassSearch, plan_classes
from pipeoffload.offload.megatron import OFFLOAD_MODULES, MegatronPolicy, megatron_plan
from pipeoffload.offload.plan import OffloadPolicy
from pipeoffload.planner.tensor_classes import layer_classes
from pipeoffload.planner.transformer import TransformerSpec, layer_activation_bytes
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.simulator import simulate

SLACK = 0.02
LAYERS_PER_STAGE = 4
SCHEDULES = (("1f1b", {}), ("interleaved-1f1b", {"chunks": 2}), ("zbv", {}),
             ("grouped-interleaved", {"chunks": 2}))
SHAPES = ((4096, 4096), (32768, 16384))  # (seq, hidden)


def module_sets() -> list[tuple[str, ...]]:
    """Every non-empty set of offload modules Megatron accepts (attn_proj needs core_attn)."""
    names = list(OFFLOAD_MODULES)
    sets = []
    for mask in range(1, 1 << len(names)):
        chosen = tuple(n for i, n in enumerate(names) if mask >> i & 1)
        if "attn_proj" in chosen and "core_attn" not in chosen:
            continue
        sets.append(chosen)
    return sets


def megatron_best(schedule, costs, classes, chunk_bytes, limit):  # noqa: ANN001, ANN201
    """Megatron's lowest peak within ``limit`` over its knobs: every module set at four
    fractions, then the per-rank delta, the in-flight cap and recompute modules around the
    three best; each with its own copies back and with ours (``planned_reloads``)."""
    tried = []

    def run(policy: MegatronPolicy) -> None:
        for planned in (False, True):
            _, result = megatron_plan(schedule, costs, classes, policy, LAYERS_PER_STAGE,
                                      chunk_bytes, planned_reloads=planned)
            tried.append((result.makespan <= limit * (1 + 1e-9), max(result.peak_activation),
                          result.makespan, policy, planned))

    for modules, fraction in itertools.product(module_sets(), (1.0, 0.75, 0.5, 0.25)):
        run(MegatronPolicy(modules, fraction=fraction))
    ok = sorted((t for t in tried if t[0]), key=lambda t: t[1])[:3]
    for _, _, _, policy, _ in ok:
        for delta, inflight, recompute in itertools.product(
                (0.0, 0.5 * chunk_bytes, chunk_bytes), (None, 1),
                ((), ("layernorm",), ("mlp",), ("layernorm", "mlp"))):
            run(MegatronPolicy(policy.modules, policy.fraction, delta, 0.0, inflight,
                               True, recompute))
    fits = [t for t in tried if t[0]]
    return min(fits, key=lambda t: (t[1], t[2])) if fits else None


def row(name, options, pp, k, seq, hidden, fetch=False):  # noqa: ANN001, ANN201
    spec = TransformerSpec(num_layers=LAYERS_PER_STAGE, hidden=hidden, heads=hidden // 128,
                           kv_heads=hidden // 128, ffn_hidden=4 * hidden, vocab=32000,
                           seq_len=seq)
    classes = layer_classes(spec)
    chunk_bytes = LAYERS_PER_STAGE * layer_activation_bytes(spec, 1, "none")
    schedule = build_schedule(name, pp=pp, microbatches=4 * pp, **options)
    costs = CostModel(offload_ratio=k / 2)
    plain = simulate(schedule, costs)
    limit = plain.makespan * (1 + SLACK)
    mega = megatron_best(schedule, costs, classes, chunk_bytes, limit)
    ours = plan_classes(schedule, costs, classes, ClassSearch(slack=SLACK),
                        OffloadPolicy(fetch_on_use=fetch))
    return plain, mega, ours


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--pp", type=int, nargs="+", help="pipeline sizes instead")
    parser.add_argument("--k", type=float, nargs="+", help="copy ratios k instead")
    parser.add_argument("--one-shape", action="store_true", help="seq 4k, hidden 4k only")
    parser.add_argument("--long-shape", action="store_true", help="seq 32k, hidden 16k only")
    parser.add_argument("--schedules", nargs="+", help="these schedules of the grid only")
    parser.add_argument("--fetch-on-use", action="store_true",
                        help="ours brings activations back by FETCH where the reads hide")
    args = parser.parse_args(argv)
    pps = (4, 8, 16, 32) if args.full else (4,) if args.quick else (4, 8)
    ks = (0.5, 2.0) if args.quick else (0.5, 1.0, 2.0, 3.0)
    pps, ks = tuple(args.pp or pps), tuple(args.k or ks)
    shapes = (SHAPES[:1] if args.quick or args.one_shape else SHAPES[1:] if args.long_shape
              else SHAPES)
    print("| schedule | p | k | seq | hidden | plain peak | Megatron best | its peak | its "
          "makespan | ours | our peak | our makespan | cut vs Megatron |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    cuts, above, started = [], 0, time.process_time()
    schedules = [s for s in SCHEDULES if not args.schedules or s[0] in args.schedules]
    for (name, options), pp, k, (seq, hidden) in itertools.product(schedules, pps, ks, shapes):
        plain, mega, ours = row(name, options, pp, k, seq, hidden, args.fetch_on_use)
        base, grow = max(plain.peak_activation), 1 / plain.makespan
        our_peak = ours.peak
        if mega is None:
            mega_text, mega_peak, mega_span = "none fits", base, plain.makespan
        else:
            policy = mega[3]
            mega_text = (f"{'+'.join(policy.modules)} f={policy.fraction:g}"
                         f"{' (our reloads)' if mega[4] else ''}"
                         f"{' delta' if policy.delta_bytes else ''}"
                         f"{' inflight=1' if policy.max_inflight is not None else ''}"
                         f"{' rc=' + '+'.join(policy.recompute) if policy.recompute else ''}")
            mega_peak, mega_span = min(mega[1], base), mega[2]
        cut = 1 - our_peak / mega_peak if mega_peak > 0 else 0.0
        above += our_peak > mega_peak + 1e-9
        if k > 1:
            cuts.append(cut)
        off, rec = ours.choice.names
        print(f"| {name} | {pp} | {k:g} | {seq} | {hidden} | {base:.3g} | {mega_text} | "
              f"{mega_peak:.3g} | {mega_span * grow - 1:+.2%} | {'+'.join(off) or '-'}"
              f"{' rc=' + '+'.join(rec) if rec else ''} | {our_peak:.3g} | "
              f"{ours.result.makespan * grow - 1:+.2%} | {cut:+.1%} |")
        sys.stdout.flush()
    print(f"\nrows where ours is above Megatron's best: {above}")
    if cuts:
        print(f"median cut over Megatron's best at k > 1: {statistics.median(cuts):.1%} "
              f"({len(cuts)} rows)")
    print(f"CPU time: {time.process_time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
