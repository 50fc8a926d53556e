"""`pipeoffload train`: options -> TrainConfig, then run here, under torchrun, or self-launched.

- Under torchrun (env:// variables RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT present) this
  process is one rank of the job (NCCL on GPUs, gloo on CPU).
- Otherwise, with pp * dp * tp > 1 and no ``--inline``, it starts pp * dp * tp local processes
  with cli/launch.py (each re-enters here with ``--worker-config``); with pp * dp * tp == 1 or
  ``--inline`` it runs every pipeline rank in this process (Pipeline's local mode).
The reporting process (the last stage's rank of replica 0, which has the loss) prints a
progress line per ``--log-every`` steps and, at the end, the peak-activation table, or with
``--json`` one JSON line on stdout (progress then goes to stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from pipeoffload.cli import preflight
from pipeoffload.cli.config_file import changed_flags, settings_toml
from pipeoffload.cli.notes import data_line, interrupt_note, nothing_to_resume, startup_line
from pipeoffload.cli.preflight import (
    MAX_CHUNKS,
    MAX_MICROBATCHES,
    MAX_RANKS,
    count,
    input_path,
    number,
    output_dir,
    output_file,
    resume_path,
)
from pipeoffload.core.actions import Kind
from pipeoffload.errors import ConfigError, PipelineRuntimeError, PipeoffloadError
from pipeoffload.training.signals import (
    signal_name,
    stop_on_signals,
    stop_status,
    watch_worker_parent,
)

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SHAPE_FLAGS = {"n_layers": "--layers", "dim": "--dim", "n_heads": "--heads",
                "n_kv_heads": "--kv-heads", "ffn_hidden": "--ffn-hidden"}


@dataclass(frozen=True)
class ReportOptions:
    """What the reporting process prints and writes (``png`` None: no picture)."""

    json: bool = False
    png: str | None = "pipeoffload-train.png"
    log_every: int = 10
    threads: int = 1
    metrics: str | None = None  # a JSON-lines file, one record per step
    tensorboard: str | None = None  # a TensorBoard log folder (needs the tensorboard extra)
    peak_flops_per_s: float | None = None  # one device's, for MFU (None: known GPUs only)


def add_train_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``train`` subcommand (options and handler) on an argparse subparsers;
    returns its parser."""
    p = subparsers.add_parser(
        "train", help="train the reference transformer with a pipeline schedule (offload "
        "included); self-launches local processes, or runs under torchrun",
        description="Train the reference transformer with a pipeline schedule, activation "
        "offload included, and report the peak activation per rank: measured, and predicted by "
        "the simulator. Without torchrun it starts pp * dp * tp local processes; under torchrun it "
        "is one rank of the job. See docs/training.md.")
    p.add_argument("--config", type=preflight.input_file, default=None, metavar="FILE.toml",
                   help="read settings from a TOML file: any option below without its --, "
                   "e.g. pp = 4, checkpoint-dir = \"ck\"; options on the command line win")
    g = p.add_argument_group("parallelism and schedule")
    g.add_argument("--pp", type=count(1, MAX_RANKS), default=4,
                   help="pipeline ranks (default 4)")
    g.add_argument("--dp", type=count(1, MAX_RANKS), default=1,
                   help="data-parallel pipeline replicas (default 1)")
    g.add_argument("--schedule", default="po-f", help="schedule name (default po-f; "
                   "`pipeoffload schedules` lists them)")
    g.add_argument("--chunks", type=count(1, MAX_CHUNKS), default=None, help="stages per rank")
    g.add_argument("--group-size", type=count(1, MAX_RANKS), default=None,
                   help="grouped-interleaved g")
    g.add_argument("--microbatches", type=count(1, MAX_MICROBATCHES), default=None,
                   help="microbatches per replica and step (default 2 * pp: the default "
                   "batch of 16 then splits evenly up to pp 8; simulate's 4 * pp would not)")
    g.add_argument("--offload", default=None, metavar="SPEC",
                   help="none | all | chunks:K | fraction:X | limit:X | recompute-chunks:1+all "
                   "(po-h/po-f: own default)")
    g.add_argument("--fetch-on-use", action="store_true",
                   help="backward passes read offloaded activations from host memory as they "
                   "use them (FETCH) instead of a whole RELOAD: lower peaks, more reads")
    g.add_argument("--inline", action="store_true",
                   help="run every pipeline rank in this one process (dp must be 1)")
    g.add_argument("--tp", type=count(1, MAX_RANKS), default=1,
                   help="tensor-parallel ranks per stage (torch DTensor; default 1); "
                   "pp * dp * tp processes")
    g.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp64"),
                   help="fp32 (default); bf16: bf16 weights and activations, fp32 master "
                   "weights and AdamW state; fp64 for exactness checks")
    g.add_argument("--recompute", default="none", choices=("none", "lgd", "full"),
                   help="none (default); lgd: recompute norm and activation-function outputs "
                   "in each layer's backward; full: recompute every stage's forward")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default="small", metavar="PRESET|PATH",
                   help="reference model preset tiny | small | medium (default small), or a "
                   "Hugging Face config.json (random init) or a folder with one and its "
                   "safetensors weights (loaded: fine-tuning)")
    for field, what in (("n_layers", "transformer layers"), ("dim", "model width"),
                        ("n_heads", "heads"), ("n_kv_heads", "key/value heads"),
                        ("ffn_hidden", "SwiGLU inner width")):
        g.add_argument(_SHAPE_FLAGS[field], dest=field, type=count(1, 1 << 20), default=None,
                       help=f"override the preset's {what}")
    g.add_argument("--seq-len", type=count(1, 1 << 20), default=None,
                   help="tokens per sequence (default min(128, the model's max_seq_len); "
                   "a longer one raises max_seq_len)")
    g.add_argument("--batch-size", type=count(1, 1 << 20), default=16,
                   help="global batch in sequences, "
                   "summed over dp replicas (default 16)")
    g.add_argument("--data", type=input_path, default=None, metavar="PATH",
                   help="text file or folder "
                   "(default: Python standard-library sources)")
    g.add_argument("--max-bytes", type=count(1), default=1 << 20,
                   help="read at most this much text (default 1 MiB)")
    g.add_argument("--tokenizer", type=input_path, default=None, metavar="PATH",
                   help="a local tokenizer.json (or its folder), read with the tokenizers "
                   "package; default: bytes are tokens (the vocabulary must hold 256)")
    g.add_argument("--eval-fraction", type=number(minimum=0, maximum=0.99), default=0.05,
                   metavar="X", help="hold out the last X of the tokens (default 0.05; 0: none)")
    g.add_argument("--eval-every", type=count(0), default=0, metavar="N",
                   help="also measure the held-out loss at the start and every N steps "
                   "(default 0: at the end only)")
    g.add_argument("--eval-batches", type=count(1, 1 << 20), default=4, metavar="N",
                   help="held-out batches per measurement (default 4)")
    g = p.add_argument_group("optimisation")
    # The same defaults as TrainConfig's (a test checks); torch is not imported to build this.
    g.add_argument("--steps", type=count(1, 1 << 40), default=60,
                   help="train up to this step, counted from the start of training (a resumed "
                   "run continues up to it; default 60)")
    g.add_argument("--lr", type=number(above=0, maximum=1e6), default=3e-3,
                   help="peak AdamW lr (default 3e-3)")
    g.add_argument("--warmup-steps", type=count(0), default=10,
                   help="linear warm-up from lr/N to lr over the first N steps (default 10)")
    g.add_argument("--decay-steps", type=count(1), default=None,
                   help="cosine decay to 0.1 lr at this step (default: constant after warmup)")
    g.add_argument("--weight-decay", type=number(minimum=0, maximum=1e6), default=0.1,
                   help="AdamW weight decay (default 0.1)")
    g.add_argument("--grad-clip", type=number(minimum=0, maximum=1e30), default=1.0,
                   help="clip the global gradient norm to this (default 1.0; 0: off)")
    g.add_argument("--seed", type=count(0, 2**63 - 1), default=0,
                   help="seed of the weights and of the data order (default 0)")
    g = p.add_argument_group("runtime, checkpoints and output")
    g.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto (default): CUDA when available, else CPU with gloo")
    g.add_argument("--threads", type=count(1, 4096), default=1,
                   help="torch threads per process on CPU (default 1: tiny matrices run faster "
                   "on one thread, and processes share the cores)")
    g.add_argument("--p2p-timeout", type=number(above=0, maximum=1e7), default=300.0,
                   metavar="S",
                   help="seconds a rank waits for a peer before failing (default 300)")
    g.add_argument("--min-offload-elements", type=count(0), default=0,
                   help="saved tensors this small stay on the device (default 0: move all)")
    g.add_argument("--checkpoint-dir", type=output_dir, default=None, metavar="DIR",
                   help="save checkpoints here (step_<N> folders; one at the end of the run)")
    g.add_argument("--checkpoint-every", type=count(0), default=0, metavar="N",
                   help="also save every N steps (default 0: only the one at the end, which is "
                   "always saved)")
    g.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                   type=resume_path,
                   help="continue from the newest complete checkpoint in --checkpoint-dir, or "
                   "PATH (a step_<N> folder or a checkpoint folder); --steps must be beyond it; "
                   "--resume auto: the newest one if there is one, else start from scratch")
    g.add_argument("--keep-last", type=count(1), default=None, metavar="N",
                   help="keep only the newest N complete checkpoints (default: keep all)")
    g.add_argument("--metrics", type=output_file(), default=None, metavar="FILE.jsonl",
                   help="write one JSON line per step: step, loss, lr, grad norm, tokens/s, "
                   "step time, MFU, peak activation and host pool bytes per rank")
    g.add_argument("--tensorboard", type=output_dir, default=None, metavar="DIR",
                   help="write the same as TensorBoard scalars (extra: pipeoffload[tensorboard])")
    g.add_argument("--peak-tflops", type=number(above=0, maximum=1e6), default=None,
                   metavar="T", help="one device's peak TFLOP/s, for MFU (default: the "
                   "datasheet bf16 peak of A100 / H100 / H200 in bf16 runs; else no MFU)")
    g.add_argument("--export-hf", type=output_dir, default=None, metavar="DIR",
                   help="write the trained Hugging Face model to DIR (new or empty) for "
                   "transformers' from_pretrained")
    g.add_argument("--export-dtype", default=None, choices=("fp32", "bf16"),
                   help="dtype of --export-hf (default: bf16 for a bf16 run, else fp32)")
    g.add_argument("--no-baseline", action="store_true",
                   help="skip the extra step that measures peaks without offload")
    g.add_argument("--json", action="store_true", help="print one JSON line at the end")
    g.add_argument("--png", default="pipeoffload-train.png", metavar="FILE",
                   type=output_file(".png", ".svg"),
                   help="schedule picture to write, .png or .svg (default pipeoffload-train.png;"
                   " skipped with a note without matplotlib)")
    g.add_argument("--no-png", dest="png", action="store_const", const=None,
                   help="write no picture")
    g.add_argument("--log-every", type=count(1), default=10, metavar="N",
                   help="print a progress line every N steps (default 10)")
    p.add_argument("--worker-config", default=None, help=argparse.SUPPRESS)
    p.set_defaults(handler=cmd_train, on_interrupt=interrupt_note)
    return p


