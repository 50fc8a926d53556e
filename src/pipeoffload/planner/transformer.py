"""Analytic transformer model: FLOPs, saved-activation bytes and parameter counts.

Pure shape arithmetic, no hardware and no torch: the numbers here are per microbatch of ``b``
sequences and per GPU of a tensor-parallel group of ``tp`` GPUs with sequence parallelism.
Every formula is derived in docs/planner-model.md, which cites its sources:
- FLOPs: Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", appendix): a forward is 2 FLOPs per multiply-accumulate of every matmul,
  the input-gradient and weight-gradient backwards each cost one forward of the linear layers;
  flash attention's backward re-runs Q K^T (Dao et al. 2022, "FlashAttention", section 3.1).
- Saved activations: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models", section 4): 34 s b h + 5 a s^2 b bytes per GPT layer in 16-bit, all of it
  divided by t under tensor + sequence parallelism.

Note [counting conventions]: ``FlopCount.MODEL`` counts the model's math once (the convention of
MFU and of the paper's 12 b s h (6h + s)); ``FlopCount.HARDWARE`` counts what the kernels run,
adding flash attention's backward recompute of Q K^T and, under full recompute, the re-run
forward. Elementwise work (norms, activation functions, softmax, dropout) is not counted in
either: it is a few FLOPs per element against thousands per element of matmul.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

from pipeoffload.errors import ConfigError

#: Bytes per element of a dropout mask (torch keeps it as a bool tensor).
MASK_BYTES = 1
#: Bytes per element of flash attention's softmax statistics (log-sum-exp, fp32).
SOFTMAX_STAT_BYTES = 4
#: Bytes per element of the fp32 softmax the cross-entropy loss keeps for its backward
#: (Megatron's vocab-parallel cross entropy computes in fp32).
LOSS_BYTES = 4
#: Bytes per token id the embedding keeps for its backward (int64).
TOKEN_ID_BYTES = 8


class MlpKind(str, Enum):
    """The feed-forward block: GeLU (two matmuls h->f->h) or SwiGLU (three: gate, up, down)."""

    GELU = "gelu"
    SWIGLU = "swiglu"


class Recompute(str, Enum):
    """What a layer keeps for its backward.

    NONE: everything autograd saves. LGD: LayerNorm, activation-function and dropout outputs are
    recomputed in the backward (the authors' --recompute-lgd). SELECTIVE: Korthikanti et al.
    2022's selective recompute: the attention core's s x s tensors (softmax output, its dropout
    mask and output) are not kept and Q K^T, softmax, dropout and the product with V re-run
    before the backward; with flash attention nothing s x s is kept anyway and it equals NONE.
    FULL: only the layer input is kept and the whole forward re-runs before the backward
    (Megatron's full recompute).
    """

    NONE = "none"
    LGD = "lgd"
    SELECTIVE = "selective"
    FULL = "full"


class FlopCount(str, Enum):
    """Which FLOPs to count; see Note [counting conventions] in this module's docstring."""

    MODEL = "model"
    HARDWARE = "hardware"


E = TypeVar("E", bound=Enum)


def _enum(enum_type: type[E], value: object, field: str) -> E:
    try:
        return enum_type(value.value if isinstance(value, Enum) else value)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in enum_type)
        raise ConfigError(f"{field} must be one of {choices}, got {value!r}") from None


def as_recompute(value: Recompute | str) -> Recompute:
    """``value`` as a Recompute, accepting its text ("none" / "lgd" / "full")."""
    return _enum(Recompute, value, "recompute")


def as_flop_count(value: FlopCount | str) -> FlopCount:
    """``value`` as a FlopCount, accepting its text ("model" / "hardware")."""
    return _enum(FlopCount, value, "flop_count")


@dataclass(frozen=True)
class TransformerSpec:
    """Shape of a decoder-only transformer and the precision it trains in.

    ``kv_heads`` < ``heads`` is grouped-query attention; ``dropout`` says whether the layers
    apply dropout (GPT-3 style) or not (Llama style): it adds masks to the saved activations.
    ``bias``: the linear layers have biases (GPT-3, Megatron's GPT); they are not counted as
    parameters (< 0.1%), but adding them and reducing their gradients are memory-bound kernels
    (layer_work.py). ``tied_embeddings``: the output layer reuses the input embedding's
    weights (Megatron's GPT, GPT-2); a pipeline keeps a copy on its last stage and all-reduces
    the two copies' gradients every step (costing.py, ``embedding_sync_s``).
    ``train_model``: what `pipeoffload train --model` takes to train this very model (a Hugging
    Face config.json or its folder, read from there with ``model_type``), None when train can
    only run the reference model at this shape.
    """

    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    vocab: int
    seq_len: int
    mlp: MlpKind = MlpKind.GELU
    flash_attention: bool = True
    activation_bytes: int = 2
    param_bytes: int = 2
    dropout: bool = False
    bias: bool = False
    tied_embeddings: bool = False
    name: str = "custom"
    train_model: str | None = None
    model_type: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mlp", _enum(MlpKind, self.mlp, f"model {self.name!r}: mlp"))
        for field in ("num_layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab",
                      "seq_len", "activation_bytes", "param_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"model {self.name!r}: {field} must be a positive integer, got {value!r}"
                )
        for field in ("flash_attention", "dropout", "bias", "tied_embeddings"):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(
                    f"model {self.name!r}: {field} must be true or false, "
                    f"got {getattr(self, field)!r}"
                )
        if self.hidden % self.heads:
            raise ConfigError(
                f"model {self.name!r}: hidden={self.hidden} is not a multiple of "
                f"heads={self.heads}; pick heads that divide hidden"
            )
        if self.heads % self.kv_heads:
            raise ConfigError(
                f"model {self.name!r}: heads={self.heads} is not a multiple of "
                f"kv_heads={self.kv_heads}; grouped-query attention needs whole groups"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_hidden(self) -> int:
        """Width of K (and of V): kv_heads * head_dim; equals hidden without GQA."""
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class PassFlops:
    """FLOPs of the three passes: forward F, input-gradient backward I, weight-gradient W."""

    f: float
    i: float
    w: float

    @property
    def total(self) -> float:
        return self.f + self.i + self.w

    def __add__(self, other: PassFlops) -> PassFlops:
        return PassFlops(self.f + other.f, self.i + other.i, self.w + other.w)

    def scaled(self, factor: float) -> PassFlops:
        return PassFlops(self.f * factor, self.i * factor, self.w * factor)


def check_run(micro_batch: int, tp: int) -> None:
    """Raise ConfigError unless the microbatch size and TP degree are positive."""
    if micro_batch < 1:
        raise ConfigError(f"micro_batch must be >= 1, got {micro_batch}")
    if tp < 1:
        raise ConfigError(f"tp (tensor-parallel degree) must be >= 1, got {tp}")


def _linear_flops(spec: TransformerSpec, micro_batch: int) -> float:
    """Forward FLOPs of a layer's linear layers: QKV, output projection and MLP."""
    bs, h = micro_batch * spec.seq_len, spec.hidden
    qkv = 2 * bs * h * (h + 2 * spec.kv_hidden)
    out = 2 * bs * h * h
    mlp_matmuls = 3 if spec.mlp is MlpKind.SWIGLU else 2
    return qkv + out + mlp_matmuls * 2 * bs * h * spec.ffn_hidden


def attention_core_flops(spec: TransformerSpec, micro_batch: int) -> float:
    """Forward FLOPs of Q K^T and of softmax(.) V: 2 * (2 b s^2 h), full s x s, no causal skip."""
    return 4 * micro_batch * spec.seq_len**2 * spec.hidden


def layer_flops(
    spec: TransformerSpec,
    micro_batch: int,
    *,
    tp: int = 1,
    count: FlopCount | str = FlopCount.HARDWARE,
) -> PassFlops:
    """F / I / W FLOPs of one transformer layer for ``micro_batch`` sequences on one of ``tp`` GPUs.

    Linear layers: I = W = F (dY W^T and X^T dY each cost one forward matmul). Attention core
    (no weights): I = 2 F (dQ, dK and dP, dV), W = 0; flash attention re-runs Q K^T in I
    (+ half of the core's F) under the HARDWARE count.
    """
    check_run(micro_batch, tp)
    count = as_flop_count(count)
    linear = _linear_flops(spec, micro_batch)
    core = attention_core_flops(spec, micro_batch)
    recompute_scores = core / 2 if spec.flash_attention and count is FlopCount.HARDWARE else 0.0
    return PassFlops(linear + core, linear + 2 * core + recompute_scores, linear).scaled(1 / tp)


def recompute_flops(
    spec: TransformerSpec,
    micro_batch: int,
    recompute: Recompute | str,
    *,
    tp: int = 1,
    count: FlopCount | str = FlopCount.HARDWARE,
) -> float:
    """Forward FLOPs re-run before a layer's backward (HARDWARE count; 0 under MODEL): the whole
    F under FULL; the attention core's under SELECTIVE without flash attention; else 0 (LGD
    re-runs only elementwise work, which is not counted)."""
    recompute = as_recompute(recompute)
    if as_flop_count(count) is FlopCount.MODEL:
        return 0.0
    if recompute is Recompute.FULL:
        return layer_flops(spec, micro_batch, tp=tp, count=count).f
    if recompute is Recompute.SELECTIVE and not spec.flash_attention:
        return attention_core_flops(spec, micro_batch) / tp
    return 0.0


def embedding_flops(spec: TransformerSpec, micro_batch: int, *, tp: int = 1) -> PassFlops:
    """The embedding is a gather (F) and a scatter-add of gradients (W): no matmul FLOPs."""
    check_run(micro_batch, tp)
    return PassFlops(0.0, 0.0, 0.0)


def head_flops(spec: TransformerSpec, micro_batch: int, *, tp: int = 1) -> PassFlops:
    """Output projection to the vocabulary, 2 b s h V per pass (loss softmax not counted)."""
    check_run(micro_batch, tp)
    per_pass = 2 * micro_batch * spec.seq_len * spec.hidden * spec.vocab / tp
    return PassFlops(per_pass, per_pass, per_pass)


def layer_activation_bytes(
    spec: TransformerSpec,
    micro_batch: int,
    recompute: Recompute | str,
    *,
    tp: int = 1,
    sequence_parallel: bool = True,
) -> float:
    """Bytes one layer keeps from its F to its backward, for ``micro_batch`` sequences, on one of
    ``tp`` GPUs. With sequence parallelism every saved tensor is sharded over tp (Korthikanti et
    al. 2022 s4.2.2); without it the norm inputs and outputs and the residual-dropout masks are
    whole on every GPU (their s b h (10 + 24 / t) + 5 a s^2 b / t, section 4.2.1).

    NONE with dropout and no flash attention gives Korthikanti's 34 s b h + 5 a s^2 b (16-bit,
    GeLU, f = 4h, no GQA); LGD with flash attention gives 20 s b h plus the softmax statistics.
    """
    check_run(micro_batch, tp)
    recompute = as_recompute(recompute)
    e, b, s, h, a = spec.activation_bytes, micro_batch, spec.seq_len, spec.hidden, spec.heads
    bsh, bsf, bas2 = b * s * h, b * s * spec.ffn_hidden, b * a * s * s
    whole = 1 if sequence_parallel else tp  # tensors of the residual stream: / tp only with SP
    if recompute is Recompute.FULL:
        return e * bsh * whole / tp
    keep_all = recompute is not Recompute.LGD
    stream = 0.0  # norm inputs and outputs, residual-dropout masks
    sharded = 0.0
    # Attention block: norm input, [norm output = QKV input], Q, K, V, attention output.
    stream += e * bsh + e * bsh * keep_all
    sharded += e * (bsh + 2 * b * s * spec.kv_hidden) + e * bsh
    if spec.flash_attention:
        sharded += SOFTMAX_STAT_BYTES * b * a * s
    elif recompute is not Recompute.SELECTIVE:
        sharded += e * bas2  # softmax output
        if spec.dropout and keep_all:
            sharded += MASK_BYTES * bas2 + e * bas2  # attention-dropout mask and output
    # MLP block: norm input, [norm output = first matmul input].
    stream += e * bsh + e * bsh * keep_all
    if spec.mlp is MlpKind.SWIGLU:
        # gate and up projections; [silu(gate) and the product, the down projection's input]
        sharded += 2 * e * bsf + 2 * e * bsf * keep_all
    else:
        # GeLU input; [GeLU output, the second matmul's input]
        sharded += e * bsf + e * bsf * keep_all
    if spec.dropout and keep_all:
        stream += 2 * MASK_BYTES * bsh  # masks of the two residual dropouts
    return (stream * whole + sharded) / tp


def embedding_activation_bytes(spec: TransformerSpec, micro_batch: int, *, tp: int = 1,
                               sequence_parallel: bool = True) -> float:
    """Token ids (for the gradient scatter-add) and, with dropout, the embedding-dropout mask
    (sharded over tp with sequence parallelism)."""
    check_run(micro_batch, tp)
    bs = micro_batch * spec.seq_len
    shards = tp if sequence_parallel else 1
    return TOKEN_ID_BYTES * bs + (MASK_BYTES * bs * spec.hidden / shards if spec.dropout else 0.0)


def head_activation_bytes(
    spec: TransformerSpec,
    micro_batch: int,
    recompute: Recompute | str,
    *,
    tp: int = 1,
    sequence_parallel: bool = True,
) -> float:
    """Final norm input, [its output, the projection's input, unless recomputed], and the fp32
    softmax the loss keeps (b s V / t elements). Full recompute does not cover the head (as in
    Megatron), so FULL keeps what LGD keeps. The norm's tensors are whole on every GPU without
    sequence parallelism."""
    check_run(micro_batch, tp)
    e, bs = spec.activation_bytes, micro_batch * spec.seq_len
    kept = 2 if as_recompute(recompute) in (Recompute.NONE, Recompute.SELECTIVE) else 1
    norm = e * bs * spec.hidden * kept * (1 if sequence_parallel else tp)
    return (norm + LOSS_BYTES * bs * spec.vocab) / tp


@dataclass(frozen=True)
class ParamCount:
    """Parameters held by one GPU: ``sharded`` ones are split over tp, ``replicated`` (norm
    weights) are not. ``total`` is what that GPU stores."""

    sharded: float
    replicated: float

    @property
    def total(self) -> float:
        return self.sharded + self.replicated

    def __add__(self, other: ParamCount) -> ParamCount:
        return ParamCount(self.sharded + other.sharded, self.replicated + other.replicated)


def layer_params(spec: TransformerSpec, *, tp: int = 1) -> ParamCount:
    """Weights of one layer: Q, K, V, output projection, MLP matrices, two norm weights.

    Biases are not counted (Llama has none; for GPT-3 they are < 0.1% of a layer).
    """
    check_run(1, tp)
    h = spec.hidden
    attention = 2 * h * h + 2 * h * spec.kv_hidden
    mlp = (3 if spec.mlp is MlpKind.SWIGLU else 2) * h * spec.ffn_hidden
    return ParamCount((attention + mlp) / tp, 2 * h)


def embedding_params(spec: TransformerSpec, *, tp: int = 1) -> ParamCount:
    """The V x h input embedding, vocabulary-parallel over tp."""
    check_run(1, tp)
    return ParamCount(spec.vocab * spec.hidden / tp, 0)


def head_params(spec: TransformerSpec, *, tp: int = 1) -> ParamCount:
    """Final norm and the V x h output projection (its own weights, or with tied embeddings a
    copy the last pipeline stage keeps)."""
    check_run(1, tp)
    return ParamCount(spec.vocab * spec.hidden / tp, spec.hidden)


def model_params(spec: TransformerSpec) -> float:
    """All parameters of the model, embedding and output projection counted separately unless
    they are tied."""
    tied = spec.vocab * spec.hidden if spec.tied_embeddings else 0
    return (
        spec.num_layers * layer_params(spec).total
        + embedding_params(spec).total
        + head_params(spec).total
        - tied
    )
