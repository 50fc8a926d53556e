"""A transformer layer's saved activation as named tensor classes (core/classes.py), sized by
the planner's per-tensor accounting and priced for recompute.

Sizes follow ``transformer.layer_activation_bytes`` (Korthikanti et al. 2022, section 4) tensor
by tensor, so the classes of a layer add up to it exactly (``tests/test_tensor_classes.py``).
Recompute times count the forward step that makes the class from the class before it (a
norm, a matmul, the attention core, the activation): the matmul FLOPs of ``transformer`` plus
the memory-bound work of ``layer_work``, the latter converted to FLOP-equivalents at
``RIDGE_FLOPS_PER_BYTE``, over the whole layer forward's. ``mlp_input`` (the residual after
attention) is made by the output projection from ``attn_out`` plus the layer input, which is
never recomputed; dropout masks are not recomputed (their random draws would have to be
replayed).

The names are the modules whose forward saves the tensors (the runtime tags saved tensors by
module, runtime/offloader.py), in forward order:

| class | tensors | bytes (per GPU, e = element size, w = 1 with SP else t) |
|---|---|---|
| layer_input | the attention norm's input | e b s h w / t |
| attn_norm | its output (the QKV input) | e b s h w / t |
| qkv | Q, K, V (the attention core's inputs) | e b s (h + 2 h_kv) / t |
| attn_out | attention output (projection input), softmax statistics | e b s h / t + 4 b a s / t |
| mlp_input | the MLP norm's input (the residual) | e b s h w / t |
| mlp_norm | its output (the first MLP matmul's input) | e b s h w / t |
| mlp_hidden | first matmul outputs (GeLU input; SwiGLU gate, up) | e b s f / t (x2 SwiGLU) |
| mlp_act | the activation's output (the last matmul's input) | e b s f / t (x2 SwiGLU) |
| masks | the two residual-dropout masks (with dropout only) | 2 b s h w / t |

Flash attention only; an unfused attention's s x s tensors are not split into classes.
"""

from __future__ import annotations

from pipeoffload.core.classes import TensorClass
from pipeoffload.errors import ConfigError
from pipeoffload.planner.layer_work import layer_memory_work, norm_work
from pipeoffload.planner.transformer import (
    MASK_BYTES,
    SOFTMAX_STAT_BYTES,
    MlpKind,
    TransformerSpec,
    attention_core_flops,
    check_run,
    layer_activation_bytes,
)

#: FLOPs an H100 SXM does in the time it moves one byte of HBM (989 TFLOP/s bf16 dense over
#: 3.35 TB/s): memory-bound work's FLOP-equivalent when pricing a recompute.
RIDGE_FLOPS_PER_BYTE = 989e12 / 3.35e12

CLASS_NAMES = ("layer_input", "attn_norm", "qkv", "attn_out", "mlp_input", "mlp_norm",
               "mlp_hidden", "mlp_act", "masks")

#: The classes `train` recomputes (runtime/class_recompute.py). Not ``layer_input`` (the others
#: are recomputed from it) nor ``masks``, and not ``qkv``: the runtime tags the attention core's
#: own saved outputs (its output and softmax statistics, saved inside the attention module)
#: ``qkv``, so its recompute would re-run the attention core, which ``qkv``'s time here does not
#: count (the Q, K, V projections only).
TRAIN_RECOMPUTES = ("attn_norm", "attn_out", "mlp_input", "mlp_norm", "mlp_hidden", "mlp_act")


def layer_class_bytes(spec: TransformerSpec, micro_batch: int, *, tp: int = 1,
                      sequence_parallel: bool = True) -> dict[str, float]:
    """Bytes of each class of one layer for ``micro_batch`` sequences on one of ``tp`` GPUs,
    in forward order (``masks`` only with dropout)."""
    check_run(micro_batch, tp)
    if not spec.flash_attention:
        raise ConfigError(f"model {spec.name!r}: tensor classes need flash attention (an "
                          "unfused attention's s x s tensors are not split into classes)")
    e, b, s, h = spec.activation_bytes, micro_batch, spec.seq_len, spec.hidden
    stream = e * b * s * h * (1 if sequence_parallel else tp) / tp
    mlp = e * b * s * spec.ffn_hidden / tp * (2 if spec.mlp is MlpKind.SWIGLU else 1)
    sizes = {
        "layer_input": stream,
        "attn_norm": stream,
        "qkv": e * b * s * (h + 2 * spec.kv_hidden) / tp,
        "attn_out": e * b * s * h / tp + SOFTMAX_STAT_BYTES * b * spec.heads * s / tp,
        "mlp_input": stream,
        "mlp_norm": stream,
        "mlp_hidden": mlp,
        "mlp_act": mlp,
    }
    if spec.dropout:
        sizes["masks"] = 2 * MASK_BYTES * b * s * h * (1 if sequence_parallel else tp) / tp
    return sizes


def _step_costs(spec: TransformerSpec, micro_batch: int, tp: int,
                sequence_parallel: bool) -> tuple[dict[str, float], float]:
    """FLOP-equivalents of the forward step that makes each class from the one before it, and
    of the whole layer forward."""
    b, s, h, e = micro_batch, spec.seq_len, spec.hidden, spec.activation_bytes
    tokens = b * s
    residual = tokens * h / (tp if sequence_parallel else 1)
    norm = norm_work(spec, residual).f.nbytes * RIDGE_FLOPS_PER_BYTE
    ups = 2 if spec.mlp is MlpKind.SWIGLU else 1
    act = (3 if ups == 2 else 2) * e * tokens * spec.ffn_hidden / tp * RIDGE_FLOPS_PER_BYTE
    steps = {
        "attn_norm": norm,
        "qkv": 2 * tokens * h * (h + 2 * spec.kv_hidden) / tp,
        "attn_out": attention_core_flops(spec, micro_batch) / tp,
        "mlp_input": 2 * tokens * h * h / tp,
        "mlp_norm": norm,
        "mlp_hidden": ups * 2 * tokens * h * spec.ffn_hidden / tp,
        "mlp_act": act,
    }
    fc2 = 2 * tokens * h * spec.ffn_hidden / tp
    whole = sum(steps.values()) + fc2 + layer_memory_work(
        spec, micro_batch, tp, sequence_parallel=sequence_parallel).f.nbytes * \
        RIDGE_FLOPS_PER_BYTE - 2 * norm - act  # the norms and activation are counted above
    return steps, whole


def layer_classes(spec: TransformerSpec, micro_batch: int = 1, *, tp: int = 1,
                  sequence_parallel: bool = True) -> tuple[TensorClass, ...]:
    """The classes of one layer (and so of any chunk of whole layers): each one's share of the
    layer's saved bytes and its recompute step's time as a share of the layer's forward."""
    sizes = layer_class_bytes(spec, micro_batch, tp=tp, sequence_parallel=sequence_parallel)
    total = layer_activation_bytes(spec, micro_batch, "none", tp=tp,
                                   sequence_parallel=sequence_parallel)
    steps, whole = _step_costs(spec, micro_batch, tp, sequence_parallel)
    return tuple(TensorClass(name, size / total,
                             steps[name] / whole if name in steps else None)
                 for name, size in sizes.items())