def train_parser() -> argparse.ArgumentParser:
    """A stand-alone parser of `pipeoffload train`'s options (for its settings files)."""
    root = argparse.ArgumentParser(prog="pipeoffload")
    return add_train_parser(root.add_subparsers(dest="command"))


def run_settings(args: argparse.Namespace) -> tuple[str, str]:
    """The effective settings (command line and --config merged): as a TOML file that
    --config reads back, and as the flags that differ from the defaults."""
    parser = train_parser()
    header = ("pipeoffload train: the effective settings of this run (command line and --config "
              "merged);\n`pipeoffload train --config THIS_FILE` runs it again")
    return settings_toml(parser, args, header), changed_flags(parser, args)


def config_from_args(args: argparse.Namespace) -> tuple[Any, ReportOptions]:
    """The TrainConfig and ReportOptions the command line asks for."""
    from pipeoffload.training.data import DataConfig
    from pipeoffload.training.model import MODEL_PRESETS, model_preset
    from pipeoffload.training.train import TrainConfig

    overrides = {f: getattr(args, f) for f in ("n_layers", "dim", "n_heads", "n_kv_heads",
                                               "ffn_hidden") if getattr(args, f) is not None}
    hf_model = None if args.model.lower() in MODEL_PRESETS else args.model
    if hf_model is None:
        model = model_preset(args.model)
        positions = model.max_seq_len
    else:
        from pipeoffload.training.hf_model import resolve_model

        if overrides:
            flags = ", ".join(_SHAPE_FLAGS[f] for f in overrides)
            raise ConfigError(f"{flags} shape the reference model; a Hugging Face model's shape "
                              "is its config.json")
        model = model_preset("small")
        positions = resolve_model(hf_model).max_positions or 128
    seq_len = args.seq_len if args.seq_len is not None else min(128, positions)
    if hf_model is None:
        overrides["max_seq_len"] = max(model.max_seq_len, seq_len)
        if args.tokenizer is not None:
            from pipeoffload.training.documents import tokenizer_vocab_size

            overrides["vocab_size"] = tokenizer_vocab_size(args.tokenizer)
        model = dataclasses.replace(model, **overrides)
    data = DataConfig(source=args.data, seq_len=seq_len, batch_size=args.batch_size,
                      seed=args.seed, max_bytes=args.max_bytes, tokenizer=args.tokenizer,
                      eval_fraction=args.eval_fraction)
    if args.resume is not None and args.resume == "latest" and args.checkpoint_dir is None:
        raise ConfigError("--resume without a PATH needs --checkpoint-dir (where to look)")
    config = TrainConfig(
        model=model, data=data, pp=args.pp, dp=args.dp, schedule=args.schedule,
        chunks=args.chunks, group_size=args.group_size, microbatches=args.microbatches,
        offload=args.offload, fetch_on_use=args.fetch_on_use, steps=args.steps, lr=args.lr,
        warmup_steps=args.warmup_steps,
        decay_steps=args.decay_steps, weight_decay=args.weight_decay,
        grad_clip=args.grad_clip or None, seed=args.seed, device=args.device,
        p2p_timeout_s=args.p2p_timeout, min_offload_elements=args.min_offload_elements,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
        resume=args.resume, measure_baseline=not args.no_baseline,
        tp=args.tp, dtype=args.dtype, recompute=args.recompute, keep_last=args.keep_last,
        hf_model=hf_model, eval_every=args.eval_every, eval_batches=args.eval_batches,
        export_hf=args.export_hf, export_dtype=args.export_dtype)
    peak = args.peak_tflops * 1e12 if args.peak_tflops is not None else None
    report = ReportOptions(json=args.json, png=args.png,
                           log_every=args.log_every, threads=args.threads, metrics=args.metrics,
                           tensorboard=args.tensorboard, peak_flops_per_s=peak)
    return config, report


