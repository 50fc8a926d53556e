"""What one `pipeoffload train` run is, without torch: its configuration (``TrainConfig``,
every value checked where it enters, errors naming the field: errors.FieldError), the
``--offload`` forms it takes, and its schedule with offload planned in (``build_plan``). The
command line builds it before torch is imported; training/trainer.py runs it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeoffload.api import plan_schedule
from pipeoffload.checks import check_number, check_optional
from pipeoffload.errors import ConfigError, FieldError
from pipeoffload.offload.plan import OffloadPlan, OffloadPolicy
from pipeoffload.offload.targets import TargetKind, parse_target
from pipeoffload.parallel.dtype_names import DTYPE_BYTES, DTYPE_NAMES, EXPORT_DTYPE_NAMES
from pipeoffload.parallel.rank_order import DEFAULT_ORDER, parse_order
from pipeoffload.planner.evaluate import RECOMPUTE_AND_OFFLOAD
from pipeoffload.planner.presets import load_model
from pipeoffload.planner.transformer import TransformerSpec
from pipeoffload.training.data_config import DataConfig
from pipeoffload.training.model_config import (
    RECOMPUTE_MODES,
    ModelConfig,
    check_tensor_parallel,
    model_preset,
)
from pipeoffload.training.train_classes import (
    class_names,
    is_classes,
    layout_refusal,
    plan_classes_offload,
    reference_spec,
)

DEVICES = ("auto", "cpu", "cuda")
#: What ``--zero 3`` (FSDP2, parallel/fsdp.py) does not compose with yet, and why: (the
#: condition, the reason), each refused in one line.
_ZERO3_LIMITS: tuple[tuple[Callable[[TrainConfig], bool], str], ...] = (
    (lambda c: c.dp < 2, "{zero} 3 shards each stage over the data-parallel replicas, "
     "and {dp} 1 has none; use {dp} 2 or more"),
    (lambda c: c.tp > 1, "{zero} 3 with {tp} > 1 is not implemented: the stages' "
     "tensor-parallel DTensors would be sharded again over a 2-D mesh; use {zero} 1"),
    (lambda c: c.cp > 1, "{zero} 3 with {cp} > 1 is not implemented: gradients would be "
     "averaged over context-parallel ranks too (FSDP's replicate x shard mesh); use {zero} 1"),
)


def _refuse(template: str, **values: object) -> FieldError:
    """A TrainConfig error: ``{field}`` placeholders name its fields (FieldError)."""
    return FieldError("TrainConfig", template, values)


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
    bf16 for a bf16 run, else fp32). ``zero``: 0 keeps the whole optimizer state on every
    data-parallel replica; 1 shards float32 masters and AdamW moments over the replicas and
    context-parallel ranks (ZeRO-1, parallel/zero.py); 3 shards each stage's parameters,
    gradients and moments over the replicas with FSDP2 (parallel/fsdp.py; what it does not
    compose with yet is refused: ``_ZERO3_LIMITS``); None (the
    default): 1 when dp * cp > 1, else 0 (``zero_level``).
    A value that is wrong raises FieldError naming its field (``TrainConfig.lr``; the command
    line names its flag instead).
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
    zero: int | None = None
    cp: int = 1
    rank_order: str = ",".join(DEFAULT_ORDER)

    @property
    def processes(self) -> int:
        """How many processes the run takes: pp * dp * tp * cp."""
        return self.pp * self.dp * self.tp * self.cp

    def __post_init__(self) -> None:
        self._check_model_and_outputs()
        self._check_optimisation()
        self._check_checkpoints()
        self._check_shape()

    def _check_model_and_outputs(self) -> None:
        if self.dtype not in DTYPE_NAMES:
            raise _refuse("{dtype} {got}: choose one of {choices}", got=repr(self.dtype),
                          choices=", ".join(DTYPE_NAMES))
        if not isinstance(self.cp, int) or self.cp < 1 or (
                self.cp > 1 and self.data.seq_len % (2 * self.cp)):
            raise _refuse("{cp} {cp_value}: context parallelism cuts each sequence into 2 * cp "
                          "chunks, so {data.seq_len} {seq} must be a multiple of {twice}",
                          cp_value=self.cp, seq=self.data.seq_len, twice=2 * self.cp)
        if self.hf_model is None:
            check_tensor_parallel(self.model, self.tp, self.data.seq_len // self.cp)
        try:
            parse_order(self.rank_order)
        except ConfigError as error:
            raise _refuse("{rank_order}: " + str(error)) from None
        train_offload(self.offload)
        refusal = (layout_refusal(self.tp, self.cp, self.recompute)
                   if is_classes(self.offload) else None)
        if refusal is not None:
            raise _refuse("{offload} " + repr(self.offload) + ": " + refusal)
        if self.eval_every < 0 or self.eval_batches < 1:
            raise _refuse("{eval_every} must be >= 0 and {eval_batches} >= 1, got {every} and "
                          "{batches}", every=self.eval_every, batches=self.eval_batches)
        if self.export_hf is not None and self.hf_model is None:
            raise _refuse("{export_hf} writes a Hugging Face model; train one with {hf_model} "
                          "PATH (a config.json or a folder with one)")
        if self.export_dtype is not None and self.export_dtype not in EXPORT_DTYPE_NAMES:
            raise _refuse("{export_dtype} {got}: choose one of {choices}",
                          got=repr(self.export_dtype), choices=", ".join(EXPORT_DTYPE_NAMES))
        if self.recompute not in RECOMPUTE_MODES:
            raise _refuse("{recompute} {got}: choose one of {choices}", got=repr(self.recompute),
                          choices=", ".join(RECOMPUTE_MODES))

    def _check_optimisation(self) -> None:
        for name in ("lr", "weight_decay", "min_lr_ratio", "p2p_timeout_s"):
            check_number(f"TrainConfig.{name}", getattr(self, name))
        check_optional("TrainConfig.grad_clip", self.grad_clip)
        if self.p2p_timeout_s <= 0:
            raise _refuse("{p2p_timeout_s} must be > 0 seconds, got {got}",
                          got=self.p2p_timeout_s)
        if self.weight_decay < 0:
            raise _refuse("{weight_decay} must be >= 0, got {got}", got=self.weight_decay)
        for name in ("pp", "dp", "steps"):
            if getattr(self, name) < 1:
                raise _refuse("{" + name + "} must be >= 1, got {got}", got=getattr(self, name))
        if self.microbatches is not None and self.microbatches < 1:
            raise _refuse("{microbatches} must be >= 1, got {got}", got=self.microbatches)
        if self.lr <= 0 or self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise _refuse("{lr} must be > 0, {warmup_steps} >= 0 and {min_lr_ratio} in [0, 1]")
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise _refuse("{decay_steps} {decay} must come after the warm-up ({warmup_steps} "
                          "{warmup}); raise it or drop it", decay=self.decay_steps,
                          warmup=self.warmup_steps)
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise _refuse("{grad_clip} must be > 0 (or none), got {got}", got=self.grad_clip)
        if self.zero not in (None, 0, 1, 3):
            raise _refuse("{zero} {got}: choose 0 (whole optimizer state on every replica), 1 "
                          "(sharded over the data-parallel replicas and context-parallel "
                          "ranks) or 3 (FSDP2: parameters and gradients too)", got=self.zero)
        if self.zero == 3:
            for refused, why in _ZERO3_LIMITS:
                if refused(self):
                    raise _refuse(why)

    def _check_checkpoints(self) -> None:
        if self.checkpoint_every < 0:
            raise _refuse("{checkpoint_every} must be >= 0, got {got}", got=self.checkpoint_every)
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise _refuse("{checkpoint_every} needs {checkpoint_dir} (where to write)")
        if self.keep_last is not None and (self.keep_last < 1 or self.checkpoint_dir is None):
            raise _refuse("{keep_last} {n} needs {checkpoint_dir} and N >= 1", n=self.keep_last)
        if self.resume == "auto" and self.checkpoint_dir is None:
            raise _refuse("{resume} auto needs {checkpoint_dir} (where to look, and where to "
                          "save)")

    def _check_shape(self) -> None:
        if self.hf_model is None and self.data.seq_len > self.model.max_seq_len:
            raise _refuse("{data.seq_len} {seq} exceeds the model's max_seq_len {most}; lower "
                          "{data.seq_len} or raise it", seq=self.data.seq_len,
                          most=self.model.max_seq_len)
        if self.device not in DEVICES:
            raise _refuse("{device} must be auto, cpu or cuda, got {got}", got=repr(self.device))
        local = self.data.batch_size // self.dp
        if self.data.batch_size % self.dp or local % self.num_microbatches:
            raise _refuse(
                "global batch {batch} over dp={dp} replicas gives {per_replica} sequences per "
                "replica, which must be a whole multiple of microbatches={microbatches}; set "
                "{data.batch_size} to a multiple of {multiple}", batch=self.data.batch_size,
                dp=self.dp, per_replica=f"{self.data.batch_size / self.dp:g}",
                microbatches=self.num_microbatches, multiple=self.dp * self.num_microbatches)

    @property
    def zero_level(self) -> int:
        """The optimizer sharding the run uses: ``zero``, or when unset 1 (ZeRO-1) where the
        state has dp * cp ranks to be sharded over, else 0."""
        if self.zero is not None:
            return self.zero
        return 1 if self.dp * self.cp > 1 else 0

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
    forms = ("none, all, chunks:K, fraction:X, limit:X, limit:XGiB, "
             f"{RECOMPUTE_AND_OFFLOAD} (each rank's longest-lived chunk recomputed, the rest "
             "offloaded) or classes:A+B[/recompute:C+D] (these tensor classes moved, those "
             "recomputed, training/train_classes.py)")
    if is_classes(spec):
        class_names(spec)
        return spec.strip()
    text = spec.strip().lower() if isinstance(spec, str) else ""
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
    RECOMPUTE_AND_OFFLOAD, offload/targets.py RECOMPUTE_CHUNKS_THEN_ALL): each rank's
    longest-lived chunk recomputed by RECOMPUTE actions (offload/recompute.py), every other
    activation offloaded.
    """
    options: dict[str, Any] = {
        k: v for k, v in (("chunks", config.chunks), ("group_size", config.group_size))
        if v is not None}
    policy = OffloadPolicy(fetch_on_use=config.fetch_on_use)
    if is_classes(config.offload):
        assert config.offload is not None
        return plan_classes_offload(config.offload, _class_spec(config), config.schedule,
                                    config.pp, config.num_microbatches, policy, options)
    return plan_schedule(config.schedule, config.pp, config.num_microbatches,
                         train_offload(config.offload), policy=policy, **options)


def _class_spec(config: TrainConfig) -> TransformerSpec:
    """The model as the planner sizes its tensor classes (``--offload classes:``)."""
    dtype_bytes = DTYPE_BYTES[config.dtype]
    if config.hf_model is None:
        return reference_spec(config.model, config.data.seq_len, dtype_bytes)
    return dataclasses.replace(load_model(config.hf_model, seq_len=config.data.seq_len),
                               activation_bytes=dtype_bytes)
