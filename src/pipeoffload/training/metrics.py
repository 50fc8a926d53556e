"""Per-step metrics of a training run: model FLOPs and MFU from the planner's count, a JSON-lines
file, and TensorBoard scalars through the optional ``tensorboard`` extra.

MFU (model FLOPs utilisation, PaLM's definition) = model FLOPs of a step / (step time x
processes x peak FLOP/s of one device). The FLOPs are the planner's ``FlopCount.MODEL`` count
(planner/transformer.py: every linear layer's forward and two backward matmuls, the full s x s
attention core, the head; no recompute, no flash re-run), so recompute shows as lower MFU, as
in Megatron and torchtitan. The peak is the caller's (``--peak-tflops``) or, for bf16 on a GPU
with a hardware preset (planner/hardware.py), the preset's datasheet dense 16-bit rate;
elsewhere MFU is not reported (None) and the achieved model FLOP/s is.
"""

from __future__ import annotations

import codecs
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pipeoffload.errors import ConfigError, writing
from pipeoffload.planner.hardware import device_preset
from pipeoffload.planner.presets import load_model
from pipeoffload.planner.transformer import (
    FlopCount,
    MlpKind,
    TransformerSpec,
    head_flops,
    layer_flops,
)

# A record is about 300 bytes: 10^6 steps of records, far more than a run writes.
MAX_METRICS_BYTES = 1 << 30


def model_flops_per_step(model: Any, seq_len: int, batch_size: int) -> float:
    """Model FLOPs of one optimizer step: ``batch_size`` sequences of ``seq_len`` through
    ``model`` (a training.model.ModelConfig), forward and backward."""
    spec = TransformerSpec(num_layers=model.n_layers, hidden=model.dim, heads=model.n_heads,
                           kv_heads=model.n_kv_heads, ffn_hidden=model.ffn_hidden,
                           vocab=model.vocab_size, seq_len=seq_len, mlp=MlpKind.SWIGLU)
    return spec_flops_per_step(spec, batch_size)


def hf_model_flops_per_step(path: str, seq_len: int, batch_size: int) -> float:
    """The same for a Hugging Face model (`train --model PATH`), read as `plan --model PATH`
    reads it."""
    return spec_flops_per_step(load_model(path, seq_len=seq_len), batch_size)


def spec_flops_per_step(spec: TransformerSpec, batch_size: int) -> float:
    per_sequence = (spec.num_layers * layer_flops(spec, 1, count=FlopCount.MODEL).total
                    + head_flops(spec, 1).total)
    return per_sequence * batch_size


def datasheet_peak_flops(device_name: str, dtype: str) -> float | None:
    """The datasheet dense bf16 peak of a GPU with a hardware preset, for a bf16 run; else
    None."""
    preset = device_preset(device_name) if dtype == "bf16" else None
    if preset is None or not preset.peak_flops_per_s:
        return None
    return preset.peak_flops_per_s


@dataclass(frozen=True)
class MetricsConfig:
    """Where metrics go (None: nowhere) and what MFU is measured against.

    ``peak_flops_per_s`` is one device's; ``processes`` how many devices run the step.
    """

    jsonl: str | None = None
    tensorboard: str | None = None
    flops_per_step: float = 0.0
    processes: int = 1
    peak_flops_per_s: float | None = None


def step_record(log: Any, config: MetricsConfig) -> dict[str, Any]:
    """One JSON line for a train.StepLog."""
    flops_per_s = config.flops_per_step / log.step_time_s if log.step_time_s > 0 else 0.0
    mfu = (flops_per_s / (config.processes * config.peak_flops_per_s)
           if config.peak_flops_per_s else None)
    return {
        "step": log.step, "loss": log.loss, "lr": log.lr, "grad_norm": log.grad_norm,
        "tokens_per_s": log.tokens_per_s, "step_time_s": log.step_time_s,
        "model_flops_per_s": flops_per_s, "mfu": mfu,
        "peak_activation_bytes": list(log.peak_bytes),
        "host_pool_bytes": list(log.host_pool_bytes),
        "elapsed_s": log.elapsed_s, "time": time.time(),
    }