def cmd_train(args: argparse.Namespace) -> int:
    """The `train` handler: decide where to run (see the module docstring) and run."""
    preflight.need_torch("train")
    # torch warns on import when numpy is absent; nothing here needs numpy (a minimal install).
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    if args.worker_config is not None:
        with stop_on_signals() as stop:  # first: a stop may come while torch imports
            payload = json.loads(args.worker_config)
            from pipeoffload.training.train import TrainConfig

            return run_worker(TrainConfig.from_dict(payload["config"]),
                              ReportOptions(**payload["report"]), distributed=True, stop=stop,
                              settings=payload.get("settings"))
    from pipeoffload.training.train import preflight as check_run

    torchrun = all(k in os.environ for k in _TORCHRUN_ENV)
    if torchrun:
        from pipeoffload.parallel.job import read_job_env

        read_job_env(os.environ)  # a bad torchrun environment is an input error, named first
        config, report = _first_rank_reports(lambda: config_from_args(args))
    else:
        config, report = config_from_args(args)
    if not torchrun and args.inline and (config.dp > 1 or config.tp > 1):
        raise ConfigError("--inline runs one pipeline replica in one process; use --dp 1 "
                          "and --tp 1, or drop --inline")
    if report.png is not None and not preflight.have_matplotlib():
        preflight.note("train", preflight.MATPLOTLIB_MISSING.format(what=report.png))
        report = dataclasses.replace(report, png=None)
    if args.resume not in (None, "latest") and args.checkpoint_dir is None:
        preflight.note("train", "--resume PATH without --checkpoint-dir: this run saves no "
                       "checkpoint; add --checkpoint-dir DIR to keep its progress")
    settings, changed = run_settings(args)
    done = nothing_to_resume(config)
    if done:
        preflight.note("train", done)
        return 0
    out = sys.stderr if report.json else sys.stdout
    if torchrun:
        _first_rank_reports(lambda: check_run(config, config.pp * config.dp * config.tp))
        if os.environ.get("RANK") == "0":
            print(f"pipeoffload train: settings: {changed or '(all defaults)'}", file=out,
                  flush=True)
            print(data_line(config.data), file=out, flush=True)
        with stop_on_signals() as stop:
            return run_worker(config, report, distributed=True, stop=stop, settings=settings)
    if config.hf_model is not None:
        from pipeoffload.training.hf_model import weights_note

        note = weights_note(config.hf_model)
        if note:
            preflight.note("train", note)
    if config.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: this machine has no CUDA device torch can use; "
                              "pass --device cpu (or auto)")
    preflight.check_work(config.pp, config.chunks or 2, config.num_microbatches)
    if not args.inline:
        preflight.check_local_processes(config.pp, config.dp, config.tp)
    processes = 1 if args.inline else config.pp * config.dp * config.tp
    plan = check_run(config, processes=processes)
    preflight.offload_notes("train", plan.report, config.fetch_on_use)
    print(startup_line(config, report, processes, plan.schedule.name), file=out, flush=True)
    print(f"pipeoffload train: settings: {changed or '(all defaults)'}", file=out, flush=True)
    print(data_line(config.data), file=out, flush=True)
    if processes == 1:
        with stop_on_signals() as stop:
            return run_worker(config, report, distributed=False, stop=stop, settings=settings)
    return _self_launch(config, report, plan, settings)


