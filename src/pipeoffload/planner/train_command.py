"""The planner's command printer: the ``pipeoffload train`` command line that runs a plan, or
why train cannot run it (a refusal, never a command with the unsupported part left out).

What train accepts (cli/train.py, docs/training.md): ``--pp --dp --tp``, ``--schedule``,
``--chunks`` / ``--group-size`` where the schedule takes them, ``--microbatches``,
``--batch-size`` (global), ``--offload``, ``--recompute none|lgd|full``, ``--dtype fp32|bf16``
and the reference model's shape; ``--offload recompute-chunks:1+all`` is the planner's
per-chunk mix of recompute and offload (RECOMPUTE_AND_OFFLOAD). What train refuses, so the
printer refuses too:
- a schedule family the library's registry does not hold (a planner given its own registry);
- a tensor-parallel degree that does not divide the heads, key/value heads, MLP width or the
  reference model's byte vocabulary;
- activations of other than 2 (bf16) or 4 (fp32) bytes;
- for a Hugging Face model (``spec.train_model``, run as ``--model PATH``): ``--recompute lgd``,
  recompute of a config with dropout, and tensor parallelism of a family train does not shard
  (pipeoffload/hf_families.py);
A plan whose memory counts the optimizer state sharded over data parallelism
(``--sharded-optimizer``, ZeRO-1; ``MemoryConfig.optimizer.sharded``) gets ``--zero 1`` when
dp * cp > 1 (train's parallel/zero.py shards it the same way, over the data-parallel replicas
times the context-parallel ranks); without it the plan's memory counts the whole optimizer
state on every replica, so the command carries ``--zero 0`` (train's default at dp * cp > 1 is
``--zero 1``). A plan priced as FSDP2 stages (``plan --zero 3``; ``MemoryConfig.optimizer.fsdp``,
planner/optimizer.py Note [zero 3 terms]) gets ``--zero 3`` where train runs it (dp > 1, tp 1,
cp 1; training/train.py ``_ZERO3_LIMITS``) and is refused, naming why, elsewhere.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from pipeoffload import hf_families
from pipeoffload.core.registry import FAMILIES
from pipeoffload.planner.candidate import Candidate
from pipeoffload.planner.class_offload import CLASS_OFFLOAD
from pipeoffload.planner.transformer import TransformerSpec

#: The reference model's vocabulary (byte-level text, training/model.py ModelConfig.vocab_size).
TRAIN_VOCAB = 256
#: Bytes per activation element -> train's --dtype (None: train's default, fp32).
DTYPE_FLAGS = {2: "bf16", 4: None}


@dataclass(frozen=True)
class TrainCommand:
    """Either ``argv`` (the command, as one line) or ``refused`` (why train cannot run it)."""

    argv: str | None
    refused: str | None

    def __str__(self) -> str:
        if self.argv is not None:
            return self.argv
        return f"pipeoffload train cannot run this plan: {self.refused}"


def train_command(candidate: Candidate, spec: TransformerSpec | None = None, *,
                  sharded_optimizer: bool = False, offload: str | None = None,
                  fsdp: bool = False) -> TrainCommand:
    """The command that runs ``candidate`` (with ``spec``, the reference model at that shape);
    ``sharded_optimizer``: the plan's memory counts the optimizer state sharded over DP;
    ``fsdp``: it was priced as train's ``--zero 3``;
    ``offload``: the ``--offload`` its plan chose (a class plan's ``classes:A+B``,
    planner/class_offload.py), else the candidate's own."""
    c = candidate
    refused = (_refusal(c, spec) or _class_refusal(c, spec, offload)
               or (_zero3_refusal(c) if fsdp else None))
    if refused is not None:
        return TrainCommand(None, refused)
    parts = ["pipeoffload train", f"--pp {c.pp}", f"--dp {c.dp}"]
    if c.tp > 1:
        parts.append(f"--tp {c.tp}")
    if c.cp > 1:
        parts.append(f"--cp {c.cp}")
    if fsdp:
        parts.append("--zero 3")
    elif c.dp * c.cp > 1:  # train's default there is --zero 1; say what the memory counted
        parts.append("--zero 1" if sharded_optimizer else "--zero 0")
    preset, family = c.preset, FAMILIES[c.schedule]
    parts.append(f"--schedule {c.display_name}")
    if "chunks" in family.options:
        parts.append(f"--chunks {c.chunks}")
    if c.group_size is not None and preset is None:
        parts.append(f"--group-size {c.group_size}")
    parts += [f"--microbatches {c.microbatches}",
              f"--batch-size {c.dp * c.microbatches * c.micro_batch}"]
    if preset is None:
        parts.append(f"--offload {offload or c.offload}")
    if c.recompute.value != "none":
        parts.append(f"--recompute {c.recompute.value}")
    if spec is not None:
        dtype = DTYPE_FLAGS[spec.activation_bytes]
        if dtype is not None:
            parts.append(f"--dtype {dtype}")
        if spec.train_model is not None:
            parts += [f"--model {shlex.quote(spec.train_model)}", f"--seq-len {spec.seq_len}"]
        else:
            parts += [f"--layers {spec.num_layers}", f"--dim {spec.hidden}",
                      f"--heads {spec.heads}", f"--kv-heads {spec.kv_heads}",
                      f"--ffn-hidden {spec.ffn_hidden}", f"--seq-len {spec.seq_len}"]
    return TrainCommand(" ".join(parts), None)