class MetricsWriter:
    """Writes step records to ``config.jsonl`` (flushed per line) and to TensorBoard.

    A run that resumed at step N (``start_step``) appends to an existing file after dropping
    its lines of steps after N (written before a crash and trained again now); a fresh run
    starts the file anew.
    """

    def __init__(self, config: MetricsConfig, start_step: int,
                 tensorboard_writer: Any = None) -> None:
        self.config = config
        self._file: IO[str] | None = None
        if config.jsonl is not None:
            path = Path(config.jsonl)
            if start_step > 0 and path.is_file():
                _truncate_after(path, start_step)
                self._file = path.open("a", encoding="utf-8")
            else:
                self._file = path.open("w", encoding="utf-8")
        self._tensorboard = tensorboard_writer
        self.board_failed: str | None = None

    def write(self, log: Any) -> dict[str, Any]:
        record = step_record(log, self.config)
        if self._file is not None:
            with writing(self._file.name):
                self._file.write(json.dumps(record, sort_keys=True) + "\n")
                self._file.flush()
        self._board(lambda board: _board_step(board, record, log))
        return record

    def write_eval(self, step: int, loss: float) -> None:
        """A held-out loss after ``step`` steps: its own line, ``{"step", "eval_loss"}``."""
        if self._file is not None:
            with writing(self._file.name):
                self._file.write(json.dumps({"eval_loss": loss, "step": step}) + "\n")
                self._file.flush()
        self._board(lambda board: (board.add_scalar("eval/loss", loss, step), board.flush()))

    def _board(self, write: Callable[[Any], object]) -> None:
        """Write to TensorBoard; if that fails (a full disk), stop writing there and keep the
        reason in ``board_failed``: the run goes on, its checkpoints and --metrics unaffected."""
        if self._tensorboard is None:
            return
        try:
            write(self._tensorboard)
        except OSError as error:
            self._tensorboard = None
            self.board_failed = f"{self.config.tensorboard}: {error.strerror or error}"

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._board(lambda board: board.close())
        self._tensorboard = None


def _board_step(board: Any, record: dict[str, Any], log: Any) -> None:
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "model_flops_per_s",
                "mfu"):
        if record[key] is not None:
            board.add_scalar(f"train/{key}", record[key], log.step)
    for rank, nbytes in enumerate(log.peak_bytes):
        board.add_scalar(f"peak_activation_bytes/rank{rank}", nbytes, log.step)
    for rank, nbytes in enumerate(log.host_pool_bytes):
        board.add_scalar(f"host_pool_bytes/rank{rank}", nbytes, log.step)
    board.flush()


def check_metrics_file(path: str) -> None:
    """What a resumed run will read of an existing ``--metrics`` file (its records up to the
    step resumed), checked before the run starts instead of at its first step: it must be a
    regular UTF-8 text file of at most MAX_METRICS_BYTES."""
    file = Path(path)
    if not file.exists():
        return
    if not file.is_file():
        raise ConfigError(f"--metrics {path}: not a regular file; name a file")
    size = file.stat().st_size
    if size > MAX_METRICS_BYTES:
        raise ConfigError(f"--metrics {path}: {size} bytes, more than a resumed run reads back "
                          f"({MAX_METRICS_BYTES}); move it away or name another file")
    decoder, read = codecs.getincrementaldecoder("utf-8")(), 0
    try:
        with file.open("rb") as f:
            while chunk := f.read(1 << 20):
                decoder.decode(chunk)
                read += len(chunk)
            decoder.decode(b"", final=True)
    except UnicodeDecodeError as error:
        raise ConfigError(f"--metrics {path}: not UTF-8 text (near byte {read + error.start}: "
                          f"{error.reason}), so a resumed run cannot keep its records; move it "
                          "away or name another file") from None


def _truncate_after(path: Path, step: int) -> None:
    """Keep the lines of ``path`` up to ``step`` (and any line that is not a record)."""
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        try:
            record_step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            record_step = None
        if not isinstance(record_step, int) or record_step <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path.with_name(f".{path.name}.tmp")
    with writing(path):
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, path)


def tensorboard_writer(log_dir: str) -> Any:
    """A torch.utils.tensorboard SummaryWriter, or None when the ``tensorboard`` extra is not
    installed (the caller says so in a note)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    if not getattr(threading.excepthook, "quiet_event_writers", False):
        threading.excepthook = _quiet_event_writers(threading.excepthook)
    return SummaryWriter(log_dir=log_dir)


def _quiet_event_writers(previous: Callable[[Any], object]) -> Callable[[Any], None]:
    """A threading.excepthook that leaves out TensorBoard's event-writer thread: its failure (a
    full disk) is raised again in the thread that writes next, where MetricsWriter says it in
    one line; the thread's own traceback would only repeat it."""
    def hook(args: Any) -> None:
        if type(args.thread).__name__ != "_AsyncWriterThread":
            previous(args)

    hook.quiet_event_writers = True  # type: ignore[attr-defined]  # marks it installed
    return hook
