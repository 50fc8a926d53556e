"""The training loop of `pipeoffload train`: the reference transformer (or a Hugging Face
model), cut into the stages of a (planned) schedule, trained with AdamW on text, PP x DP x TP
x CP over torch.distributed (tensor parallelism inside each stage with torch DTensor,
training/tensor_parallel.py; context parallelism over each sequence, parallel/context.py),
in fp32, fp64 or bf16 with float32 master weights (parallel/precision.py Note: [mixed
precision]), with recompute none, lgd or full inside each layer (training/model.py,
training/layer_recompute.py).

Processes and groups: parallel/topology.py Note: [rank layout]. Without torch.distributed
(``Topology.local``) one process runs every pipeline rank (Pipeline's local mode); that is the
single-process reference for the distributed runs.

``Trainer`` is one run in parts: ``build`` (plan, stages, optimizer, data, pipeline),
``resume``, ``step``, ``evaluate``, ``save`` and ``finish`` (simulation, the peaks without
offload, the export); ``run`` (and ``train``) calls them in order. The optimizer is a
parallel/optimizer.py PipelineOptimizer, the only thing the loop asks of it.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import torch
from torch import nn

from pipeoffload.core.actions import OFFLOAD_KINDS, Kind
from pipeoffload.core.classes import ClassChoice, TensorClass
from pipeoffload.core.schedule import Schedule
from pipeoffload.errors import ConfigError
from pipeoffload.offload.plan import OffloadPlan
from pipeoffload.parallel import checkpoint as ckpt
from pipeoffload.parallel.checkpoint_files import check_root, resolve_resume
from pipeoffload.parallel.checkpoint_lock import FolderLock
from pipeoffload.parallel.context import apply_context_parallel
from pipeoffload.parallel.fsdp import ShardedAdamW, shard_stages
from pipeoffload.parallel.optimizer import PipelineOptimizer, StageAdamW
from pipeoffload.parallel.precision import torch_dtype
from pipeoffload.parallel.topology import Topology
from pipeoffload.parallel.zero import ZeroAdamW
from pipeoffload.runtime.config import OffloadConfig, RuntimeConfig
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.pipeline import Pipeline
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.simulator import SimResult, simulate
from pipeoffload.training.data import TextDataset
from pipeoffload.training.gather import (
    StepGather,
    agree_on_start,
    gather_step,
    peer_failures,
    stage_moved_shares,
    stage_sizes,
)
from pipeoffload.training.hf_model import HFStages, resolve_model
from pipeoffload.training.hf_run import build_hf, export_run
from pipeoffload.training.host_reserve import reserve_host_memory
from pipeoffload.training.measure import measure_without_offload
from pipeoffload.training.model import Transformer, set_layer_recompute
from pipeoffload.training.model_state import gradient_bytes, model_state
from pipeoffload.training.results import StepLog, TrainResult
from pipeoffload.training.signals import StopRequest, signal_name
from pipeoffload.training.split import build_stage_modules, lm_loss
from pipeoffload.training.tensor_parallel import apply_tensor_parallel
from pipeoffload.training.train import TrainConfig, build_plan
from pipeoffload.training.validation import eval_steps, held_out


@dataclass(frozen=True)
class Hooks:
    """What a run tells its caller and takes from it: ``on_step`` and ``on_eval`` (steps done,
    held-out loss) are called on the reporting process; ``stop`` (training/signals.py) is read
    after every step; ``checkpoint_files`` are extra files saved into every checkpoint."""

    on_step: Callable[[StepLog], None] | None = None
    on_eval: Callable[[int, float], None] | None = None
    stop: StopRequest | None = None
    checkpoint_files: Mapping[str, bytes] | None = None

    @property
    def stop_signum(self) -> int:
        return self.stop.signum if self.stop is not None else 0


class StepDone(NamedTuple):
    """One optimizer step, as every process learned it."""

    gathered: StepGather
    grad_norm: float | None
    lr: float
    elapsed_s: float


@dataclass
class _Record:
    """What the steps of this run have added up to so far."""

    start: int
    peaks: list[int]
    began_s: float = field(default_factory=time.perf_counter)
    losses: list[float] = field(default_factory=list)
    stage_bytes: tuple[int, ...] | None = None
    # per stage, with class choices: (moved, recomputed) shares (measured)
    moved_shares: dict[int, tuple[float, float]] | None = None
    busy_s: float = 0.0
    saved: str | None = None
    eval_losses: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Trainer:
    """One training run in this process (every process runs its own, in step)."""

    config: TrainConfig
    topology: Topology
    hooks: Hooks
    plan: OffloadPlan
    hf: HFStages | None
    stages: dict[int, nn.Module]
    optimizer: PipelineOptimizer
    dataset: TextDataset
    runtime: RuntimeConfig
    meter: ActivationMeter
    pipe: Pipeline
    identity: dict[str, Any]
    lock: FolderLock | None = None  # global rank 0's, on the checkpoint folder, while it runs
    grad_bytes: int = 0  # the largest gradients a step's backward left (model_state.py)

    @classmethod
    def build(cls, config: TrainConfig, topology: Topology, hooks: Hooks | None = None
              ) -> Trainer:
        """Plan the schedule; make this process's stages, optimizer, data and pipeline."""
        if topology.tp != config.tp:
            raise ConfigError(f"--tp {config.tp} runs one process per tensor-parallel rank, but "
                              f"this topology has tp={topology.tp}; start pp*dp*tp processes "
                              "(drop --inline)")
        if topology.cp != config.cp:
            raise ConfigError(f"--cp {config.cp} runs one process per context-parallel rank, but "
                              f"this topology has cp={topology.cp}; start pp*dp*tp*cp processes")
        plan = build_plan(config)
        schedule = plan.schedule
        mine = topology.stages_of(schedule)
        hf = build_hf(config, schedule.num_stages, mine, topology) if config.hf_model else None
        stages = hf.stages if hf is not None else build_stages(config, schedule.num_stages,
                                                               mine, topology)
        if config.zero_level == 3:
            stages = shard_stages(stages, topology, mixed=config.dtype == "bf16")
        context = topology.sequence_split()
        apply_context_parallel(stages, context)
        optimizer = make_optimizer(config, stages, topology)
        dataset = TextDataset.from_config(config.data, dp_rank=topology.dp_index,
                                          dp_size=topology.dp)
        runtime = RuntimeConfig(p2p_timeout_s=config.p2p_timeout_s, offload=OffloadConfig(
            min_offload_elements=config.min_offload_elements))
        meter = ActivationMeter()
        pipe = Pipeline(stages, schedule, lm_loss, group=topology.pp_group, config=runtime,
                        device=topology.device, meter=meter,
                        channel_groups=topology.channel_groups, context=context)
        _reserve_host_memory(config, topology, pipe, stages, hf)
        return cls(config, topology, hooks or Hooks(), plan, hf, stages, optimizer, dataset,
                   runtime, meter, pipe, checkpoint_identity(config, schedule))

    @property
    def schedule(self) -> Schedule:
        return self.plan.schedule

    @property
    def last_rank(self) -> int:
        """The pipeline rank of the last stage (where the loss is)."""
        return self.schedule.rank_of(self.schedule.num_stages - 1)

    @property
    def reporter(self) -> bool:
        """Whether this process reports: the last stage's rank of replica 0."""
        topology = self.topology
        return not topology.distributed or topology.rank == topology.global_rank(
            self.last_rank, 0)

    def run(self) -> TrainResult:
        """Resume (or start), train up to ``config.steps`` with held-out losses and
        checkpoints on the way, then finish; stops early after a step when ``hooks.stop`` is
        set on any process. Global rank 0 holds the checkpoint folder's lock meanwhile."""
        try:
            return self._run()
        finally:
            if self.lock is not None:
                self.lock.release()
                self.lock = None

    def _run(self) -> TrainResult:
        steps = self.config.steps
        start, stopped = self.resume()
        record = _Record(start, [0] * self.config.pp)
        evals = eval_steps(start, steps, self.config.eval_every,
                           self.dataset.num_eval_batches > 0)
        if start in evals and start < steps and not stopped:
            self._add_eval(record, start)
        for step in range(start if not stopped else steps, steps):
            stopped = self._add_step(record, step, self.step(step))
            done = step + 1
            if done in evals:
                self._add_eval(record, done)
            if self._save_due(done, stopped):
                record.saved = self.save(done)
            if stopped and done < steps:
                break
            stopped = 0  # a request during the last step: the run is complete anyway
        return self.finish(record, stopped)

    def resume(self) -> tuple[int, int]:
        """Load the checkpoint ``config.resume`` names (none: a fresh start with a new run id),
        then agree with every process on the start step and run id. Returns the start step
        and the largest stop request so far (0: none)."""
        config = self.config
        if config.checkpoint_dir is not None:
            check_root(config.checkpoint_dir)
            if self.topology.rank == 0:
                self.lock = FolderLock.acquire(config.checkpoint_dir)
        resume = resolve_resume(config.resume, config.checkpoint_dir)
        run = f"{random.SystemRandom().getrandbits(48):012x}"  # a fresh start's id (not seeded)
        if resume is not None:
            resumed = ckpt.restore(self._state(), resume, config.checkpoint_dir, self.identity,
                                   self.topology)
            ckpt.check_resume_step(resumed, resume, config.steps)
            run = ckpt.run_id(ckpt.read_manifest(
                ckpt.find_checkpoint(resume, config.checkpoint_dir), verify_files=False))
        elif config.checkpoint_dir is not None and ckpt.complete_checkpoints(
                config.checkpoint_dir):
            raise ConfigError(f"--checkpoint-dir {config.checkpoint_dir} already holds "
                              "checkpoints; pass --resume to continue from them (--resume auto "
                              "does so when there are some), or use an empty folder")
        start = self.dataset.step
        with self._peer_failures("agreeing on the start"):
            self.identity["run"], stopped = agree_on_start(self.topology, start, run,
                                                           self.hooks.stop_signum)
        return start, stopped

    def step(self, step: int) -> StepDone:
        """Optimizer step ``step`` (0-based) on the next batch, with every process."""
        began = time.perf_counter()
        inputs, target = next(self.dataset)
        lr = self.config.lr_at(step)
        self.meter.reset()
        with self._peer_failures(f"step {step + 1}"):
            loss = self.pipe.step(inputs, target=target)
            grad_norm = self._update(lr)
            gathered = gather_step(self.topology, loss, self.meter, self.last_rank,
                                   pool_bytes=self.pipe.stats().host_pool_bytes,
                                   stop_signum=self.hooks.stop_signum)
        return StepDone(gathered, grad_norm, lr, time.perf_counter() - began)

    def _update(self, lr: float) -> float | None:
        """The optimizer's step on the gradients, averaged over replicas and clipped; returns
        the norm before clipping (None without clipping)."""
        optimizer = self.optimizer
        self.grad_bytes = max(self.grad_bytes, gradient_bytes(self.stages))
        optimizer.take_grads()
        optimizer.reduce_grads()
        grad_norm = None
        if self.config.grad_clip is not None:
            grad_norm = optimizer.clip_grads(self.config.grad_clip)
        optimizer.set_lr(lr)
        optimizer.step()
        optimizer.zero_grad()
        return grad_norm

    def evaluate(self, done: int) -> float:
        """The held-out loss after ``done`` steps (every process takes part)."""
        with self._peer_failures(f"the held-out loss at step {done}"):
            return held_out(self.pipe, self.stages, self.dataset, self.topology,
                            self.config.eval_batches, self.last_rank)

    def save(self, done: int) -> str:
        """Write the checkpoint of step ``done`` (a collective); returns its folder."""
        config = self.config
        assert config.checkpoint_dir is not None
        with self._peer_failures(f"saving the checkpoint of step {done}"):
            return str(ckpt.save(self._state(), config.checkpoint_dir, done, self.identity,
                                 self.topology, extra_files=self.hooks.checkpoint_files,
                                 keep_last=config.keep_last))

    def finish(self, record: _Record, stopped: int) -> TrainResult:
        """The run's result: after a complete run also its simulation with the measured
        activation sizes, the peaks without offload, and the export."""
        simulation = baseline_sim = baseline = None
        if record.stage_bytes is not None and not stopped:  # stopping: no extra work
            simulation, baseline_sim, baseline = self._simulate(record.stage_bytes,
                                                                record.moved_shares)
        exported = None
        if self.config.export_hf is not None and self.hf is not None and not stopped:
            with self._peer_failures(f"exporting to {self.config.export_hf}"):
                exported = str(export_run(self.config, self.hf,
                                          self.optimizer.master_weights(), self.topology))
        with self._peer_failures("measuring the model state"):
            state = model_state(self.stages, self.optimizer, self.grad_bytes, self.topology,
                                zero=self.config.zero_level, dtype=self.config.dtype)
        tokens = self.config.data.batch_size * self.config.data.seq_len
        return TrainResult(
            self.plan, record.start, record.start + len(record.losses), tuple(record.losses),
            tokens * len(record.losses) / record.busy_s if record.busy_s else 0.0,
            tuple(record.peaks), record.stage_bytes, simulation, baseline_sim, baseline,
            record.saved, self.reporter, stopped, self._stop_reason(stopped),
            eval_losses=tuple(record.eval_losses), export=exported, model_state=state)

    def _state(self) -> ckpt.TrainingState:
        return ckpt.TrainingState(self.stages, self.optimizer, self.dataset)

    def _add_step(self, record: _Record, step: int, done: StepDone) -> int:
        """Count step ``step`` into ``record`` and report it; returns its stop request."""
        gathered, elapsed = done.gathered, done.elapsed_s
        record.busy_s += elapsed
        if record.stage_bytes is None:
            with self._peer_failures("gathering activation sizes"):
                record.stage_bytes = stage_sizes(self.topology, self.meter,
                                                 self.schedule.num_stages)
                record.moved_shares = stage_moved_shares(self.topology, self.pipe.offloader,
                                                         self.schedule)
        record.losses.append(gathered.loss)
        record.peaks = [max(a, b) for a, b in zip(record.peaks, gathered.peak_bytes)]
        if self.hooks.on_step is not None and self.reporter:
            tokens = self.config.data.batch_size * self.config.data.seq_len
            self.hooks.on_step(StepLog(
                step + 1, self.config.steps, gathered.loss, done.lr, tokens / elapsed,
                tuple(gathered.peak_bytes), done.grad_norm, elapsed, gathered.pool_bytes,
                record.start, time.perf_counter() - record.began_s))
        return gathered.stop_signum

    def _add_eval(self, record: _Record, done: int) -> None:
        loss = self.evaluate(done)
        record.eval_losses.append((done, loss))
        if self.hooks.on_eval is not None and self.reporter:
            self.hooks.on_eval(done, loss)

    def _save_due(self, done: int, stopped: int) -> bool:
        config = self.config
        return config.checkpoint_dir is not None and bool(
            done == config.steps or stopped
            or (config.checkpoint_every and done % config.checkpoint_every == 0))

    def _simulate(self, stage_bytes: tuple[int, ...],
                  moved: dict[int, tuple[float, float]] | None = None
                  ) -> tuple[SimResult, SimResult | None, tuple[int, ...] | None]:
        """The schedule simulated with the measured per-stage sizes (and, with class choices,
        the measured shares of them each moves and recomputes, the recompute timed as
        planned); with offload also without it, simulated and (``measure_baseline``) measured
        on one extra step."""
        schedule = self.schedule
        if moved is not None:
            schedule = schedule.with_classes({
                (stage, mb): ClassChoice(
                    (TensorClass("moved (measured)", moved[stage][0]),),
                    (TensorClass("recomputed (measured)", moved[stage][1],
                                 choice.recompute_time),) if choice.recomputed else ())
                for (stage, mb), choice in schedule.classes if stage in moved})
        costs = CostModel(stage_activation_bytes=stage_bytes)
        simulation = simulate(schedule, costs)
        if not schedule.has_kind(Kind.OFFLOAD):
            return simulation, None, None
        bare = dataclasses.replace(schedule.without(*OFFLOAD_KINDS),
                                   name=f"{schedule.name} without offload")
        baseline = None
        if self.config.measure_baseline:
            with self._peer_failures("the step without offload"):
                baseline = measure_without_offload(self.pipe, self.stages, self.dataset,
                                                   self.topology, self.runtime, self.last_rank)
                self.optimizer.zero_grad()  # what that backward started (ZeRO-1's buckets)
        return simulation, simulate(bare, costs), baseline

    def _stop_reason(self, stopped: int) -> str:
        if not stopped:
            return ""
        stop = self.hooks.stop
        if stop is not None and stop.signum == stopped:
            return stop.reason
        return f"another rank received {signal_name(stopped)}"

    def _peer_failures(self, what: str) -> AbstractContextManager[None]:
        return peer_failures(self.topology, what)