def _zero3_refusal(c: Candidate) -> str | None:
    """Why train cannot run ``c`` with ``--zero 3`` (training/train.py ``_ZERO3_LIMITS``)."""
    if c.dp < 2:
        return (f"--zero 3 shards each stage over the data-parallel replicas and this plan has "
                f"dp {c.dp}; train needs dp 2 or more (plan with --zero 1, or more GPUs)")
    if c.tp > 1 or c.cp > 1:
        return (f"train runs --zero 3 at tp 1 and cp 1 only (this plan: tp {c.tp}, cp "
                f"{c.cp}); plan it with --zero 1 (priced the same), or --tp 1 --cp 1")
    return None


def _class_refusal(c: Candidate, spec: TransformerSpec | None, offload: str | None
                   ) -> str | None:
    """Why train cannot run a class plan (training/train_classes.py), or None."""
    if c.offload != CLASS_OFFLOAD:
        return None
    if offload is None:
        return "the class search chose no --offload for it (a plan not simulated)"
    if not offload.startswith("classes:"):
        return None  # it chose whole chunks
    if c.tp > 1 or c.cp > 1:
        return (f"train moves tensor classes at tp 1 and cp 1 only (this plan: tp {c.tp}, "
                f"cp {c.cp}, --offload {offload}); search with --tp 1")
    if (spec is not None and spec.train_model is not None
            and spec.model_type not in hf_families.CLASS_MODEL_TYPES):
        return (f"train moves tensor classes of {', '.join(hf_families.CLASS_MODEL_TYPES)} "
                f"models, not {spec.model_type} (--offload {offload})")
    return None


def _refusal(c: Candidate, spec: TransformerSpec | None) -> str | None:
    if c.schedule not in FAMILIES:
        return f"train has no schedule {c.schedule!r} (`pipeoffload schedules` lists its own)"
    if c.recompute.value not in ("none", "lgd", "full"):
        return (f"its recompute option is {c.recompute.value}; train recomputes lgd or full "
                "(selective recompute is Megatron's unfused-attention variant)")
    if spec is None:
        return None
    if spec.activation_bytes not in DTYPE_FLAGS:
        return (f"its activations are {spec.activation_bytes} bytes per element; train runs "
                "fp32 (4) or bf16 (2)")
    sizes = [("heads", spec.heads), ("kv_heads", spec.kv_heads),
             ("ffn_hidden", spec.ffn_hidden)]
    if spec.train_model is not None:
        if c.recompute.value not in hf_families.RECOMPUTE_MODES:
            return (f"train recomputes a Hugging Face model's whole layers (full) or nothing, "
                    f"not {c.recompute.value}; search with --recompute full or none")
        if c.recompute.value != "none" and spec.dropout:
            return ("the config sets dropout, and train recomputes a Hugging Face model's "
                    "layers only without it (other masks); search with --recompute none")
        if c.tp > 1 and spec.model_type not in hf_families.TENSOR_PARALLEL_MODEL_TYPES:
            return (f"train does not shard {spec.model_type} models over tensor-parallel "
                    "ranks; search with --tp 1")
        if c.cp > 1 and spec.model_type not in hf_families.CONTEXT_PARALLEL_MODEL_TYPES:
            return (f"train does not cut {spec.model_type} sequences over context-parallel "
                    "ranks; search with --cp 1")
    else:
        sizes.append(("vocabulary", TRAIN_VOCAB))
    for name, value in sizes:
        if value % c.tp:
            return (f"tp={c.tp} does not divide {name}={value}; train shards those over the "
                    "tensor-parallel ranks; search with --tp values that divide it")
    return None
