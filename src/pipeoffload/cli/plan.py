"""`pipeoffload plan`: search DP x TP x PP, schedule, offload and recompute for a model on N GPUs
and print the ranked plans and the winner's `pipeoffload train` command."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from pipeoffload.cli.preflight import MAX_RANKS, count, counts, number

NOTHING_FITS = 3  # the search ran and no configuration fits (the output says what came close)


def _names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return names


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the `plan` subcommand (its handler is ``args.handler``)."""
    p = subparsers.add_parser(
        "plan", help="search parallel layout, schedule, offload and recompute for a model",
        description="Find the fastest configuration that fits in memory, simulated.")
    p.add_argument("--model", required=True,
                   help="model preset (e.g. llama3-70b, pipeoffload-42.9b) or a config.json path")
    p.add_argument("--gpus", type=count(1, 1 << 20), required=True,
                   help="number of GPUs (DP x TP x PP)")
    p.add_argument("--hardware", default="a100-80gb",
                   help="hardware preset (a100-80gb, h100-80gb, h200) or a probe JSON file")
    p.add_argument("--seq", type=count(1, 1 << 24), default=None,
                   help="sequence length (default: model's)")
    p.add_argument("--layers", type=count(1, 1 << 16), default=None,
                   help="override the layer count")
    p.add_argument("--hidden", type=count(1, 1 << 20), default=None,
                   help="override the hidden size (keeps head width and ffn/hidden ratio)")
    p.add_argument("--memory", type=number(above=0, maximum=1 << 30), default=None,
                   metavar="GiB",
                   help="memory budget per GPU in GiB (default: the GPU's memory)")
    p.add_argument("--recompute", choices=("none", "lgd", "full"), default=None,
                   help="fix the recompute option (default: search all three)")
    p.add_argument("--global-batch", type=count(1, 1 << 24), default=None, metavar="B",
                   help="sequences per step (default 4 x GPUs)")
    p.add_argument("--top", type=count(1, 1 << 20), default=10, metavar="K",
                   help="plans to show (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--tp", type=counts(1, 1 << 20), default=None, metavar="T[,T]",
                   help="only these TP degrees")
    p.add_argument("--pp", type=counts(1, MAX_RANKS), default=None, metavar="P[,P]",
                   help="only these PP degrees")
    p.add_argument("--schedules", type=_names, default=None, metavar="NAME[,NAME]",
                   help="only these schedules (po-h / po-f mean grouped-interleaved)")
    p.add_argument("--offload", type=_names, default=None, metavar="T[,T]",
                   help="only these offload targets among none, chunks:1, all")
    p.add_argument("--micro-batch-sizes", type=counts(1, 1 << 20), default=None, metavar="B[,B]",
                   help="microbatch sizes to try (default 1,2,4)")
    p.add_argument("--sharded-optimizer", action="store_true",
                   help="ZeRO-1: shard fp32 master weights and Adam moments over DP")
    p.add_argument("--reserve", type=number(minimum=0, maximum=1 << 30), default=None,
                   metavar="GiB",
                   help="fixed per-GPU reserve for context, NCCL, workspaces (default 4)")
    p.add_argument("--no-extrapolate", action="store_true",
                   help="simulate every microbatch instead of extrapolating from fewer")
    p.add_argument("--tolerance", type=number(minimum=0, maximum=1), default=None,
                   metavar="SHARE",
                   help="the plan found may be this share slower than the best (default "
                        "0.005); 0 finds the best, simulating every near tie")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(handler=cmd_plan)


def _spec(args: argparse.Namespace):  # -> TransformerSpec
    from pipeoffload.planner.presets import load_model

    spec = load_model(args.model)
    overrides: dict[str, int] = {}
    if args.seq is not None:
        overrides["seq_len"] = args.seq
    if args.layers is not None:
        overrides["num_layers"] = args.layers
    if args.hidden is not None:
        heads = max(1, args.hidden // spec.head_dim)
        overrides.update(hidden=args.hidden, heads=heads,
                         kv_heads=spec.kv_heads if heads % spec.kv_heads == 0 else heads,
                         ffn_hidden=round(spec.ffn_hidden * args.hidden / spec.hidden))
    return dataclasses.replace(spec, **overrides) if overrides else spec


def _space(args: argparse.Namespace):  # -> SearchSpace
    from pipeoffload.core.registry import canonical_name
    from pipeoffload.planner.search import SearchSpace

    options: dict[str, object] = {}
    if args.schedules:
        names = []
        for name in args.schedules:
            key = name.strip().lower().replace("_", "-")
            names.append("grouped-interleaved" if key in ("po-h", "po-f", "poh", "pof")
                         else canonical_name(name, also=("po-h", "po-f")))
        options["schedules"] = tuple(dict.fromkeys(names))
    if args.recompute:
        options["recompute"] = (args.recompute,)
    for field in ("tp", "pp", "offload"):
        if getattr(args, field):
            options[field] = getattr(args, field)
    if args.micro_batch_sizes:
        options["micro_batch_sizes"] = args.micro_batch_sizes
    return SearchSpace(**options)


def cmd_plan(args: argparse.Namespace) -> int:
    from pipeoffload.planner.costing import GIB, MemoryConfig
    from pipeoffload.planner.evaluate import Extrapolation
    from pipeoffload.planner.hardware import load_hardware
    from pipeoffload.planner.ratio import OptimizerSpec
    from pipeoffload.planner.report import render_result, result_json
    from pipeoffload.planner.search import SearchConfig, search

    spec = _spec(args)
    hw = load_hardware(args.hardware)
    memory = MemoryConfig(optimizer=OptimizerSpec(sharded=args.sharded_optimizer))
    if args.reserve is not None:
        memory = dataclasses.replace(memory, reserve_bytes=args.reserve * GIB)
    config = SearchConfig(
        gpus=args.gpus,
        global_batch=args.global_batch if args.global_batch is not None else 4 * args.gpus,
        budget_bytes=args.memory * GIB if args.memory is not None else None,
        top_k=args.top,
        memory=memory,
        extrapolation=Extrapolation(enabled=not args.no_extrapolate),
    )
    if args.tolerance is not None:
        config = dataclasses.replace(config, tolerance=args.tolerance)

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = search(spec, hw, config, _space(args), None if args.quiet else progress)
    inputs = {"model": spec.name, "layers": spec.num_layers, "hidden": spec.hidden,
              "seq": spec.seq_len, "gpus": config.gpus, "hardware": hw.name,
              "global_batch": config.global_batch, "memory_gib": result.budget_bytes / GIB,
              "sharded_optimizer": args.sharded_optimizer,
              "reserve_gib": memory.reserve_bytes / GIB}
    fits = result.best is not None and result.best.feasible
    if not fits:
        print(f"pipeoffload plan: error: no configuration fits (exit status {NOTHING_FITS}); "
              "the report says what came nearest", file=sys.stderr)
    if args.json:
        print(json.dumps(result_json(result, inputs), sort_keys=True))
        return 0 if fits else NOTHING_FITS
    line = (f"{spec.name}: {spec.num_layers} layers, hidden {spec.hidden}, seq {spec.seq_len}; "
            f"{config.gpus} x {hw.name}, global batch {config.global_batch} sequences, budget "
            f"{result.budget_bytes / GIB:.1f} GiB per GPU (reserve {memory.reserve_bytes / GIB:g})")
    print(render_result(result, line))
    return 0 if fits else NOTHING_FITS
