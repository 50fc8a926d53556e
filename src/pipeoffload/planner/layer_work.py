"""The memory-bound work of a transformer layer: bytes each pass moves through device memory
and the kernels it launches, for the work the matmul FLOPs leave out.

Note [memory-bound work]: norms, activation functions, dropout, residual adds, bias adds and
bias gradients, the unfused attention's softmax and dropout over its s x s scores, layout copies
and the loss move a few bytes per element and do a few FLOPs per byte, far below any GPU's
ops:byte ratio, so they take bytes / achievable memory bandwidth (``Hardware.memory_s``), plus a
fixed cost per kernel. Their bytes grow as b s h per layer against the matmuls' b s h^2: they
weigh most on narrow layers (leaving them out errs as 1 / h, docs/planner-model.md).

The kernels are Megatron-LM's GPT layer (megatron/model/transformer.py: ParallelTransformerLayer,
ParallelAttention, ParallelMLP; the code behind Narayanan et al. 2021 and Korthikanti et al. 2022)
with its fusions: apex's fused LayerNorm, the fused scale-mask-softmax, the jit-fused bias-GeLU
and bias-dropout-add; the QKV bias is added by a separate kernel; the unfused attention's context
is permuted back with a copy. SwiGLU is one fused kernel (Megatron-core's swiglu), flash
attention keeps its softmax and dropout inside its kernel (Dao et al. 2022). Bytes per element,
e = the activation element size (2), masks 1 byte:

| work | elements | forward | backward (I) |
|---|---|---|---|
| each of 2 norms | R | read + write: 2e | read x and dy once, write dx: 3e (Note [norm kernels]) |
| each of 2 residual joins, dropout | R | x, residual, out, mask: 3e + 1 | 2e + 1; join: 3e |
| the same without dropout | R | 3e | join (sum the two gradients): 3e |
| QKV bias add (biases) | Q | 2e | (its gradient is W work) |
| GeLU (bias-GeLU) | M | 2e | x, dy, dx: 3e |
| SwiGLU | M | gate, up, out: 3e | gate, up, dy, dgate, dup: 5e |
| unfused attention: softmax | S | 2e | y, dy, dx: 3e |
| unfused attention: dropout | S | 2e + 1 | 2e + 1 |
| unfused attention: context permute | A | 2e | 2e |

R = residual-stream elements per GPU (b s h / t with sequence parallelism, b s h without: the
norms and dropouts then run on every GPU), Q = b s (h + 2 h_kv) / t, A = b s h / t,
M = b s f / t, S = b (a / t) s^2. W: bias gradients read their output gradient once (Q, M and
2 R elements). Recompute adds to I what it re-runs: FULL the whole forward, SELECTIVE the
softmax and attention dropout (unfused attention only), LGD the norms, the activation function
and the dropouts.

Note [norm kernels]: which LayerNorm kernels run is framework behaviour (``NormKernel``).
Megatron-LM's default since October 2021 (commit a2fdcdf061, with PyTorch >= 1.11; the code of
Korthikanti et al. 2022's Table 4, on which ``HBM_EFFICIENCY`` is fitted) is apex's persistent
FastLayerNorm, whose backward reads x and dy once and writes dx (2 kernels: the second
finalizes the gamma / beta gradients from per-block partial sums); forward 2e, backward 3e per
element. Before it (the code of Narayanan et al. 2021) Megatron ran its mixed-precision copy of
apex's FusedLayerNorm, whose backward reads x and dy twice (the gamma / beta partial sums, then
dx: 3 kernels). apex PR #1037 (NVIDIA/apex, January 2021) timed both on an A100 for 32 x 512
rows of 1024 fp16 elements: forward 0.0751 ms (FusedLayerNorm) against 0.0535 ms (persistent),
backward 0.1762 ms against 0.0866 ms. ``NormKernel.APEX`` takes the persistent kernel's time
scaled by those measured ratios, 1.40 and 2.03 [their hidden size 1024 carried to ours: an
assumption; Megatron's copy differs from apex's in its types only, per Megatron's maintainer in
bigscience-workshop/Megatron-DeepSpeed issue #136].
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pipeoffload.errors import ConfigError
from pipeoffload.planner.transformer import (
    LOSS_BYTES,
    MASK_BYTES,
    MlpKind,
    Recompute,
    TransformerSpec,
    as_recompute,
    check_run,
)

#: Bytes per element the vocabulary-parallel cross entropy moves (Megatron-LM's
#: _VocabParallelCrossEntropy on ``logits.float()``): forward cast (e + 4), max (4), subtract
#: (8), exp (8), sum (4), normalise (8); backward scale by the loss gradient (8) and cast back
#: to 16 bits (4 + e).
LOSS_FORWARD_BYTES = 4 + 4 + 8 + 8 + 4 + 8
LOSS_BACKWARD_BYTES = 8 + LOSS_BYTES
LOSS_KERNELS = (6, 2)

#: apex PR #1037's times of FusedLayerNorm over its persistent kernel (Note [norm kernels]).
APEX_NORM_FORWARD_SCALE = 0.0751 / 0.0535
APEX_NORM_BACKWARD_SCALE = 0.1762 / 0.0866


class NormKernel(str, Enum):
    """The LayerNorm kernels a framework runs (Note [norm kernels])."""

    PERSISTENT = "persistent"  # apex FastLayerNorm: Megatron-LM from October 2021
    APEX = "apex"  # apex FusedLayerNorm / Megatron's fused_mix_prec_layer_norm_cuda, 2021


def as_norm_kernel(value: NormKernel | str) -> NormKernel:
    """``value`` as a NormKernel, or ConfigError naming the choices."""
    try:
        return NormKernel(value.value if isinstance(value, NormKernel) else value)
    except ValueError:
        choices = ", ".join(kernel.value for kernel in NormKernel)
        raise ConfigError(f"unknown norm kernel {value!r} (choose from {choices})") from None


@dataclass(frozen=True)
class MemoryWork:
    """Bytes moved through device memory and kernels launched by memory-bound work."""

    nbytes: float = 0.0
    kernels: float = 0.0

    def __add__(self, other: MemoryWork) -> MemoryWork:
        return MemoryWork(self.nbytes + other.nbytes, self.kernels + other.kernels)


@dataclass(frozen=True)
class PassWork:
    """Memory-bound work of the forward F, input-gradient backward I and weight-gradient W."""

    f: MemoryWork = MemoryWork()
    i: MemoryWork = MemoryWork()
    w: MemoryWork = MemoryWork()


@dataclass(frozen=True)
class _Elements:
    """Element counts of one layer on one GPU (the module docstring's R, Q, A, M, S)."""

    residual: float
    qkv: float
    context: float
    mlp: float
    scores: float


def _elements(spec: TransformerSpec, micro_batch: int, tp: int,
              sequence_parallel: bool) -> _Elements:
    tokens = micro_batch * spec.seq_len
    return _Elements(
        residual=tokens * spec.hidden / (tp if sequence_parallel else 1),
        qkv=tokens * (spec.hidden + 2 * spec.kv_hidden) / tp,
        context=tokens * spec.hidden / tp,
        mlp=tokens * spec.ffn_hidden / tp,
        scores=0.0 if spec.flash_attention
        else micro_batch * spec.heads / tp * spec.seq_len**2,
    )


def norm_work(spec: TransformerSpec, rows_elements: float,
              kernel: NormKernel | str = NormKernel.PERSISTENT) -> PassWork:
    """One LayerNorm over ``rows_elements`` elements: forward and backward (Note [norm
    kernels]); bytes at the memory-bound rate, scaled for the older kernel by its measured
    time."""
    e = spec.activation_bytes
    if as_norm_kernel(kernel) is NormKernel.APEX:
        return PassWork(MemoryWork(APEX_NORM_FORWARD_SCALE * 2 * e * rows_elements, 1),
                        MemoryWork(APEX_NORM_BACKWARD_SCALE * 3 * e * rows_elements, 3))
    return PassWork(MemoryWork(2 * e * rows_elements, 1), MemoryWork(3 * e * rows_elements, 2))


def _activation(spec: TransformerSpec, n: _Elements) -> MemoryWork:
    per_element = 3 if spec.mlp is MlpKind.SWIGLU else 2
    return MemoryWork(per_element * spec.activation_bytes * n.mlp, 1)


def _residuals(spec: TransformerSpec, n: _Elements) -> MemoryWork:
    per_element = 3 * spec.activation_bytes + (MASK_BYTES if spec.dropout else 0)
    return MemoryWork(2 * per_element * n.residual, 2)


def _softmax_and_dropout(spec: TransformerSpec, n: _Elements) -> MemoryWork:
    """The unfused attention's forward over its scores (none with flash attention)."""
    if not n.scores:
        return MemoryWork()
    e = spec.activation_bytes
    work = MemoryWork(2 * e * n.scores, 1)
    if spec.dropout:
        work += MemoryWork((2 * e + MASK_BYTES) * n.scores, 1)
    return work


def layer_memory_work(spec: TransformerSpec, micro_batch: int, tp: int, *,
                      sequence_parallel: bool = True,
                      recompute: Recompute | str = Recompute.NONE,
                      norm_kernel: NormKernel | str = NormKernel.PERSISTENT) -> PassWork:
    """Memory-bound work of one layer for ``micro_batch`` sequences on one of ``tp`` GPUs
    (Note [memory-bound work])."""
    check_run(micro_batch, tp)
    recompute = as_recompute(recompute)
    e = spec.activation_bytes
    n = _elements(spec, micro_batch, tp, sequence_parallel)
    norm = norm_work(spec, n.residual, norm_kernel)
    norms, activation = norm.f + norm.f, _activation(spec, n)
    residuals, attention = _residuals(spec, n), _softmax_and_dropout(spec, n)
    forward = norms + activation + residuals + attention
    if spec.bias:
        forward += MemoryWork(2 * e * n.qkv, 1)
    if n.scores:
        forward += MemoryWork(2 * e * n.context, 1)  # context permute
    mlp_backward = (5 if spec.mlp is MlpKind.SWIGLU else 3) * e * n.mlp
    backward = norm.i + norm.i + MemoryWork(mlp_backward, 1)
    backward += MemoryWork(2 * 3 * e * n.residual, 2)  # the two residual joins
    if spec.dropout:
        backward += MemoryWork(2 * (2 * e + MASK_BYTES) * n.residual, 2)
    if n.scores:
        backward += MemoryWork(3 * e * n.scores + 2 * e * n.context, 2)
        if spec.dropout:
            backward += MemoryWork((2 * e + MASK_BYTES) * n.scores, 1)
    if recompute is Recompute.FULL:
        backward += forward
    elif recompute is Recompute.SELECTIVE:
        backward += attention
    elif recompute is Recompute.LGD:
        backward += norms + activation
        if spec.dropout:
            backward += residuals + MemoryWork(
                (2 * e + MASK_BYTES) * n.scores, 1 if n.scores else 0)
    weight = MemoryWork()
    if spec.bias:
        weight = MemoryWork(e * (n.qkv + n.mlp + 2 * n.residual), 4)
    return PassWork(forward, backward, weight)


def head_memory_work(spec: TransformerSpec, micro_batch: int, tp: int, *,
                     sequence_parallel: bool = True,
                     norm_kernel: NormKernel | str = NormKernel.PERSISTENT) -> PassWork:
    """The final norm and the vocabulary-parallel cross entropy over b s V / t logits."""
    check_run(micro_batch, tp)
    e, tokens = spec.activation_bytes, micro_batch * spec.seq_len
    residual = tokens * spec.hidden / (tp if sequence_parallel else 1)
    logits = tokens * spec.vocab / tp
    norm = norm_work(spec, residual, norm_kernel)
    return PassWork(
        norm.f + MemoryWork((LOSS_FORWARD_BYTES + e) * logits, LOSS_KERNELS[0]),
        norm.i + MemoryWork(LOSS_BACKWARD_BYTES * logits, LOSS_KERNELS[1]),
    )


def embedding_memory_work(spec: TransformerSpec, micro_batch: int, tp: int, *,
                          sequence_parallel: bool = True) -> PassWork:
    """The vocabulary-parallel lookup (gather, zeroing of other shards' tokens, position
    embedding add: 2e + 2e + 3e per element of b s h), its dropout, and in W the gradient's
    scatter into the V / t x h table (read it once, write the table)."""
    check_run(micro_batch, tp)
    e, tokens = spec.activation_bytes, micro_batch * spec.seq_len
    whole = tokens * spec.hidden
    residual = whole / (tp if sequence_parallel else 1)
    dropout = (2 * e + MASK_BYTES) * residual if spec.dropout else 0.0
    table = spec.vocab * spec.hidden / tp
    return PassWork(
        MemoryWork(7 * e * whole + dropout, 4),
        MemoryWork(dropout, 1 if spec.dropout else 0),
        MemoryWork(e * whole + 2 * e * table, 2),
    )
