"""`pipeoffload train`: options -> TrainConfig, then run here, under torchrun, or self-launched.

- Under torchrun (env:// variables RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT present) this
  process is one rank of the job (NCCL on GPUs, gloo on CPU).
- Otherwise, with pp * dp * tp * cp > 1 and no ``--inline``, it starts pp * dp * tp * cp
  local processes with cli/launch.py (each re-enters here with ``--worker-config``); with
  pp * dp * tp * cp == 1 or ``--inline`` it runs every pipeline rank in this process
  (Pipeline's local mode).
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
from typing import IO, TYPE_CHECKING, Any, NoReturn, TypeVar

from pipeoffload.cli import preflight
from pipeoffload.cli.notes import data_line, interrupt_note, nothing_to_resume, startup_line
from pipeoffload.cli.train_options import add_train_options, config_error, field_flags, run_settings
from pipeoffload.cli.train_report import ReportOptions, print_result, summary
from pipeoffload.errors import ConfigError, FieldError, PipelineRuntimeError, PipeoffloadError
from pipeoffload.parallel.rank_order import parse_order
from pipeoffload.parallel.topology import Topology
from pipeoffload.training.data_config import DataConfig
from pipeoffload.training.model_config import MODEL_PRESETS, ModelConfig, model_preset
from pipeoffload.training.signals import (
    StopRequest,
    stop_on_signals,
    stop_status,
    watch_worker_parent,
)

if TYPE_CHECKING:
    from pipeoffload.offload.plan import OffloadPlan
    from pipeoffload.training.results import TrainResult
    from pipeoffload.training.train import TrainConfig

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SHAPES = ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_hidden")
T = TypeVar("T")


def add_train_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``train`` subcommand (options and handler) on an argparse subparsers;
    returns its parser."""
    p = subparsers.add_parser(
        "train", help="train the reference transformer with a pipeline schedule (offload "
        "included); self-launches local processes, or runs under torchrun",
        description="Train the reference transformer with a pipeline schedule, activation "
        "offload included, and report the peak activation per rank: measured, and predicted by "
        "the simulator. Without torchrun it starts pp * dp * tp * cp local processes; under "
        "torchrun it is one rank of the job. See docs/training.md.")
    add_train_options(p)
    p.set_defaults(handler=cmd_train, on_interrupt=interrupt_note)
    return p


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, ReportOptions]:
    """The TrainConfig and ReportOptions the command line asks for (a wrong value is named by
    its option)."""
    from pipeoffload.training.train import TrainConfig  # the planner: not for other commands

    model, hf_model, seq_len = _model_from_args(args)
    data = DataConfig(source=args.data, seq_len=seq_len, batch_size=args.batch_size,
                      seed=args.seed, max_bytes=args.max_bytes, tokenizer=args.tokenizer,
                      eval_fraction=args.eval_fraction, text_key=args.text_key,
                      cache_dir=args.cache_dir)
    if args.resume is not None and args.resume == "latest" and args.checkpoint_dir is None:
        raise ConfigError("--resume without a PATH needs --checkpoint-dir (where to look)")
    try:
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
            export_hf=args.export_hf, export_dtype=args.export_dtype, zero=args.zero,
            cp=args.cp, rank_order=args.rank_order)
    except FieldError as error:
        raise config_error(error) from None
    peak = args.peak_tflops * 1e12 if args.peak_tflops is not None else None
    report = ReportOptions(json=args.json, png=args.png,
                           log_every=args.log_every, threads=args.threads, metrics=args.metrics,
                           tensorboard=args.tensorboard, peak_flops_per_s=peak,
                           fifo_wait_s=args.fifo_wait)
    return config, report


def _model_from_args(args: argparse.Namespace) -> tuple[ModelConfig, str | None, int]:
    """The reference model's shape (a preset with the shape options applied, its
    max_seq_len raised to the sequence length and its vocabulary to the tokenizer's), or the
    Hugging Face model --model names; and the sequence length (default min(128, positions))."""
    overrides: dict[str, Any] = {f: getattr(args, f) for f in _SHAPES
                                 if getattr(args, f) is not None}
    hf_model = None if args.model.lower() in MODEL_PRESETS else args.model
    if hf_model is None:
        model = model_preset(args.model)
        positions = model.max_seq_len
    else:
        from pipeoffload.training.hf_model import resolve_model

        if overrides:
            flags = field_flags()
            raise ConfigError(f"{', '.join(flags[f'model.{f}'] for f in overrides)} shape the "
                              "reference model; a Hugging Face model's shape is its config.json")
        model = model_preset("small")  # unused but for --document-mask's id
        if args.document_mask:
            eos = _document_eos(args)
            model = dataclasses.replace(model, vocab_size=max(model.vocab_size, eos + 1),
                                        document_eos=eos)
        positions = resolve_model(hf_model).max_positions or 128
    seq_len = args.seq_len if args.seq_len is not None else min(128, positions)
    if hf_model is None:
        overrides["max_seq_len"] = max(model.max_seq_len, seq_len)
        from pipeoffload.training.sources import is_token_source

        if args.document_mask:
            overrides["document_eos"] = _document_eos(args)
        if args.tokenizer is not None or is_token_source(args.data):
            from pipeoffload.training.data import vocab_needed

            overrides["vocab_size"] = vocab_needed(DataConfig(source=args.data,
                                                              tokenizer=args.tokenizer))
        try:
            model = dataclasses.replace(model, **overrides)
        except FieldError as error:  # ModelConfig's fields, named by the flags that set them
            flags = field_flags()
            raise ConfigError(error.render({f: flags.get(f"model.{f}", f)
                                            for f in error.fields})) from None
    return model, hf_model, seq_len


