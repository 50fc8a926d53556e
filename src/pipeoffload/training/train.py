"""The training loop of `pipeoffload train`: the reference transformer, cut into the stages of a
(planned) schedule, trained with AdamW on byte-level text, PP x DP x TP over torch.distributed
(tensor parallelism inside each stage with torch DTensor, training/tensor_parallel.py), in fp32,
fp64 or bf16 with float32 master weights (parallel/precision.py Note: [mixed precision]), with
recompute none, lgd or full inside each layer (training/model.py, training/layer_recompute.py).

Processes and groups: see launch.py's Note: [rank layout].

Without torch.distributed (``Topology.local``) one process runs every pipeline rank
(Pipeline's local mode); that is the single-process reference for the distributed runs.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeoffload.api import plan_schedule
from pipeoffload.checks import check_number, check_optional
from pipeoffload.core.actions import OFFLOAD_KINDS, Kind
from pipeoffload.errors import ConfigError, PipelineRuntimeError, PipeoffloadError
from pipeoffload.offload.plan import OffloadPlan, OffloadPolicy, add_offload
from pipeoffload.offload.recompute import add_recompute
from pipeoffload.offload.targets import TargetKind, parse_target
from pipeoffload.parallel import checkpoint as ckpt
from pipeoffload.parallel.checkpoint_files import check_root, resolve_resume
from pipeoffload.parallel.export import check_export_folder, export_dtype
from pipeoffload.parallel.gradients import clip_gradients, uncounted_masters
from pipeoffload.parallel.precision import MasterWeights, sync_gradients, torch_dtype
from pipeoffload.parallel.topology import Topology
from pipeoffload.planner.evaluate import RECOMPUTE_AND_OFFLOAD
from pipeoffload.runtime.config import OffloadConfig, RuntimeConfig
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.pipeline import Pipeline
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.simulator import SimResult, simulate
from pipeoffload.training.data import DataConfig, TextDataset
from pipeoffload.training.gather import agree_on_start, gather_step, stage_sizes
from pipeoffload.training.hf_model import resolve_model
from pipeoffload.training.hf_run import build_hf, check_model, export_run
from pipeoffload.training.host_reserve import reserve_host_memory
from pipeoffload.training.measure import measure_without_offload
from pipeoffload.training.model import (
    RECOMPUTE_MODES,
    ModelConfig,
    model_preset,
    set_layer_recompute,
)
from pipeoffload.training.signals import StopRequest, signal_name
from pipeoffload.training.split import build_stage_modules, lm_loss
from pipeoffload.training.tensor_parallel import apply_tensor_parallel, check_tensor_parallel
from pipeoffload.training.validation import eval_steps, held_out


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run depends on (the same in every process).

    ``microbatches`` is per pipeline replica and per step (None: 2 * pp); each replica's batch
    (``data.batch_size / dp``) must split evenly into them. ``steps`` is the step to stop at,
    counted from the start of training (a resumed run continues up to it). The learning rate
    warms up linearly over ``warmup_steps``, then stays at ``lr``, or follows a cosine down to
    ``lr * min_lr_ratio`` at ``decay_steps`` when that is set; it depends only on the step, so
    a resumed run follows the same curve. ``min_offload_elements`` is OffloadConfig's (0 moves
    every saved tensor, which makes the measured peaks comparable to the simulator's).
    ``measure_baseline`` runs one extra forward/backward without offload after training (no
    optimizer step, the model is unchanged) to measure the peaks offload saved. ``resume`` is
    None, "latest", "auto" (latest when ``checkpoint_dir`` holds a complete checkpoint, else a
    fresh start) or a path; ``keep_last`` keeps only the newest N complete checkpoints (None:
    all).
    ``hf_model``: a Hugging Face config.json or a folder with one (and maybe weights) to train
    instead of the reference ``model`` (training/hf_model.py). The held-out loss
    (training/validation.py) is measured on up to ``eval_batches`` batches at the last step,
    and with ``eval_every`` also at the start and every that many steps. ``export_hf``: a
    folder to write the trained model to as a Hugging Face model, in ``export_dtype`` (None:
    bf16 for a bf16 run, else fp32).
    """

    model: ModelConfig = field(default_factory=lambda: model_preset("small"))
    data: DataConfig = field(default_factory=DataConfig)
    pp: int = 4
    dp: int = 1
    schedule: str = "po-f"
    chunks: int | None = None
    group_size: int | None = None
    microbatches: int | None = None
    offload: str | None = None
    fetch_on_use: bool = False
    steps: int = 60
    lr: float = 3e-3
    warmup_steps: int = 10
    decay_steps: int | None = None
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float | None = 1.0
    seed: int = 0
    device: str = "auto"
    p2p_timeout_s: float = 300.0
    min_offload_elements: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: str | None = None
    measure_baseline: bool = True
    tp: int = 1
    dtype: str = "fp32"
    recompute: str = "none"
    keep_last: int | None = None
    hf_model: str | None = None
    eval_every: int = 0
    eval_batches: int = 4
    export_hf: str | None = None
    export_dtype: str | None = None

    def __post_init__(self) -> None:
        torch_dtype(self.dtype)
        if self.hf_model is None:
            check_tensor_parallel(self.model, self.tp, self.data.seq_len)
        train_offload(self.offload)
        if self.eval_every < 0 or self.eval_batches < 1:
            raise ConfigError(f"--eval-every must be >= 0 and --eval-batches >= 1, got "
                              f"{self.eval_every} and {self.eval_batches}")
        if self.export_hf is not None and self.hf_model is None:
            raise ConfigError("--export-hf writes a Hugging Face model; train one with --model "
                              "PATH (a config.json or a folder with one)")
        if self.export_dtype is not None:
            export_dtype(self.export_dtype)
        if self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"--recompute {self.recompute!r}: choose one of "
                              f"{', '.join(RECOMPUTE_MODES)}")
        for name in ("lr", "weight_decay", "min_lr_ratio", "p2p_timeout_s"):
            check_number(f"TrainConfig.{name}", getattr(self, name))
        check_optional("TrainConfig.grad_clip", self.grad_clip)
        if self.p2p_timeout_s <= 0:
            raise ConfigError(f"--p2p-timeout must be > 0 seconds, got {self.p2p_timeout_s}")
        if self.weight_decay < 0:
            raise ConfigError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        for name in ("pp", "dp", "steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.microbatches is not None and self.microbatches < 1:
            raise ConfigError(f"--microbatches must be >= 1, got {self.microbatches}")
        if self.lr <= 0 or self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("--lr must be > 0, --warmup-steps >= 0 and min_lr_ratio in [0, 1]")
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ConfigError(f"--decay-steps {self.decay_steps} must come after the warm-up "
                              f"(--warmup-steps {self.warmup_steps}); raise it or drop it")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ConfigError(f"--grad-clip must be > 0 (or none), got {self.grad_clip}")
        if self.checkpoint_every < 0:
            raise ConfigError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise ConfigError("--checkpoint-every needs --checkpoint-dir (where to write)")
        if self.keep_last is not None and (self.keep_last < 1 or self.checkpoint_dir is None):
            raise ConfigError(f"--keep-last {self.keep_last} needs --checkpoint-dir and N >= 1")
        if self.resume == "auto" and self.checkpoint_dir is None:
            raise ConfigError("--resume auto needs --checkpoint-dir (where to look, and where "
                              "to save)")
        if self.hf_model is None and self.data.seq_len > self.model.max_seq_len:
            raise ConfigError(f"--seq-len {self.data.seq_len} exceeds the model's max_seq_len "
                              f"{self.model.max_seq_len}; lower --seq-len or raise it")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        local = self.data.batch_size // self.dp
        if self.data.batch_size % self.dp or local % self.num_microbatches:
            raise ConfigError(
                f"global batch {self.data.batch_size} over dp={self.dp} replicas gives "
                f"{self.data.batch_size / self.dp:g} sequences per replica, which must be a "
                f"whole multiple of microbatches={self.num_microbatches}; set --batch-size to "
                f"a multiple of {self.dp * self.num_microbatches}")

    @property
    def num_microbatches(self) -> int:
        return self.microbatches if self.microbatches is not None else 2 * self.pp

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay_steps is None:
            return self.lr
        span = max(self.decay_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        floor = self.lr * self.min_lr_ratio
        return floor + (self.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainConfig:
        values = dict(values)
        model = ModelConfig(**values.pop("model"))
        data = dict(values.pop("data"))
        data["stdlib_packages"] = tuple(data["stdlib_packages"])
        values["betas"] = tuple(values["betas"])
        return cls(model=model, data=DataConfig(**data), **values)


def train_offload(spec: str | None) -> str | None:
    """``--offload`` as build_plan reads it (case and spaces aside); a spec train cannot run
    raises ConfigError listing what it takes."""
    if spec is None:
        return None
    forms = ("none, all, chunks:K, fraction:X, limit:X, limit:XGiB or "
             f"{RECOMPUTE_AND_OFFLOAD} (each rank's longest-lived chunk recomputed, the rest "
             "offloaded)")
    text = spec.strip().lower() if isinstance(spec, str) else ""
    if text == RECOMPUTE_AND_OFFLOAD:
        return text
    kind = text.partition(":")[0].strip()
    if kind == TargetKind.GIVEN.value:
        raise ConfigError("--offload given keeps the transfers of a schedule loaded from CSV "
                          "(simulate --from-csv); train builds its schedule by name: use "
                          + forms)
    if kind not in {k.value for k in TargetKind}:
        raise ConfigError(f"--offload {spec!r}: {'empty' if not text else 'unknown'}; use "
                          + forms)
    try:
        parse_target(spec)
    except ConfigError as error:
        raise ConfigError(f"--offload: {error}") from None
    return text


def build_plan(config: TrainConfig) -> OffloadPlan:
    """The schedule (offload planned in) and the planner's report. Recompute (``lgd`` /
    ``full``) happens inside each layer (training/model.py), so it mixes with any offload.

    ``--offload recompute-chunks:1+all`` is the planner's per-chunk mix (planner/evaluate.py
    RECOMPUTE_AND_OFFLOAD): each rank's longest-lived chunk recomputed by RECOMPUTE actions
    (offload/recompute.py), every other activation offloaded.
    """
    options = {k: v for k, v in (("chunks", config.chunks), ("group_size", config.group_size))
               if v is not None}
    policy = OffloadPolicy(fetch_on_use=config.fetch_on_use)
    offload = train_offload(config.offload)
    if offload != RECOMPUTE_AND_OFFLOAD:
        return plan_schedule(config.schedule, config.pp, config.num_microbatches,
                             offload, policy=policy, **options)
    bare = plan_schedule(config.schedule, config.pp, config.num_microbatches, "none", **options)
    recomputed = add_recompute(bare.schedule, target="chunks:1").schedule
    return add_offload(recomputed, target="all", policy=policy)


def preflight(config: TrainConfig, processes: int) -> OffloadPlan:
    """Check in one process what every rank would otherwise fail on in unison: the schedule,
    the split, the data and the checkpoint to resume (``processes``: how many will run)."""
    plan = build_plan(config)
    if plan.schedule.routes:
        raise ConfigError(f"--schedule {config.schedule}: its microbatches take several routes "
                          "whose stages share weights (DualPipe's two copies), which train does "
                          "not tie or all-reduce; use dualpipev (one copy, the same order folded "
                          "into V placement)")
    check_model(config, plan.schedule.num_stages)
    TextDataset.from_config(config.data, dp_size=config.dp)
    if config.checkpoint_dir is not None:
        check_root(config.checkpoint_dir)
    if config.export_hf is not None:
        check_export_folder(config.export_hf)
    resume = resolve_resume(config.resume, config.checkpoint_dir)
    if resume is not None:
        manifest = ckpt.read_manifest(ckpt.find_checkpoint(resume, config.checkpoint_dir))
        ckpt.check_compatible(manifest, {**checkpoint_identity(config, plan.schedule),
                                         "processes": processes})
        ckpt.check_resume_step(manifest.step, manifest.folder, config.steps)
    elif config.checkpoint_dir is not None and ckpt.complete_checkpoints(config.checkpoint_dir):
        raise ConfigError(f"--checkpoint-dir {config.checkpoint_dir} already holds checkpoints; "
                          "pass --resume to continue from them, or use an empty folder")
    return plan


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

    @property
    def predicted_bytes(self) -> tuple[float, ...] | None:
        return None if self.simulation is None else self.simulation.peak_bytes

    @property
    def baseline_predicted_bytes(self) -> tuple[float, ...] | None:
        sim = self.baseline_simulation
        return None if sim is None else sim.peak_bytes


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
    if topology.tp != config.tp:
        raise ConfigError(f"--tp {config.tp} runs one process per tensor-parallel rank, but this "
                          f"topology has tp={topology.tp}; start pp*dp*tp processes (drop "
                          "--inline)")
    plan = build_plan(config)
    schedule = plan.schedule
    last_rank = schedule.rank_of(schedule.num_stages - 1)
    reporter = not topology.distributed or topology.rank == topology.global_rank(last_rank, 0)
    mine = topology.stages_of(schedule)
    hf = build_hf(config, schedule.num_stages, mine, topology) if config.hf_model else None
    stages = hf.stages if hf is not None else build_stages(config, schedule.num_stages, mine,
                                                           topology)
    masters = MasterWeights(stages, mixed=config.dtype == "bf16")
    ties = uncounted_masters(stages, masters)
    optimizers = {s: torch.optim.AdamW(masters.params[s], lr=config.lr, betas=config.betas,
                                       weight_decay=config.weight_decay)
                  for s in stages}
    dataset = TextDataset.from_config(config.data, dp_rank=topology.dp_index,
                                      dp_size=topology.dp)
    runtime = RuntimeConfig(p2p_timeout_s=config.p2p_timeout_s,
                            offload=OffloadConfig(min_offload_elements=config.min_offload_elements))
    meter = ActivationMeter()
    pipe = Pipeline(stages, schedule, lm_loss, group=topology.pp_group, config=runtime,
                    device=topology.device, meter=meter, channel_groups=topology.channel_groups)
    # Pinned memory is allocated now, not inside a step (training/host_reserve.py).
    microbatch, seq = config.data.batch_size // config.dp // config.num_microbatches, \
        config.data.seq_len
    hidden = ((microbatch, seq, hf.model.config.hidden_size) if hf is not None  # whole on TP
              else (microbatch, seq // config.tp, config.model.dim))  # sequence shards
    reserve_host_memory(pipe, stages, microbatch, seq, hidden, torch_dtype(config.dtype),
                        topology.device or torch.device("cpu"))
    state = ckpt.TrainingState(stages, optimizers, dataset, masters.params)
    identity = checkpoint_identity(config, schedule)
    if config.checkpoint_dir is not None:
        check_root(config.checkpoint_dir)
    resume = resolve_resume(config.resume, config.checkpoint_dir)
    run = f"{random.SystemRandom().getrandbits(48):012x}"  # a fresh start's id (not seeded)
    if resume is not None:
        resumed = ckpt.restore(state, resume, config.checkpoint_dir, identity, topology)
        ckpt.check_resume_step(resumed, resume, config.steps)
        run = ckpt.run_id(ckpt.read_manifest(ckpt.find_checkpoint(resume, config.checkpoint_dir),
                                             verify_files=False))
    elif config.checkpoint_dir is not None and ckpt.complete_checkpoints(config.checkpoint_dir):
        raise ConfigError(f"--checkpoint-dir {config.checkpoint_dir} already holds checkpoints; "
                          "pass --resume to continue from them (--resume auto does so when "
                          "there are some), or use an empty folder")
    start = dataset.step
    with _peer_failures(topology, "agreeing on the start"):
        identity["run"], stopped = agree_on_start(topology, start, run,
                                                  stop.signum if stop is not None else 0)
    tokens = config.data.batch_size * config.data.seq_len
    losses: list[float] = []
    peaks = [0] * config.pp
    stage_bytes: tuple[int, ...] | None = None
    busy_s, saved = 0.0, None
    first_began = time.perf_counter()
    evals = eval_steps(start, config.steps, config.eval_every, dataset.num_eval_batches > 0)
    eval_losses: list[tuple[int, float]] = []

    def validate(done: int) -> None:
        with _peer_failures(topology, f"the held-out loss at step {done}"):
            loss = held_out(pipe, stages, dataset, topology, config.eval_batches, last_rank)
        eval_losses.append((done, loss))
        if on_eval is not None and reporter:
            on_eval(done, loss)

    if start in evals and start < config.steps and not stopped:
        validate(start)
    for step in range(start if not stopped else config.steps, config.steps):
        began = time.perf_counter()
        inputs, target = next(dataset)
        lr = config.lr_at(step)
        meter.reset()
        with _peer_failures(topology, f"step {step + 1}"):
            loss = pipe.step(inputs, target=target)
            masters.take_grads()
            sync_gradients(masters.params, topology)
            grad_norm = None
            if config.grad_clip is not None:
                grad_norm = clip_gradients(
                    [m for s in sorted(stages) for m in masters.params[s]], config.grad_clip,
                    topology, ties)
            for optimizer in optimizers.values():
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            masters.write_back()
            gathered = gather_step(topology, loss, meter, last_rank,
                                   pool_bytes=pipe.stats().host_pool_bytes,
                                   stop_signum=stop.signum if stop is not None else 0)
        mean_loss, step_peaks = gathered.loss, gathered.peak_bytes
        stopped = gathered.stop_signum
        elapsed = time.perf_counter() - began
        busy_s += elapsed
        if stage_bytes is None:
            with _peer_failures(topology, "gathering activation sizes"):
                stage_bytes = stage_sizes(topology, meter, schedule.num_stages)
        losses.append(mean_loss)
        peaks = [max(a, b) for a, b in zip(peaks, step_peaks)]
        if on_step is not None and reporter:
            on_step(StepLog(step + 1, config.steps, mean_loss, lr, tokens / elapsed, step_peaks,
                            grad_norm, elapsed, gathered.pool_bytes, start,
                            time.perf_counter() - first_began))
        done = step + 1
        if done in evals:
            validate(done)
        if config.checkpoint_dir is not None and (
                done == config.steps or stopped or (config.checkpoint_every
                                                    and done % config.checkpoint_every == 0)):
            with _peer_failures(topology, f"saving the checkpoint of step {done}"):
                saved = str(ckpt.save(state, config.checkpoint_dir, done, identity, topology,
                                      extra_files=checkpoint_files, keep_last=config.keep_last))
        if stopped and done < config.steps:
            break
        stopped = 0  # a request during the last step: the run is complete anyway
    end = start + len(losses)
    reason = ""
    if stopped:
        reason = stop.reason if stop is not None and stop.signum == stopped else (
            f"another rank received {signal_name(stopped)}")
    simulation = baseline_sim = baseline = None
    if stage_bytes is not None and not stopped:  # stopping: no extra work before the exit
        costs = CostModel(stage_activation_bytes=stage_bytes)
        simulation = simulate(schedule, costs)
        if schedule.has_kind(Kind.OFFLOAD):
            bare = dataclasses.replace(schedule.without(*OFFLOAD_KINDS),
                                       name=f"{schedule.name} without offload")
            baseline_sim = simulate(bare, costs)
            if config.measure_baseline:
                with _peer_failures(topology, "the step without offload"):
                    baseline = measure_without_offload(pipe, stages, dataset, topology, runtime,
                                                       last_rank)
    exported = None
    if config.export_hf is not None and hf is not None and not stopped:
        with _peer_failures(topology, f"exporting to {config.export_hf}"):
            exported = str(export_run(config, hf, masters, topology))
    return TrainResult(plan, start, end, tuple(losses),
                       tokens * len(losses) / busy_s if busy_s else 0.0, tuple(peaks),
                       stage_bytes, simulation, baseline_sim, baseline, saved, reporter,
                       stopped, reason, eval_losses=tuple(eval_losses), export=exported)


@contextmanager
def _peer_failures(topology: Topology, what: str) -> Iterator[None]:
    """Turn a failed collective (a peer died) into a PipelineRuntimeError naming this rank."""
    try:
        yield
    except RuntimeError as error:
        if isinstance(error, PipeoffloadError) or not topology.distributed:
            raise
        tensor_rank = f", tensor-parallel rank {topology.tp_index}" if topology.tp > 1 else ""
        where = (f"rank {topology.rank} (pipeline rank {topology.pp_rank}, replica "
                 f"{topology.dp_index}{tensor_rank}), {what}")
        if not _from_communication(error):  # this rank's own failure: no peer to blame
            raise PipelineRuntimeError(f"{where}: failed on this rank ({error})") from error
        raise PipelineRuntimeError(
            f"{where}: a collective failed ({error}); a peer died or failed, look at its "
            "error") from error


def _from_communication(error: RuntimeError) -> bool:
    """Whether a failed collective was the transport's (a peer gone, a timeout) rather than
    something local such as a missing package."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return any(word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout",
                                         "peer", "socket", "broken pipe"))


def checkpoint_identity(config: TrainConfig, schedule: Any) -> dict[str, Any]:
    """What a checkpoint is only valid with (its manifest's ``info``, compared on resume):
    a checkpoint holds each tensor-parallel rank's shards, so another ``tp`` is refused (not
    resharded), and another ``dtype``, whose weights and optimizer state differ, too."""
    model = (dataclasses.asdict(config.model) if config.hf_model is None
             else {"hf_config": resolve_model(config.hf_model).config})
    return {"pp": config.pp, "dp": config.dp, "tp": config.tp, "dtype": config.dtype,
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
            apply_tensor_parallel(module, topology.tp_mesh)  # type: ignore[arg-type]
        set_layer_recompute(module, config.recompute)
    return stages
