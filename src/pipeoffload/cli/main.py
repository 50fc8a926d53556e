"""The `pipeoffload` command: one short function per subcommand, each building the library's
config dataclasses and calling the public API (the library never imports this module)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any

from pipeoffload.cli import config_file, preflight
from pipeoffload.cli.preflight import count, number
from pipeoffload.core.collector import cyclic_gc_paused
from pipeoffload.errors import ConfigError, PipeoffloadError
from pipeoffload.sim.render_text import MIN_WIDTH

if TYPE_CHECKING:  # the commands import these when they run (a fast start for every command)
    from pipeoffload.core.schedule import Schedule
    from pipeoffload.offload.plan import OffloadPlan, OffloadPolicy
    from pipeoffload.sim.costs import CostModel

Handler = Callable[[argparse.Namespace], int]


def _add_schedule_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--schedule", default="po-f", help="schedule name (see `pipeoffload "
                     "schedules`; default po-f)")
    src.add_argument("--from-csv", metavar="FILE", type=preflight.input_file,
                     help="load a schedule from CSV instead "
                     "(one row per rank, torch.distributed.pipelining's format)")
    p.add_argument("--pp", type=count(1, preflight.MAX_RANKS), default=4,
                   help="pipeline ranks (default 4)")
    p.add_argument("--microbatches", type=count(1, preflight.MAX_MICROBATCHES), default=None,
                   help="microbatches per step (default 4 * pp: enough for every schedule "
                   "to reach its steady state, as the authors measure)")
    p.add_argument("--chunks", type=count(1, preflight.MAX_CHUNKS), default=None,
                   help="stages per rank (schedules with several chunks)")
    p.add_argument("--group-size", type=count(1, preflight.MAX_RANKS), default=None,
                   help="grouped-interleaved group size g, ceil(p/2) <= g <= p")
    p.add_argument("--offload", default=None, metavar="SPEC",
                   help="none | all | chunks:K | fraction:X | limit:X[GiB] | given (po-h / "
                   "po-f have their own default; --from-csv keeps the file's transfers); per "
                   "tensor class: budget:X[GiB] | classes:A+B[/recompute:C] | "
                   "megatron:MODULES[,fraction=X,...] (docs/offload.md)")
    p.add_argument("--offload-ratio", type=number(minimum=0, maximum=1e6), default=None,
                   metavar="R",
                   help="one-way copy time of a chunk's activations / its F+I+W time")
    p.add_argument("--allow-stall", action="store_true",
                   help="keep transfers that cannot hide behind compute (reports the stall)")
    p.add_argument("--fetch-on-use", action="store_true",
                   help="bring activations back by FETCH (each backward pass reads them from "
                   "host memory as it uses them) where the reads hide, instead of RELOAD")
    time = number(minimum=0, maximum=1e12)
    p.add_argument("--cost-f", type=time, default=1.0,
                   help="forward time of one chunk (default 1)")
    p.add_argument("--cost-i", type=time, default=1.0,
                   help="input-gradient backward time (default 1)")
    p.add_argument("--cost-w", type=time, default=1.0,
                   help="weight-gradient backward time (default 1)")
    p.add_argument("--p2p", type=time, default=0.0,
                   help="latency of a cross-rank hand-off (default 0)")
    p.add_argument("--overlap-f-b", type=number(minimum=0, maximum=1), default=None,
                   metavar="X",
                   help="time an F followed by another microbatch's B as DeepSeek's overlapped "
                   "pair, F+B-X*min(F,B) (0..1; default: back to back, as our runtime runs)")
    p.add_argument("--activation-bytes", type=number(above=0, maximum=1e18), default=None,
                   help="bytes one microbatch keeps on one stage (adds byte peaks)")
    p.add_argument("--half-duplex", action="store_true", help="host link copies one way at a time")
    p.add_argument("--ranks-per-link", type=count(1, preflight.MAX_RANKS), default=1,
                   help="ranks sharing one host link (default 1; 2: two GPUs behind one PCIe "
                   "switch)")


def _schedule_and_plan(args: argparse.Namespace) -> OffloadPlan:
    """The schedule ``simulate`` was asked for (by name, or as ``--from-csv`` holds it) with
    offload planned in, and its simulation (OffloadPlan)."""
    from pipeoffload.api import plan_schedule, resolve_costs
    from pipeoffload.core.actions import OFFLOAD_KINDS
    from pipeoffload.core.text import read_csv
    from pipeoffload.core.validate import validate
    from pipeoffload.offload.class_targets import is_class_target
    from pipeoffload.offload.plan import OffloadPolicy, add_offload
    from pipeoffload.offload.targets import parse_target
    from pipeoffload.sim.costs import CostModel, Duplex, HostLink

    costs = resolve_costs(CostModel(
        f_time=args.cost_f, i_time=args.cost_i, w_time=args.cost_w, p2p_time=args.p2p,
        activation_bytes=args.activation_bytes, overlap_f_b=args.overlap_f_b,
        host_link=HostLink(Duplex.HALF if args.half_duplex else Duplex.FULL,
                           args.ranks_per_link),
    ), args.offload_ratio)
    policy = OffloadPolicy(fetch_on_use=args.fetch_on_use)
    if is_class_target(args.offload):
        return _class_plan(args, costs, policy)
    target = (parse_target(args.offload, allow_stall=args.allow_stall)
              if args.offload is not None else None)
    if args.from_csv:
        for flag in ("chunks", "group_size"):
            if getattr(args, flag) is not None:
                raise PipeoffloadError(f"--{flag.replace('_', '-')} has no effect with "
                                       "--from-csv (the file fixes the schedule); drop it")
        schedule = validate(read_csv(args.from_csv))
        if target is None:  # a planned schedule saved with --csv runs as it was planned
            target = parse_target("given" if schedule.has_kind(*OFFLOAD_KINDS) else "none")
        return add_offload(schedule, costs, target, policy)
    options: dict[str, Any] = {
        k: v for k, v in (("chunks", args.chunks), ("group_size", args.group_size))
        if v is not None}
    microbatches = args.microbatches if args.microbatches is not None else 4 * args.pp
    preflight.check_work(args.pp, args.chunks or 2, microbatches)
    if args.allow_stall and target is None:
        raise PipeoffloadError("--allow-stall needs --offload SPEC")
    return plan_schedule(args.schedule, args.pp, microbatches, target, costs=costs,
                         policy=policy, **options)


def _class_plan(args: argparse.Namespace, costs: CostModel, policy: OffloadPolicy
                ) -> OffloadPlan:
    """``--offload budget: / classes: / megatron:``: the schedule planned per tensor class,
    the classes those of a GPT layer (seq 4096, hidden 4096, flash attention), 4 per stage."""
    from pipeoffload.api import plan_schedule
    from pipeoffload.offload.class_targets import ModelClasses, plan_class_target
    from pipeoffload.planner.tensor_classes import layer_classes
    from pipeoffload.planner.transformer import TransformerSpec, layer_activation_bytes

    if args.from_csv or args.allow_stall:
        raise PipeoffloadError(f"--offload {args.offload} plans a named schedule's transfers "
                               "itself; drop --from-csv / --allow-stall")
    spec = TransformerSpec(num_layers=4, hidden=4096, heads=32, kv_heads=32, ffn_hidden=16384,
                           vocab=32000, seq_len=4096, name="gpt-4k")
    options: dict[str, Any] = {
        k: v for k, v in (("chunks", args.chunks), ("group_size", args.group_size))
        if v is not None}
    microbatches = args.microbatches if args.microbatches is not None else 4 * args.pp
    preflight.check_work(args.pp, args.chunks or 2, microbatches)
    bare = plan_schedule(args.schedule, args.pp, microbatches, "none", costs=costs,
                         **options).schedule
    chunk = args.activation_bytes or 4 * layer_activation_bytes(spec, 1, "none")
    if costs.activation_bytes is None:  # byte peaks (and byte budgets) for the model's chunks
        costs = dataclasses.replace(costs, activation_bytes=chunk)
    model = ModelClasses(layer_classes(spec), 4, chunk)
    return plan_class_target(bare, costs, args.offload, model, policy)


def cmd_simulate(args: argparse.Namespace) -> int:
    # The plan makes 10^6 objects and no cycles (core/collector.py). With the collector paused
    # until they are freed (when _simulate returns), it never scans them: re-enabled inside
    # plan_schedule, its first collection walked them all (about 1 s at p = 64, m = 1024).
    with cyclic_gc_paused():
        return _simulate(args)


def _simulate(args: argparse.Namespace) -> int:
    from pipeoffload.core.text import write_csv
    from pipeoffload.sim.render_text import render_grid, render_summary_table

    plan = _schedule_and_plan(args)
    result, report, schedule = plan.result, plan.report, plan.schedule
    if args.csv:
        with preflight.writing_output("simulate", "--csv", args.csv, args.fifo_wait):
            write_csv(schedule, args.csv)
        if schedule.classes:
            preflight.note("simulate", f"{args.csv} holds the actions only, not the tensor "
                           "classes each activation moves or recomputes (Schedule.classes)")
    if args.png and not preflight.have_matplotlib():
        preflight.note("simulate", preflight.MATPLOTLIB_MISSING.format(what=args.png))
    elif args.png:
        from pipeoffload.core.actions import OFFLOAD_KINDS
        from pipeoffload.sim.render_png import render_png
        from pipeoffload.sim.simulator import simulate

        bare = schedule.without(*OFFLOAD_KINDS).with_classes({})
        baseline = simulate(dataclasses.replace(bare, name=f"{bare.name} without offload"),
                            result.costs) if report.offloaded else None
        with preflight.writing_output("simulate", "--png", args.png, args.fifo_wait):
            render_png(result, args.png, compare=baseline)
    if args.trace:
        from pipeoffload.sim.render_trace import write_trace

        with preflight.writing_output("simulate", "--trace", args.trace, args.fifo_wait):
            write_trace(result, args.trace)
    preflight.offload_notes("simulate", report, args.fetch_on_use, result.peak_activation)
    if args.json:
        print(json.dumps(_simulate_json(plan), sort_keys=True))
        return 0
    print(render_summary_table(result))
    if report.offloaded or report.skipped or report.notes:
        print(report.summary())
    for note in _marker_notes(schedule):
        print(f"note: {note}")
    if not args.no_grid:
        print(render_grid(result, width=_grid_width(args.width), color=sys.stdout.isatty()))
    wrote_png = args.png if preflight.have_matplotlib() else None
    for label, path in (("csv", args.csv), ("png", wrote_png), ("trace", args.trace)):
        if path:
            print(f"wrote {label}: {path}")
    return 0


def _grid_width(flag: int | None) -> int | None:
    """--width, else $COLUMNS (as shells export it) when it is a usable width, else None."""
    if flag is not None:
        return flag
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isascii() and columns.isdigit():  # isdigit() alone takes '²', which int() refuses
        return max(MIN_WIDTH, int(columns))
    return None


def _simulate_json(plan: OffloadPlan) -> dict[str, Any]:
    result, report, schedule = plan.result, plan.report, plan.schedule
    return {
        "schedule": schedule.name,
        "pp": schedule.num_ranks,
        "chunks": schedule.chunks,
        "stages": schedule.num_stages,
        "microbatches": schedule.microbatches,
        "makespan": result.makespan,
        "bubble_rate": result.bubble_rate,
        "peak_activation": list(result.peak_activation),
        "peak_activation_without_offload": list(report.peak_before),
        "peak_bytes": list(result.peak_bytes) if result.peak_bytes is not None else None,
        "offload": str(report.target),
        "offloaded_fraction": report.offloaded_fraction,
        "stall_time": result.total_stall_time,
        "stall_time_per_rank": list(result.stall_time),
        "notes": list(report.notes) + _marker_notes(schedule),
    }


def _marker_notes(schedule: Schedule) -> list[str]:
    from pipeoffload.core.actions import MARKER_KINDS

    if not schedule.has_kind(*MARKER_KINDS):  # found once per schedule (Schedule.kind_set)
        return []
    kinds = sorted({a.kind.value for row in schedule.ranks for a in row if a.kind in MARKER_KINDS})
    return [f"torch's {' / '.join(kinds)} actions are markers: kept in the schedule (and in "
            "--csv), but they cost no time here (no FSDP or data-parallel traffic is modelled)"]


def cmd_schedules(args: argparse.Namespace) -> int:
    from pipeoffload.api import schedule_names

    names = schedule_names()
    width = max(len(n) for n, _ in names)
    for name, description in names:
        print(f"{name.ljust(width)}  {description}")
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    preflight.need_torch("probe")
    from pipeoffload.training.probe import run_probe_cli

    return run_probe_cli(args.output, args.fifo_wait)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeoffload",
        description="Pipeline-parallel schedules with activation offload (PipeOffload).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    from pipeoffload.cli.export import add_export_parser
    from pipeoffload.cli.plan import add_plan_parser
    from pipeoffload.cli.tokenize import add_tokenize_parser
    from pipeoffload.cli.train import add_train_parser

    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("simulate", help="simulate a schedule: time, bubbles, transfers, memory")
    _add_schedule_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--csv", metavar="FILE", type=preflight.output_file(),
                   help="write the (planned) schedule as CSV")
    p.add_argument("--png", metavar="FILE", type=preflight.output_file(".png", ".svg"),
                   help="draw lanes and memory curves to a .png or .svg file (needs "
                   "matplotlib: pipeoffload[plot]; skipped with a note without it)")
    p.add_argument("--trace", metavar="FILE", type=preflight.output_file(),
                   help="write a Chrome / Perfetto trace JSON")
    preflight.add_fifo_wait(p)
    p.add_argument("--no-grid", action="store_true", help="skip the terminal picture")
    p.add_argument("--width", type=count(MIN_WIDTH, 100_000), default=None, metavar="COLUMNS",
                   help="width of the terminal picture (default: $COLUMNS, else 120)")
    p.set_defaults(handler=cmd_simulate)
    p = sub.add_parser("schedules", help="list schedule names, one per line")
    p.set_defaults(handler=cmd_schedules)
    p = sub.add_parser("probe", help="measure this GPU's matmul rate and host-link bandwidth "
                       "and print a hardware preset")
    p.add_argument("--output", metavar="FILE", type=preflight.output_file(),
                   help="save the preset as JSON")
    preflight.add_fifo_wait(p)
    p.set_defaults(handler=cmd_probe)
    add_train_parser(sub)
    add_export_parser(sub)
    add_plan_parser(sub)
    add_tokenize_parser(sub)
    return parser


def _version() -> str:
    try:
        return metadata.version("pipeoffload")
    except metadata.PackageNotFoundError:  # run from a source tree without installing
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, check (cli/preflight.py), run; every expected failure is an `error:` line and a
    non-zero exit status (2: bad input, 1: the work failed, 130: interrupted)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:  # --config FILE.toml: its settings go before the command line's own flags
        argv, origins = config_file.expand_settings(parser, argv)
    except ConfigError as error:
        command = next((t for t in argv if not t.startswith("-")), "")
        print(f"pipeoffload {command}: error: {error}", file=sys.stderr)
        return preflight.INPUT_ERROR
    args = parser.parse_args(argv)
    setattr(args, preflight.SETTING_ORIGINS, config_file.kept_origins(args, origins))
    handler: Handler = args.handler
    return preflight.run_command(args.command, handler, args,
                                 getattr(args, "on_interrupt", None))


if __name__ == "__main__":
    sys.exit(main())