def _document_eos(args: argparse.Namespace) -> int:
    """The id --document-mask masks attention at: the data's end-of-document token."""
    from pipeoffload.training.data import end_of_document_id

    eos = end_of_document_id(DataConfig(source=args.data, tokenizer=args.tokenizer))
    if eos is None:
        raise ConfigError("--document-mask needs an end-of-document token, and the tokenizer "
                          "names none (no eos_token in a tokenizer_config.json beside it, none "
                          "of the usual names); add one")
    return eos


def cmd_train(args: argparse.Namespace) -> int:
    """The `train` handler: decide where to run (see the module docstring) and run."""
    preflight.need_torch("train")
    # torch warns on import when numpy is absent; nothing here needs numpy (a minimal install).
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    if args.worker_config is not None:
        return _run_launched(args.worker_config)
    torchrun = all(k in os.environ for k in _TORCHRUN_ENV)
    config, report = _configure(args, torchrun)
    settings, changed = run_settings(args)
    done = nothing_to_resume(config)
    if done:
        return _finish_done_run(config, done)
    out = sys.stderr if report.json else sys.stdout
    if torchrun:
        return _run_under_torchrun(config, report, settings, changed, out)
    return _run_here(config, report, settings, changed, out, inline=args.inline)


def _finish_done_run(config: TrainConfig, done: str) -> int:
    """A requeued run whose training is complete: nothing to train, but an export an earlier
    run did not finish (killed while writing it) is written now."""
    if config.export_hf is None or config.checkpoint_dir is None:
        preflight.note("train", done)
        return 0
    from pipeoffload.parallel.checkpoint import complete_checkpoints
    from pipeoffload.parallel.checkpoint_lock import FolderLock
    from pipeoffload.parallel.export import export_complete
    from pipeoffload.training.hf_run import finish_export

    if export_complete(config.export_hf):
        preflight.note("train", f"{done}; the export in {config.export_hf} is complete")
        return 0
    lock = FolderLock.acquire(config.checkpoint_dir)
    try:
        newest = complete_checkpoints(config.checkpoint_dir)[-1]
        preflight.note("train", f"{done}; finishing the export to {config.export_hf} from "
                       f"{newest}, which an earlier run did not complete")
        folder = finish_export(config, newest)
    finally:
        lock.release()
    preflight.note("train", f"exported {newest} to {folder}")
    return 0


def _run_launched(worker_config: str) -> int:
    """A process cli/launch.py started: the launcher's checked settings, run as one rank."""
    from pipeoffload.training.train import TrainConfig

    with stop_on_signals() as stop:  # first: a stop may come while torch imports
        payload = json.loads(worker_config)
        return run_worker(TrainConfig.from_dict(payload["config"]),
                          ReportOptions(**payload["report"]), distributed=True, stop=stop,
                          settings=payload.get("settings"))


def _configure(args: argparse.Namespace, torchrun: bool) -> tuple[TrainConfig, ReportOptions]:
    """The run's settings, checked, with a note for each option that will not do what it
    seems to (a picture without matplotlib, a resume that saves nothing)."""
    if torchrun:
        from pipeoffload.parallel.job import read_job_env

        read_job_env(os.environ)  # a bad torchrun environment is an input error, named first
        config, report = _first_rank_reports(lambda: config_from_args(args))
    else:
        config, report = config_from_args(args)
    if not torchrun and args.inline and (config.dp > 1 or config.tp > 1 or config.cp > 1):
        raise ConfigError("--inline runs one pipeline replica in one process; use --dp 1, "
                          "--tp 1 and --cp 1, or drop --inline")
    if report.png is not None and not preflight.have_matplotlib():
        preflight.note("train", preflight.MATPLOTLIB_MISSING.format(what=report.png))
        report = dataclasses.replace(report, png=None)
    if report.metrics is not None and config.resume is not None:
        from pipeoffload.training.metrics import check_metrics_file

        check_metrics_file(report.metrics)  # a resumed run reads it back at its first step
    if args.resume not in (None, "latest") and args.checkpoint_dir is None:
        preflight.note("train", "--resume PATH without --checkpoint-dir: this run saves no "
                       "checkpoint; add --checkpoint-dir DIR to keep its progress")
    return config, report


