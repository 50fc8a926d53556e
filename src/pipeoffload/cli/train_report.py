"""What `pipeoffload train`'s reporting process prints and writes at the end of a run: the
peak-activation table (or one --json line), the checkpoint and export it made, the picture."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from pipeoffload.cli import preflight
from pipeoffload.core.actions import Kind
from pipeoffload.errors import READER_WAIT_S
from pipeoffload.training.signals import signal_name

if TYPE_CHECKING:
    from pipeoffload.training.results import TrainResult
    from pipeoffload.training.train import TrainConfig


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
    fifo_wait_s: float = READER_WAIT_S  # how long a FIFO ``png`` waits for its reader


def format_bytes(n: float | None) -> str:
    """``n`` bytes as B, KiB, MiB or GiB (``-`` for None)."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def print_result(result: TrainResult, config: TrainConfig, report: ReportOptions,
                 out: IO[str]) -> None:
    """The reporting process's last words: the table (or the --json line), where the
    checkpoint and export are, and the schedule picture."""
    if report.json:
        png = write_png(result, report.png, report.fifo_wait_s)
        print(json.dumps(summary(result, config, png), sort_keys=True), flush=True)
        return
    print(render_table(result), file=out)
    if result.checkpoint:
        print(f"checkpoint: {result.checkpoint}", file=out)
    if result.export:
        print(f"Hugging Face export: {result.export} (transformers.AutoModelForCausalLM."
              "from_pretrained loads it)", file=out)
    out.flush()
    png = write_png(result, report.png, report.fifo_wait_s)
    if png:
        print(f"schedule PNG: {png}", file=out, flush=True)


def write_png(result: TrainResult, path: str | None,
              fifo_wait_s: float = READER_WAIT_S) -> str | None:
    """Draw the run's schedule (simulated with the measured sizes) to ``path``, if any."""
    if path is None:
        return None
    if not preflight.have_matplotlib():  # checked up front too; a worker may differ
        preflight.note("train", preflight.MATPLOTLIB_MISSING.format(what=path))
        return None
    from pipeoffload.sim.render_png import render_png

    simulation = result.simulation or result.plan.result
    with preflight.writing_output("train", "--png", path, fifo_wait_s):
        return str(render_png(simulation, path, compare=result.baseline_simulation))


def render_table(result: TrainResult) -> str:
    """Peak activation per pipeline rank: measured and predicted, with and without offload."""
    schedule = result.plan.schedule
    rows: list[tuple[str, ...]] = [
        ("rank", "stages", "measured", "predicted", "no offload: measured", "predicted")]
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
    return "\n".join([head, "peak activation per pipeline rank", *lines, notes,
                      *state_lines(result)])


def state_lines(result: TrainResult) -> list[str]:
    """Model state per process: measured from the tensors, and the planner's prediction."""
    rows: list[tuple[str, ...]] = [("process", "parameters", "gradients", "fp32 masters",
                                    "moments", "optimizer state", "planner")]
    for r in result.model_state:
        rows.append((str(r["rank"]), *(format_bytes(r[k]) for k in (
            "parameters", "gradients", "masters", "moments", "optimizer_state",
            "predicted_optimizer_state"))))
    if len(rows) == 1:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["model state per process (measured; planner: its masters + moments)",
            *("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)]


def summary(result: TrainResult, config: TrainConfig, png: str | None) -> dict[str, Any]:
    """The --json object."""
    schedule = result.plan.schedule
    ma_bytes = None
    if result.stage_bytes is not None:
        ma_bytes = [sum(result.stage_bytes[s] for s in schedule.stages_on_rank(r))
                    for r in range(schedule.num_ranks)]
    as_list = (lambda v: None if v is None else list(v))  # noqa: E731
    return {
        "schedule": schedule.name, "pp": config.pp, "dp": config.dp, "tp": config.tp,
        "cp": config.cp, "dtype": config.dtype, "recompute": config.recompute,
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
        "export": result.export, "model": config.hf_model or "reference", "zero": config.zero_level,
        "optimizer_state_bytes": [r["optimizer_state"] for r in result.model_state],
        "predicted_optimizer_state_bytes":
            [r["predicted_optimizer_state"] for r in result.model_state],
        "model_state_bytes": list(result.model_state),
    }