def train(config: TrainConfig, topology: Topology,
          on_step: Callable[[StepLog], None] | None = None,
          on_eval: Callable[[int, float], None] | None = None, *,
          stop: StopRequest | None = None,
          checkpoint_files: Mapping[str, bytes] | None = None) -> TrainResult:
    """Train from step 0 (or the checkpoint ``config.resume`` names) up to ``config.steps``;
    ``on_step`` and ``on_eval`` (steps done, held-out loss) are called on the reporting
    process.

    ``stop`` (training/signals.py): checked after every step; once any rank's is set, every
    rank finishes that step, saves a checkpoint when ``checkpoint_dir`` is set and returns
    with ``stopped_by`` (Note: [stopping on a signal]). ``checkpoint_files``: extra files
    saved into every checkpoint (e.g. the command line's effective settings).
    """
    hooks = Hooks(on_step, on_eval, stop, checkpoint_files)
    return Trainer.build(config, topology, hooks).run()


def make_optimizer(config: TrainConfig, stages: Mapping[int, nn.Module],
                   topology: Topology) -> PipelineOptimizer:
    """The run's optimizer: AdamW per stage over master weights (float32 ones for bf16),
    whole on every replica (``zero_level`` 0) or sharded over the replicas and context-parallel
    ranks (1, parallel/zero.py); with the stages sharded by FSDP2 (3, parallel/fsdp.py) AdamW
    over their shards."""
    if config.zero_level == 3:
        return ShardedAdamW(stages, topology, lr=config.lr, betas=config.betas,
                            weight_decay=config.weight_decay)
    if config.zero_level == 1:
        return ZeroAdamW(stages, topology, lr=config.lr, betas=config.betas,
                         weight_decay=config.weight_decay, microbatches=config.num_microbatches)
    return StageAdamW(stages, mixed=config.dtype == "bf16", lr=config.lr, betas=config.betas,
                      weight_decay=config.weight_decay, topology=topology)