def _run_under_torchrun(config: TrainConfig, report: ReportOptions, settings: str,
                        changed: str, out: IO[str]) -> int:
    """This process is one rank of a torchrun job: check (rank 0 says what is wrong), then
    train as that rank."""
    from pipeoffload.training.run_checks import check_run

    _first_rank_reports(lambda: check_run(config, config.processes))
    if os.environ.get("RANK") == "0":
        print(f"pipeoffload train: settings: {changed or '(all defaults)'}", file=out,
              flush=True)
        print(data_line(config.data), file=out, flush=True)
    with stop_on_signals() as stop:
        return run_worker(config, report, distributed=True, stop=stop, settings=settings)


def _run_here(config: TrainConfig, report: ReportOptions, settings: str, changed: str,
              out: IO[str], *, inline: bool) -> int:
    """Check everything up front, say what will run, then run it in this process (one
    process, or ``--inline``) or on pp * dp * tp * cp local processes."""
    from pipeoffload.training.run_checks import check_run

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
    if not inline:
        preflight.check_local_processes(config.pp, config.dp, config.tp, config.cp)
    processes = 1 if inline else config.processes
    plan = check_run(config, processes=processes)
    preflight.offload_notes("train", plan.report, config.fetch_on_use)
    print(startup_line(config, report, processes, plan.schedule.name), file=out, flush=True)
    print(f"pipeoffload train: settings: {changed or '(all defaults)'}", file=out, flush=True)
    print(data_line(config.data), file=out, flush=True)
    if processes == 1:
        with stop_on_signals() as stop:
            return run_worker(config, report, distributed=False, stop=stop, settings=settings)
    return _self_launch(config, report, plan, settings)


def _first_rank_reports(check: Callable[[], T]) -> T:
    """Under torchrun every rank checks its input before any process group exists; a bad
    input is one error per job: global rank 0 reports it, the others exit quietly with the
    same status (2)."""
    try:
        return check()
    except PipeoffloadError:
        if os.environ.get("RANK") == "0":
            raise
        os._exit(2)


def _self_launch(config: TrainConfig, report: ReportOptions, plan: OffloadPlan,
                 settings: str) -> int:
    from pipeoffload.cli.launch import LaunchConfig, launch

    processes = config.processes
    last = plan.schedule.rank_of(plan.schedule.num_stages - 1)
    reporter = Topology(pp=config.pp, dp=config.dp, tp=config.tp, cp=config.cp,
                        order=parse_order(config.rank_order)).global_rank(last, 0)
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


def run_worker(config: TrainConfig, report: ReportOptions, *, distributed: bool,
               stop: StopRequest | None = None, settings: str | None = None) -> int:
    """Train in this process (one rank of a job, or every rank in local mode) and report;
    returns the exit status (0, or 128 + the signal a stopped run stopped on)."""
    import torch

    from pipeoffload.parallel.topology import disconnect

    topology = None
    try:
        if distributed and stop is not None:
            watch_worker_parent(stop, os.environ)
        topology = _join(config, distributed)
        if topology.device is not None and topology.device.type == "cpu":
            torch.set_num_threads(report.threads)
        result = _train_and_report(config, report, topology, stop, settings)
    except BaseException as error:
        if not distributed:
            raise
        _fail_rank(error, topology)
    disconnect(topology)
    status = stop_status(result.stopped_by) if result.stopped_by else 0
    if distributed:
        # Everything is saved and said. The interpreter's teardown with torch loaded takes
        # seconds, which a preemption's grace period may not have, and torch's C++ teardown
        # after a tensor-parallel run aborted a worker now and then ("terminate called without
        # an active exception", 2 of 8 runs of test_tp_bf16_checkpoint_resumes_bitwise_...):
        # a worker that finished leaves without it.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)
    return status


def _join(config: TrainConfig, distributed: bool) -> Topology:
    """This process's place: one rank of the job (torch.distributed), or every rank."""
    from pipeoffload.parallel.topology import connect, resolve_device

    if distributed:
        return connect(config.pp, config.dp, config.device, config.p2p_timeout_s,
                       tp=config.tp, agree={"options": config.to_dict()}, cp=config.cp,
                       order=parse_order(config.rank_order))
    return Topology.local(config.pp, resolve_device(config.device))


def _train_and_report(config: TrainConfig, report: ReportOptions, topology: Topology,
                      stop: StopRequest | None, settings: str | None) -> TrainResult:
    """Train, with progress lines as it goes; the reporting process then says how it went."""
    from pipeoffload.cli.progress import Reporter, say, stop_message
    from pipeoffload.training.trainer import train

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
        print_result(result, config, report, out)
    return result


def _fail_rank(error: BaseException, topology: Topology | None) -> NoReturn:
    """A rank of a job failed: say so and leave at once (a failed rank must not hang in
    teardown waiting for its peers), with the status that says what kind of failure."""
    from pipeoffload.cli.progress import say

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