def _first_rank_reports(check: Callable[[], Any]) -> Any:
    """Under torchrun every rank checks its input before any process group exists; a bad
    input is one error per job: global rank 0 reports it, the others exit quietly with the
    same status (2)."""
    try:
        return check()
    except PipeoffloadError:
        if os.environ.get("RANK") == "0":
            raise
        os._exit(2)


def _self_launch(config: Any, report: ReportOptions, plan: Any, settings: str) -> int:
    from pipeoffload.cli.launch import LaunchConfig, launch
    from pipeoffload.parallel.topology import Topology

    processes = config.pp * config.dp * config.tp
    last = plan.schedule.rank_of(plan.schedule.num_stages - 1)
    reporter = Topology(pp=config.pp, dp=config.dp, tp=config.tp).global_rank(last, 0)
    payload = json.dumps({"config": config.to_dict(), "report": dataclasses.asdict(report),
                          "settings": settings})
    # --no-png: the payload says what to write; the worker's own defaults must not be checked.
    argv = [sys.executable, "-m", "pipeoffload.cli", "train", "--no-png",
            "--worker-config", payload]
    grace_s = min(config.p2p_timeout_s, 30.0) + 5.0
    # A stopped rank finishes its step and saves; one stuck on a dead peer fails within the
    # P2P timeout: then the launcher stops waiting.
    stop_timeout_s = config.p2p_timeout_s + 60.0
    return launch(argv, LaunchConfig(nprocs=processes, reporting_rank=reporter,
                                     grace_s=grace_s, threads_per_process=report.threads,
                                     stop_timeout_s=stop_timeout_s))