def _reserve_host_memory(config: TrainConfig, topology: Topology, pipe: Pipeline,
                         stages: Mapping[int, nn.Module], hf: HFStages | None) -> None:
    """Allocate the offload's pinned memory now, not inside a step (training/host_reserve.py)."""
    microbatch = config.data.batch_size // config.dp // config.num_microbatches
    seq = config.data.seq_len // config.cp  # this rank's tokens under context parallelism
    hf_config: Any = None if hf is None else hf.model.config
    hidden = ((microbatch, seq, hf_config.hidden_size) if hf_config is not None  # whole on TP
              else (microbatch, seq // config.tp, config.model.dim))  # sequence shards
    reserve_host_memory(pipe, stages, microbatch, seq, hidden, torch_dtype(config.dtype),
                        topology.device or torch.device("cpu"))


def checkpoint_identity(config: TrainConfig, schedule: Schedule) -> dict[str, Any]:
    """What a checkpoint is only valid with (its manifest's ``info``, compared on resume):
    a checkpoint holds each tensor-parallel rank's shards, so another ``tp`` is refused (not
    resharded), and another ``dtype``, whose weights and optimizer state differ, too; another
    ``dp`` or ``zero`` re-shards (parallel/checkpoint.py RESHARDABLE)."""
    model: dict[str, Any] = (dataclasses.asdict(config.model) if config.hf_model is None
                             else {"hf_config": resolve_model(config.hf_model).config})
    if config.hf_model is not None and config.model.document_eos is not None:
        model["document_eos"] = config.model.document_eos  # --document-mask trains another model
    return {"pp": config.pp, "dp": config.dp, "tp": config.tp, "zero": config.zero_level,
            "dtype": config.dtype,
            "schedule": schedule.name, "stage_to_rank": list(schedule.stage_to_rank),
            "model": model}


def build_stages(config: TrainConfig, num_stages: int, mine: list[int],
                 topology: Topology) -> dict[int, nn.Module]:
    """This process's stage modules: initialised in full, in the run's dtype, sharded over the
    tensor-parallel group, with the layers' recompute mode set."""
    stages = build_stage_modules(config.model, num_stages, mine, config.seed,
                                 dtype=torch_dtype(config.dtype), device=topology.device)
    for module in stages.values():
        if topology.tp > 1:
            apply_tensor_parallel(cast(Transformer, module), topology.tp_mesh)
        set_layer_recompute(module, config.recompute)
    return stages
