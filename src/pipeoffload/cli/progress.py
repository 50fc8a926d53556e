"""What `pipeoffload train`'s reporting process says during a run: a progress line every
``--log-every`` steps (loss, lr, tokens/s, MFU or model FLOP/s, elapsed time, ETA, activation
peaks), the ``--metrics`` / ``--tensorboard`` records of the same steps, and the line that says
where a stopped run's checkpoint is."""

from __future__ import annotations

import sys
from typing import IO, TYPE_CHECKING

from pipeoffload.cli import preflight
from pipeoffload.cli.train_report import ReportOptions, format_bytes
from pipeoffload.parallel.topology import Topology
from pipeoffload.training.metrics import (
    MetricsConfig,
    MetricsWriter,
    datasheet_peak_flops,
    hf_model_flops_per_step,
    model_flops_per_step,
    step_record,
    tensorboard_writer,
)
from pipeoffload.training.signals import signal_name, stop_status

if TYPE_CHECKING:
    from pipeoffload.training.results import StepLog, TrainResult
    from pipeoffload.training.train import TrainConfig

TENSORBOARD_MISSING = ("the tensorboard extra is not installed, so no TensorBoard events are "
                       "written to {what}; pip install 'pipeoffload[tensorboard]' to get them")


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (days as more hours)."""
    total = max(0, round(seconds))
    return f"{total // 3600}:{total // 60 % 60:02d}:{total % 60:02d}"


def metrics_config(config: TrainConfig, report: ReportOptions, topology: Topology
                   ) -> MetricsConfig:
    """FLOPs per step, devices and the peak MFU is measured against, for this run."""
    processes = config.processes if topology.distributed else 1
    peak = report.peak_flops_per_s
    if peak is None and topology.device is not None and topology.device.type == "cuda":
        import torch

        peak = datasheet_peak_flops(torch.cuda.get_device_name(topology.device), config.dtype)
    seq, batch = config.data.seq_len, config.data.batch_size
    flops = (model_flops_per_step(config.model, seq, batch) if config.hf_model is None
             else hf_model_flops_per_step(config.hf_model, seq, batch))
    return MetricsConfig(jsonl=report.metrics, tensorboard=report.tensorboard,
                         flops_per_step=flops,
                         processes=processes, peak_flops_per_s=peak)


class Reporter:
    """The ``on_step`` callback of the reporting process (train calls it on no other)."""

    def __init__(self, config: TrainConfig, report: ReportOptions, topology: Topology,
                 out: IO[str]) -> None:
        self.report = report
        self.out = out
        self.metrics = metrics_config(config, report, topology)
        self._held_out = (f"{config.eval_batches} batches at most of the "
                          f"{config.data.eval_fraction:g} of the data held out")
        self._writer: MetricsWriter | None = None
        self._board_noted = False

    def _open(self, start_step: int) -> MetricsWriter | None:
        """The metrics writer, made at the run's first record (a resumed run's start step
        decides what of an existing file is kept)."""
        if self._writer is None and (self.metrics.jsonl or self.metrics.tensorboard):
            board = None
            if self.metrics.tensorboard:
                board = tensorboard_writer(self.metrics.tensorboard)
                if board is None:
                    preflight.note("train", TENSORBOARD_MISSING.format(
                        what=self.metrics.tensorboard))
            self._writer = MetricsWriter(self.metrics, start_step, board)
        return self._writer

    def __call__(self, log: StepLog) -> None:
        writer = self._open(log.start_step)
        if writer is not None:
            writer.write(log)
            self._board_note(writer)
        if log.step % self.report.log_every and log.step not in (log.start_step + 1, log.steps):
            return
        try:
            print(progress_line(log, self.metrics), file=self.out, flush=True)
        except BrokenPipeError:  # the reader is gone (its launcher died): keep training
            pass

    def held_out(self, step: int, loss: float) -> None:
        """The ``on_eval`` callback: the held-out loss after ``step`` steps."""
        writer = self._open(step)  # before any step: the run's first record, at its start
        if writer is not None:
            writer.write_eval(step, loss)
            self._board_note(writer)
        say(f"held-out loss at step {step}: {loss:.4f} ({self._held_out})", self.out)

    def _board_note(self, writer: MetricsWriter) -> None:
        """Say once that TensorBoard events stopped (a full disk), and why."""
        if writer.board_failed is not None and not self._board_noted:
            self._board_noted = True
            preflight.note("train", f"--tensorboard {writer.board_failed}; no more TensorBoard "
                           "events are written (the run goes on; checkpoints and --metrics are "
                           "not affected)")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._board_note(self._writer)


def progress_line(log: StepLog, metrics: MetricsConfig) -> str:
    """The line a step prints (every --log-every steps, the first and the last)."""
    record = step_record(log, metrics)
    if record["mfu"] is not None:
        rate = f"MFU {100 * record['mfu']:.1f}%"
    else:
        rate = _flops(record["model_flops_per_s"])
    done = log.step - log.start_step
    eta = log.elapsed_s / done * (log.steps - log.step) if done > 0 else 0.0
    peaks = " ".join(f"r{r}={format_bytes(b)}" for r, b in enumerate(log.peak_bytes))
    width = len(str(log.steps))
    return (f"step {log.step:>{width}}/{log.steps}  loss {log.loss:.4f}  lr {log.lr:.2e}  "
            f"{log.tokens_per_s:,.0f} tok/s  {rate}  elapsed {format_duration(log.elapsed_s)}  "
            f"ETA {format_duration(eta)}  activation peak {peaks}")


def _flops(per_s: float) -> str:
    for unit, scale in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if per_s >= scale:
            return f"{per_s / scale:.3g} {unit}"
    return f"{per_s / 1e6:.3g} MFLOP/s"


def stop_message(result: TrainResult, config: TrainConfig) -> str:
    """Where a stopped run is: its step, its checkpoint, how to continue; and its status."""
    name = signal_name(result.stopped_by)
    why = f" ({result.stop_reason})" if result.stop_reason else ""
    trained = (f"after step {result.end_step} of {config.steps}"
               if result.end_step > result.start_step
               else f"before its first step (at step {result.start_step})")
    if result.checkpoint:
        where = (f"checkpoint {result.checkpoint}; continue with --resume auto "
                 f"--checkpoint-dir {config.checkpoint_dir}")
    elif config.checkpoint_dir:
        where = f"nothing new to save; the checkpoints in {config.checkpoint_dir} are as they were"
    else:
        where = "no checkpoint (no --checkpoint-dir), so what this run trained is lost"
    return (f"pipeoffload train: stopped by {name}{why} {trained}; {where}; exit status "
            f"{stop_status(result.stopped_by)}")


def say(text: str, out: IO[str] = sys.stderr) -> None:
    """Print, but not fail when the reader is gone (after the launcher died)."""
    try:
        print(text, file=out, flush=True)
    except (OSError, ValueError):  # a closed pipe, or no terminal any more
        pass
