"""What a training run reports, without torch: a line per step (``StepLog``) and the run's
outcome (``TrainResult``), which the command line prints."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeoffload.offload.plan import OffloadPlan
from pipeoffload.sim.simulator import SimResult


@dataclass(frozen=True)
class StepLog:
    """What the progress line shows after one step (on the reporting process)."""

    step: int
    steps: int
    loss: float
    lr: float
    tokens_per_s: float
    peak_bytes: tuple[int, ...]
    grad_norm: float | None = None  # before clipping, over the whole model
    step_time_s: float = 0.0
    host_pool_bytes: tuple[int, ...] = ()  # per pipeline rank of replica 0 (local: one)
    start_step: int = 0  # where this run started (resumed runs: the checkpoint's step)
    elapsed_s: float = 0.0  # since this run's first step began


@dataclass(frozen=True)
class TrainResult:
    """One run's outcome, the same on every process (gathered).

    Peaks are per pipeline rank of replica 0, in bytes, the maximum over the run's steps.
    ``predicted_bytes`` is the simulator's peak for the schedule with per-stage activation
    sizes measured on the first step; ``baseline_*`` are the same without offload (measured on
    an extra step, and simulated), None when the schedule does not offload.
    """

    plan: OffloadPlan
    start_step: int
    end_step: int
    losses: tuple[float, ...]
    tokens_per_s: float
    peak_bytes: tuple[int, ...]
    stage_bytes: tuple[int, ...] | None
    simulation: SimResult | None
    baseline_simulation: SimResult | None
    baseline_bytes: tuple[int, ...] | None
    checkpoint: str | None
    reporter: bool
    stopped_by: int = 0  # the signal every rank agreed to stop on (0: ran to the end)
    stop_reason: str = ""
    eval_losses: tuple[tuple[int, float], ...] = ()  # (steps done, held-out loss)
    export: str | None = None
    model_state: tuple[dict[str, Any], ...] = ()  # per global rank (training/model_state.py)

    @property
    def predicted_bytes(self) -> tuple[float, ...] | None:
        return None if self.simulation is None else self.simulation.peak_bytes

    @property
    def baseline_predicted_bytes(self) -> tuple[float, ...] | None:
        sim = self.baseline_simulation
        return None if sim is None else sim.peak_bytes