def run_worker(config: Any, report: ReportOptions, *, distributed: bool,
               stop: Any = None, settings: str | None = None) -> int:
    """Train in this process (one rank of a job, or every rank in local mode) and report;
    returns the exit status (0, or 128 + the signal a stopped run stopped on)."""
    import torch

    from pipeoffload.cli.progress import Reporter, say, stop_message
    from pipeoffload.parallel.topology import Topology, connect, disconnect, resolve_device
    from pipeoffload.training.train import train

    topology = None
    try:
        if distributed and stop is not None:
            watch_worker_parent(stop, os.environ)
        if distributed:
            topology = connect(config.pp, config.dp, config.device, config.p2p_timeout_s,
                               tp=config.tp, agree={"options": config.to_dict()})
        else:
            topology = Topology.local(config.pp, resolve_device(config.device))
        if topology.device.type == "cpu":
            torch.set_num_threads(report.threads)
        out = sys.stderr if report.json else sys.stdout
        reporter = Reporter(config, report, topology, out)
        files = {"config.toml": settings.encode()} if settings else None
        try:
            result = train(config, topology, on_step=reporter, on_eval=reporter.held_out,
                           stop=stop, checkpoint_files=files)
        finally:
            reporter.close()
        if result.reporter and result.stopped_by:
            say(stop_message(result, config))
            if report.json:
                say(json.dumps(summary(result, config, None), sort_keys=True), sys.stdout)
        elif result.reporter:
            _report(result, config, report, out)
    except BaseException as error:
        if not distributed:
            raise
        # A failed rank must not hang in teardown waiting for peers: report and leave now.
        where = f"rank {topology.rank if topology else os.environ.get('RANK', '?')}"
        if isinstance(error, KeyboardInterrupt):  # the launcher (or torchrun) says the rest
            os._exit(preflight.INTERRUPTED)
        if isinstance(error, (PipeoffloadError, OSError)):
            text = str(error) if isinstance(error, PipeoffloadError) else (
                f"{error.filename + ': ' if error.filename else ''}{error.strerror or error}")
            text = text[len(where) + 2:] if text.startswith(f"{where}: ") else text
            say(f"pipeoffload train: {where}: error: {text}")
            # A rank that failed while running (a peer died, a disk filled) failed its work (1);
            # one refused its input (a bad checkpoint or environment) before training (2).
            failed = isinstance(error, (PipelineRuntimeError, OSError))
            os._exit(preflight.FAILED if failed else preflight.INPUT_ERROR)
        print(f"pipeoffload train: {where}: {type(error).__name__}: {error}", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    if topology is not None:
        disconnect(topology)
    if distributed and result.stopped_by:
        # Everything is saved and said; the interpreter's teardown with torch loaded takes
        # seconds, which a preemption's grace period may not have.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(stop_status(result.stopped_by))
    return stop_status(result.stopped_by) if result.stopped_by else 0


def format_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _report(result: Any, config: Any, report: ReportOptions, out: IO[str]) -> None:
    if report.json:
        png = _write_png(result, report.png)
        print(json.dumps(summary(result, config, png), sort_keys=True), flush=True)
        return
    print(render_table(result), file=out)
    if result.checkpoint:
        print(f"checkpoint: {result.checkpoint}", file=out)
    if result.export:
        print(f"Hugging Face export: {result.export} (transformers.AutoModelForCausalLM."
              "from_pretrained loads it)", file=out)
    out.flush()
    png = _write_png(result, report.png)
    if png:
        print(f"schedule PNG: {png}", file=out, flush=True)


def _write_png(result: Any, path: str | None) -> str | None:
    if path is None:
        return None
    if not preflight.have_matplotlib():  # checked up front too; a worker may differ
        preflight.note("train", preflight.MATPLOTLIB_MISSING.format(what=path))
        return None
    from pipeoffload.sim.render_png import render_png

    simulation = result.simulation or result.plan.result
    with preflight.writing(path):
        return str(render_png(simulation, path, compare=result.baseline_simulation))


def render_table(result: Any) -> str:
    """Peak activation per pipeline rank: measured and predicted, with and without offload."""
    schedule = result.plan.schedule
    rows = [("rank", "stages", "measured", "predicted", "no offload: measured", "predicted")]
    for r in range(schedule.num_ranks):
        rows.append((str(r), ",".join(map(str, schedule.stages_on_rank(r))),
                     *(format_bytes(None if values is None else values[r])
                       for values in (result.peak_bytes, result.predicted_bytes,
                                      result.baseline_bytes, result.baseline_predicted_bytes))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    losses = result.losses
    head = (f"{schedule.name}: pp={schedule.num_ranks}, {schedule.num_stages} stages, "
            f"{schedule.microbatches} microbatches; steps {result.start_step}->{result.end_step}"
            + (f", loss {losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "")
            + f", {result.tokens_per_s:,.0f} tokens/s")
    notes = ("measured: ActivationMeter on the real tensors, max over steps (replica 0); "
             "predicted: the simulator with per-stage sizes measured on the first step; no "
             "offload: one extra forward/backward of the same schedule without transfers "
             "(measured) and its simulation (predicted)")
    if schedule.has_kind(Kind.FETCH):
        notes += ("; FETCH-ed activations are read back tensor by tensor as the backward uses "
                  "them and never held whole, so a rank whose stages are all offloaded can "
                  "measure 0 B")
    return "\n".join([head, "peak activation per pipeline rank", *lines, notes])


def summary(result: Any, config: Any, png: str | None) -> dict[str, Any]:
    """The --json object."""
    schedule = result.plan.schedule
    ma_bytes = None
    if result.stage_bytes is not None:
        ma_bytes = [sum(result.stage_bytes[s] for s in schedule.stages_on_rank(r))
                    for r in range(schedule.num_ranks)]
    as_list = (lambda v: None if v is None else list(v))  # noqa: E731
    return {
        "schedule": schedule.name, "pp": config.pp, "dp": config.dp, "tp": config.tp,
        "dtype": config.dtype, "recompute": config.recompute,
        "stages": schedule.num_stages, "microbatches": schedule.microbatches,
        "start_step": result.start_step, "steps": result.end_step,
        "first_loss": result.losses[0] if result.losses else None,
        "last_loss": result.losses[-1] if result.losses else None,
        "losses": list(result.losses), "tokens_per_s": result.tokens_per_s,
        "peak_activation_bytes": list(result.peak_bytes),
        "predicted_peak_activation_bytes": as_list(result.predicted_bytes),
        "peak_activation": None if ma_bytes is None else
        [b / m for b, m in zip(result.peak_bytes, ma_bytes)],
        "peak_activation_without_offload_bytes": as_list(result.baseline_bytes),
        "predicted_peak_activation_without_offload_bytes":
            as_list(result.baseline_predicted_bytes),
        "stage_activation_bytes": as_list(result.stage_bytes),
        "checkpoint": result.checkpoint, "png": png,
        "stopped_by": signal_name(result.stopped_by) if result.stopped_by else None,
        "eval_losses": [list(pair) for pair in result.eval_losses],
        "eval_loss": result.eval_losses[-1][1] if result.eval_losses else None,
        "export": result.export, "model": config.hf_model or "reference",
    }

