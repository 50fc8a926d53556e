"""`pipeoffload plan`: search DP x TP x PP, schedule, offload and recompute for a model on N GPUs
and print the ranked plans and the winner's `pipeoffload train` command."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import TYPE_CHECKING, Any

from pipeoffload.cli.preflight import MAX_RANKS, count, counts, number
from pipeoffload.core.collector import cyclic_gc_paused

if TYPE_CHECKING:
    from pipeoffload.planner.frameworks import FrameworkPreset
    from pipeoffload.planner.hardware import Hardware
    from pipeoffload.planner.limits import LimitCost
    from pipeoffload.planner.search import SearchConfig, SearchResult, SearchSpace
    from pipeoffload.planner.transformer import TransformerSpec
    from pipeoffload.planner.verdict import Verdict

NOTHING_FITS = 3  # the search ran and no configuration fits (the output says what came close)


def _names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return names


def _group_sizes(text: str) -> tuple[str, ...]:
    sizes = tuple(dict.fromkeys(part.strip().lower() for part in text.split(",")))
    unknown = [size for size in sizes if size not in ("min", "max")]
    if unknown or not sizes:
        raise argparse.ArgumentTypeError(f"{text!r}: give min, max or min,max (group size "
                                         "ceil(pp/2) or pp)")
    return sizes


def add_plan_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    p.add_argument("--recompute", choices=("none", "lgd", "full", "selective"), default=None,
                   help="fix the recompute option (default: search none, lgd and full; "
                        "selective is Megatron's, for frameworks without flash attention)")
    p.add_argument("--global-batch", type=count(1, 1 << 24), default=None, metavar="B",
                   help="sequences per step (default 4 x GPUs)")
    p.add_argument("--top", type=count(1, 1 << 20), default=10, metavar="K",
                   help="plans to show (default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--tp", type=counts(1, 1 << 20), default=None, metavar="T[,T]",
                   help="only these TP degrees")
    p.add_argument("--pp", type=counts(1, MAX_RANKS), default=None, metavar="P[,P]",
                   help="only these PP degrees")
    p.add_argument("--cp", type=counts(1, MAX_RANKS), default=None, metavar="C[,C]",
                   help="only these context-parallel degrees (each GPU holds 1/C of every "
                        "sequence; default: 1 and, from 8192 tokens, the powers of two that "
                        "leave each GPU at least 4096 tokens within a node with its TP group)")
    p.add_argument("--chunks", type=counts(1, 1 << 10), default=None, metavar="V[,V]",
                   help="only these chunks (stages) per rank for interleaved schedules "
                        "(default 2,4; V-shaped schedules always run 2, the others 1)")
    p.add_argument("--group-sizes", type=_group_sizes, default=None, metavar="min|max[,..]",
                   help="grouped-interleaved's group sizes to try: min (ceil(pp/2)), max (pp) "
                        "(default both; po-h / po-f take min)")
    p.add_argument("--schedules", type=_names, default=None, metavar="NAME[,NAME]",
                   help="only these schedules (po-h / po-f mean grouped-interleaved)")
    p.add_argument("--offload", type=_names, default=None, metavar="T[,T]",
                   help="only these offload targets among none, chunks:1, all, "
                        "recompute-chunks:1+all and budget:fit (tensor classes chosen to fit "
                        "each GPU, docs/offload.md)")
    p.add_argument("--micro-batch-sizes", type=counts(1, 1 << 20), default=None, metavar="B[,B]",
                   help="microbatch sizes to try (default 1,2,4)")
    p.add_argument("--framework", default="current", metavar="NAME",
                   help="whose behaviour prices each plan (planner/frameworks.py): current "
                        "(pipeoffload train, the default), megatron-2021, "
                        "megatron-2021-torch-ddp, megatron-2022, megatron-2022-no-sp, "
                        "megatron-core, nemo-2025, llama3-2024 (the published runs' frameworks, "
                        "docs/planner-model.md)")
    p.add_argument("--sharded-optimizer", action="store_true",
                   help="ZeRO-1: shard fp32 master weights and Adam moments over DP (the "
                        "command trains with --zero 1)")
    p.add_argument("--zero", type=int, default=None, choices=(0, 1, 3),
                   help="train's spelling: 1 is --sharded-optimizer, 0 its absence; 3: "
                        "train's FSDP2 stages, priced as --zero 1 (stages whole inside the "
                        "step), searched at tp 1, cp 1 (train's limits) unless --tp / --cp say")
    p.add_argument("--reserve", type=number(minimum=0, maximum=1 << 30), default=None,
                   metavar="GiB",
                   help="fixed per-GPU reserve for context, NCCL, workspaces (default 4)")
    p.add_argument("--host-memory", type=number(minimum=0, maximum=1 << 40), default=None,
                   metavar="GiB",
                   help="pinned host memory per node that offload may use (default: the "
                        "hardware preset's host memory per node; 0: not checked)")
    p.add_argument("--no-verdict", action="store_true",
                   help="skip the verdict on offload (it costs one more, narrower search)")
    p.add_argument("--no-extrapolate", action="store_true",
                   help="simulate every microbatch instead of extrapolating from fewer")
    p.add_argument("--tolerance", type=number(minimum=0, maximum=1), default=None,
                   metavar="SHARE",
                   help="the plan found may be this share slower than the best (default "
                        "0.005); 0 finds the best, simulating every near tie")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(handler=cmd_plan)


def _spec(args: argparse.Namespace, preset: FrameworkPreset) -> TransformerSpec:
    from pipeoffload.planner.presets import load_model

    spec = load_model(args.model)
    overrides: dict[str, Any] = {}  # TransformerSpec fields
    if args.seq is not None:
        overrides["seq_len"] = args.seq
    if args.layers is not None:
        overrides["num_layers"] = args.layers
    if args.hidden is not None:
        heads = max(1, args.hidden // spec.head_dim)
        overrides.update(hidden=args.hidden, heads=heads,
                         kv_heads=spec.kv_heads if heads % spec.kv_heads == 0 else heads,
                         ffn_hidden=round(spec.ffn_hidden * args.hidden / spec.hidden))
    if spec.train_model is not None and ("num_layers" in overrides or "hidden" in overrides):
        # another shape than the file's: train can run it only as the reference model
        overrides["train_model"] = None
    spec = dataclasses.replace(spec, **overrides) if overrides else spec
    return preset.model(spec)


def _space(args: argparse.Namespace) -> SearchSpace:
    """The search space the flags give (before train's limits, planner/limits.py)."""
    from pipeoffload.planner.search import SearchSpace

    options: dict[str, Any] = {}  # SearchSpace fields
    if args.schedules:
        options.update(_schedule_options(args.schedules, args.offload))
    if args.recompute:
        options["recompute"] = (args.recompute,)
    if args.zero == 3:  # train runs --zero 3 at tp 1 and cp 1 (train_command refuses others)
        options.update(tp=(1,), cp=(1,))
    for field in ("tp", "pp", "cp", "offload", "group_sizes", "micro_batch_sizes", "chunks"):
        if getattr(args, field):
            options[field] = getattr(args, field)
    return SearchSpace(**options)


def _schedule_options(schedules: tuple[str, ...], offload: tuple[str, ...] | None
                      ) -> dict[str, Any]:
    """SearchSpace options for ``--schedules``: a preset (po-h / po-f) stands for its family
    and, when only presets are named, for its chunks, group size and offload target too."""
    from pipeoffload.core import registry

    names, presets = [], []
    for name in schedules:
        preset = registry.preset(name)
        if preset is not None:
            presets.append(preset)
            names.append(preset.family)
        else:
            names.append(registry.canonical_name(name, also=tuple(registry.PRESETS)))
    options: dict[str, Any] = {"schedules": tuple(dict.fromkeys(names))}
    if presets and len(names) == len(presets):
        options["group_sizes"] = tuple(dict.fromkeys(p.group_size for p in presets))
        options["chunks"] = tuple(dict.fromkeys(p.chunks for p in presets))
        if not offload:
            options["offload"] = tuple(dict.fromkeys(p.offload for p in presets))
    return options


def _every_dimension_fixed(args: argparse.Namespace, space: SearchSpace, seq_len: int) -> bool:
    """Whether the user gave one value for each of tp, pp, cp (or the sequence is too short for
    the search to try cp > 1), chunks (where the schedule takes them), group size (likewise),
    microbatch size, schedule, recompute and offload: then the report shows that
    configuration whether or not it fits."""
    single = [space.tp, space.pp, args.micro_batch_sizes, space.schedules, space.recompute,
              space.offload if (args.offload or args.schedules) else None]
    if any(value is None or len(value) != 1 for value in single):
        return False
    if (len(space.cp) != 1 if space.cp is not None
            else seq_len >= 2 * space.min_cp_tokens):
        return False
    family = space.registry.family(space.schedules[0])
    if "group_size" in family.options and len(space.group_sizes) != 1:
        return False
    return "chunks" not in family.options or len(space.chunks) == 1


def _zero_level(args: argparse.Namespace) -> bool:
    """Whether the plan's optimizer state is sharded (``--sharded-optimizer`` or ``--zero`` 1
    or 3)."""
    from pipeoffload.errors import ConfigError

    if args.zero == 0 and args.sharded_optimizer:
        raise ConfigError("--zero 0 and --sharded-optimizer disagree; pass one of them")
    return bool(args.sharded_optimizer or args.zero in (1, 3))


def _fsdp(args: argparse.Namespace) -> bool:
    """Whether the plan is priced as train's ``--zero 3`` (planner/optimizer.py Note [zero 3
    terms]); its search keeps to tp 1 and cp 1 unless ``--tp`` / ``--cp`` ask otherwise."""
    from pipeoffload.errors import ConfigError

    if args.zero == 3 and args.framework != "current":
        raise ConfigError(f"--zero 3 is train's FSDP2 stages, priced as pipeoffload train runs "
                          f"them; --framework {args.framework} does not run them (use --zero 1 "
                          f"or --sharded-optimizer)")
    return args.zero == 3


def cmd_plan(args: argparse.Namespace) -> int:
    # The searches keep ~10^6 objects without cycles in their evaluator's caches until _plan
    # returns (core/collector.py). With the collector paused until then it never scans them:
    # re-enabled when each search returned, its next collections walked them all (0.34-0.40 s
    # per command at 1T scale, timed with gc.callbacks).
    with cyclic_gc_paused():
        return _plan(args)


def _config(args: argparse.Namespace, preset: FrameworkPreset) -> SearchConfig:
    from pipeoffload.planner.costing import GIB, MemoryConfig
    from pipeoffload.planner.evaluate import Extrapolation
    from pipeoffload.planner.search import SearchConfig

    memory = MemoryConfig(optimizer=preset.with_sharding(_zero_level(args), fsdp=_fsdp(args)))
    if args.reserve is not None:
        memory = dataclasses.replace(memory, reserve_bytes=args.reserve * GIB)
    config = SearchConfig(
        gpus=args.gpus,
        global_batch=args.global_batch if args.global_batch is not None else 4 * args.gpus,
        budget_bytes=args.memory * GIB if args.memory is not None else None,
        top_k=args.top,
        memory=memory,
        extrapolation=Extrapolation(enabled=not args.no_extrapolate),
        host_budget_bytes=args.host_memory * GIB if args.host_memory is not None else None,
        framework=preset.framework,
    )
    if args.tolerance is not None:
        config = dataclasses.replace(config, tolerance=args.tolerance)
    return config


def _plan(args: argparse.Namespace) -> int:
    from pipeoffload.planner.frameworks import framework_preset
    from pipeoffload.planner.hardware import load_hardware
    from pipeoffload.planner.limits import limit_cost, limited, train_limits
    from pipeoffload.planner.search import search
    from pipeoffload.planner.verdict import offload_verdict, settled

    preset = framework_preset(args.framework)
    spec, hw = _spec(args, preset), load_hardware(args.hardware)
    config, space = _config(args, preset), _space(args)
    limits = train_limits(spec, {f for f in ("recompute", "tp") if getattr(args, f)})
    searched = limited(space, limits)
    fixed = _every_dimension_fixed(args, searched, spec.seq_len)
    if fixed:
        config = dataclasses.replace(config, nearest_tries=max(config.nearest_tries, 8))
    result = search(spec, hw, config, searched, None if args.quiet else _progress)
    verdict = None if fixed or args.no_verdict else offload_verdict(spec, hw, config, searched,
                                                                   result)
    if verdict is not None:
        result = settled(result, verdict)
    cost = limit_cost(spec, hw, config, space, limits, result) if limits else None
    notes = [*result.notes, *([cost.note(spec.model_type)] if cost else []),
             *_framework_notes(preset)]
    result = dataclasses.replace(result, notes=tuple(notes))
    return _report(args, result, fixed, verdict, cost, hw, config, preset)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _framework_notes(preset: FrameworkPreset) -> list[str]:
    if preset.name == "current":
        return []
    return [f"note: priced as {preset.name} runs it ({preset.summary}); pipeoffload train "
            "runs --framework current, so its step times differ from these"]


def _report(args: argparse.Namespace, result: SearchResult, fixed: bool,
            verdict: Verdict | None, cost: LimitCost | None, hw: Hardware,
            config: SearchConfig, preset: FrameworkPreset) -> int:
    """Print the table or the JSON object; the exit status."""
    from pipeoffload.planner.costing import GIB
    from pipeoffload.planner.report import render_result, result_json

    spec = result.spec
    assert spec is not None
    memory = config.memory
    host_budget = (config.host_budget_bytes if config.host_budget_bytes is not None
                   else hw.host_bytes_per_node)
    fits = result.best is not None and result.best.feasible
    if fixed and result.best is None:
        reasons = " ".join(result.notes) or (
            "the schedule rejects this shape (e.g. interleaved 1F1B needs microbatches that are "
            "a multiple of pp, offload needs pp > 1, chunked schedules pp x chunks <= layers)")
        print(f"pipeoffload plan: error: the configuration you fixed cannot be built: {reasons}",
              file=sys.stderr)
        return 2
    if not fits:
        what = ("your configuration does not fit" if fixed else "no configuration fits")
        print(f"pipeoffload plan: error: {what} (exit status {NOTHING_FITS}); the report says "
              f"{'what it needs' if fixed else 'what came nearest'}", file=sys.stderr)
    if args.json:
        inputs = {"model": spec.name, "layers": spec.num_layers, "hidden": spec.hidden,
                  "seq": spec.seq_len, "gpus": config.gpus, "hardware": hw.name,
                  "global_batch": config.global_batch, "memory_gib": result.budget_bytes / GIB,
                  "host_memory_gib_per_node": host_budget / GIB,
                  "sharded_optimizer": _zero_level(args),
                  "zero": 3 if _fsdp(args) else int(_zero_level(args)),
                  "reserve_gib": memory.reserve_bytes / GIB, "framework": preset.name,
                  "flash_attention": spec.flash_attention}
        data = result_json(result, inputs, fixed=fixed, verdict=verdict)
        data["restrictions"] = cost.as_json() if cost is not None else None
        print(json.dumps(data, sort_keys=True))
        return 0 if fits else NOTHING_FITS
    host = (f", {host_budget / GIB:.0f} GiB pinned host memory per node" if host_budget
            else ", host memory not checked")
    framework = f"; framework {preset.name}" if preset.name != "current" else ""
    line = (f"{spec.name}: {spec.num_layers} layers, hidden {spec.hidden}, seq {spec.seq_len}; "
            f"{config.gpus} x {hw.name}, global batch {config.global_batch} sequences, budget "
            f"{result.budget_bytes / GIB:.1f} GiB per GPU (reserve {memory.reserve_bytes / GIB:g})"
            f"{host}{framework}")
    print(render_result(result, line, fixed=fixed, verdict=verdict))
    return 0 if fits else NOTHING_FITS
