"""`pipeoffload train --offload classes:A+B[/recompute:C+D]`: move these tensor classes of every
activation that hides, drop those after the forward and make them again at the first backward
pass (the uniform class plan the planner prints, planner/class_offload.py), keep the rest.

The runtime moves classes by the module that saved each tensor (runtime/classes.py) and
recomputes them by replaying the ops that made them (runtime/class_recompute.py), tested on the
reference model and Hugging Face Llama at tp 1, cp 1; ``--recompute lgd`` / ``full``
(layout_refusal says why), ``qkv`` recomputed (``TRAIN_RECOMPUTES``) and other layouts and families
are refused here, before any process starts.
Each stage's classes take one layer's shares (planner/tensor_classes.py, the model's shape at
the run's sequence length): they time the copies the offload planner places; the runtime moves
the named classes whatever their measured sizes.
"""

from __future__ import annotations

from typing import Any

from pipeoffload.api import plan_schedule
from pipeoffload.core.classes import ClassChoice
from pipeoffload.errors import ConfigError
from pipeoffload.hf_families import CLASS_MODEL_TYPES
from pipeoffload.offload.class_plan import uniform
from pipeoffload.offload.plan import OffloadPlan, OffloadPolicy, add_offload
from pipeoffload.planner.tensor_classes import CLASS_NAMES, TRAIN_RECOMPUTES, layer_classes
from pipeoffload.planner.transformer import MlpKind, TransformerSpec
from pipeoffload.sim.costs import CostModel

KIND = "classes"


def is_classes(spec: str | None) -> bool:
    """Whether ``--offload spec`` is ``classes:...``."""
    return isinstance(spec, str) and spec.strip().lower().partition(":")[0].strip() == KIND


def class_names(spec: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The classes ``classes:A+B[/recompute:C+D]`` moves and recomputes (ConfigError naming
    what train cannot run)."""
    arg = spec.strip().partition(":")[2].strip()
    moved_text, slash, recomputed_text = arg.partition("/")
    if slash and not recomputed_text.strip().startswith("recompute:"):
        raise ConfigError(f"--offload {spec!r}: write classes:A+B/recompute:C+D")
    moved = _names(moved_text, spec)
    recomputed = _names(recomputed_text.strip().removeprefix("recompute:"), spec)
    if not moved and not recomputed:
        raise ConfigError(f"--offload {spec!r}: no class; name some of "
                          f"{', '.join(n for n in CLASS_NAMES if n != 'masks')} joined by +")
    refused = [n for n in recomputed if n not in TRAIN_RECOMPUTES]
    if refused:
        raise ConfigError(f"--offload {spec!r}: train recomputes "
                          f"{', '.join(TRAIN_RECOMPUTES)}, not {refused[0]!r} (layer_input "
                          "is what the others are recomputed from; qkv holds the attention "
                          "core's outputs); offload it instead")
    twice = [n for n in moved if n in recomputed]
    if twice:
        raise ConfigError(f"--offload {spec!r}: {twice[0]!r} is both moved and recomputed")
    return moved, recomputed


def _names(text: str, spec: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split("+") if n.strip())
    unknown = [n for n in names if n not in CLASS_NAMES or n == "masks"]
    if unknown:
        raise ConfigError(f"--offload {spec!r}: unknown tensor class {unknown[0]!r}; name some "
                          f"of {', '.join(n for n in CLASS_NAMES if n != 'masks')} joined by +")
    return names


def layout_refusal(tp: int, cp: int, recompute: str = "none") -> str | None:
    """Why train cannot move tensor classes at this layout (the class runtime is tested at
    tp 1, cp 1) or with this ``--recompute``, or None.

    lgd and full recompute regions (training/layer_recompute.py) save their inputs, and their
    outputs' consumers save theirs, outside the modules whose names give the classes
    (runtime/classes.py): nearly all of a layer is tagged ``other`` and kept, so the named
    classes would not move while the plan times them moved."""
    if tp > 1 or cp > 1:
        return (f"train moves tensor classes at tp 1 and cp 1 only (got tp {tp}, cp {cp}); "
                "use whole-chunk offload (all, chunks:K)")
    if recompute in ("lgd", "full"):
        return (f"train plans tensor classes of layers it does not recompute (got --recompute "
                f"{recompute}: its regions save outside the modules that name the classes); "
                "use --recompute none, or whole-chunk offload (all, chunks:K)")
    return None


def plan_classes_offload(spec: str, model: TransformerSpec, name: str, pp: int,
                         microbatches: int, policy: OffloadPolicy, options: dict[str, Any]
                         ) -> OffloadPlan:
    """Schedule ``name`` with the named classes of every (stage, microbatch) offloaded where
    their copies hide (``all``) and recomputed."""
    moved, recomputed = class_names(spec)
    if model.model_type is not None and model.model_type not in CLASS_MODEL_TYPES:
        raise ConfigError(f"--offload {spec!r}: train tags tensor classes of "
                          f"{', '.join(CLASS_MODEL_TYPES)} models and the reference model, not "
                          f"{model.model_type}")
    by_name = {c.name: c for c in layer_classes(model)}
    choice = ClassChoice(tuple(by_name[n] for n in moved), tuple(by_name[n] for n in recomputed))
    bare = plan_schedule(name, pp, microbatches, "none", **options).schedule
    return add_offload(bare.with_classes(uniform(bare, choice)), CostModel(),
                       "all" if moved else "none", policy)


def reference_spec(model: Any, seq_len: int, dtype_bytes: int) -> TransformerSpec:
    """The reference model (training.model.ModelConfig) as the planner sizes it."""
    return TransformerSpec(num_layers=model.n_layers, hidden=model.dim, heads=model.n_heads,
                           kv_heads=model.n_kv_heads, ffn_hidden=model.ffn_hidden,
                           vocab=model.vocab_size, seq_len=seq_len, mlp=MlpKind.SWIGLU,
                           activation_bytes=dtype_bytes, name="reference")
