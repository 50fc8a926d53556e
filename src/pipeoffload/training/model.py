"""Reference decoder-only transformer (Llama-style) for `pipeoffload train` and runtime tests.

RMSNorm, rotary position embeddings, grouped-query causal attention through
``scaled_dot_product_attention``, and a SwiGLU MLP. One module class, ``Transformer``, serves
as both the whole model and a pipeline stage: it holds an optional embedding, a contiguous run
of layers and an optional final norm + head, and its parameter names are the whole model's
names (``layers`` is keyed by the global layer index), so a stage's state dict is a slice of
the full model's. Weights are initialised per component from a seed derived from
(seed, component), never from the global RNG, so how the model is split cannot change them.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import skip_init

from pipeoffload.errors import ConfigError
from pipeoffload.parallel.context import context_attention
from pipeoffload.runtime.sequence import SequenceSplit, document_rows, document_segments_of
from pipeoffload.training.layer_recompute import recomputed
from pipeoffload.training.model_config import RECOMPUTE_MODES, ModelConfig


def derive_seed(seed: int, label: str) -> int:
    """A 63-bit seed from (seed, label), the same in every process and Python version."""
    digest = hashlib.blake2b(f"{seed}:{label}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def rope_angles(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, each [len(positions), head_dim // 2], in float64.

    Feature pair i of position p turns by p * theta^(-2i / head_dim).
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device)
    angles = torch.outer(positions.to(torch.float64), theta ** -(exponents / head_dim))
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate feature pairs (2i, 2i+1) of x [..., seq, head_dim] by the angles of rope_angles.

    A query at position m and a key at position n then have a dot product that depends on
    m - n only, which is what makes the encoding relative. The rotation runs in x's dtype (half
    precision too, as Hugging Face's Llama does), so what it saves (cos and sin) is in x's dtype.
    """
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    pairs = x.unflatten(-1, (-1, 2))  # [..., seq, head_dim/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2)


def document_mask(segments: Tensor) -> Tensor:
    """[batch, 1, seq, seq] bool: query i may attend key j when j <= i in the same document."""
    seq = segments.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=segments.device).tril()
    return (segments[:, None, :, None] == segments[:, None, None, :]) & causal


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in at least float32.

    In half precision the backward keeps only x (half precision) and recomputes the float32
    work (training/layer_recompute.py), as fused norm kernels do; otherwise autograd would keep a
    float32 copy of x, and bf16 activations would not be half the bytes of fp32 ones.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype in (torch.float16, torch.bfloat16):
            return recomputed(lambda h: (self._normalize(h),), (self,), x)[0]
        return self._normalize(x)

    def _normalize(self, x: Tensor) -> Tensor:
        h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) * self.weight


def _linear(in_features: int, out_features: int) -> nn.Linear:
    # skip_init: no default init, so building a model never draws from the global RNG.
    return skip_init(nn.Linear, in_features, out_features, bias=False)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings; under context parallelism
    (``context``, set by parallel/context.py) over the whole sequence's K and V."""

    context: SequenceSplit | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        kv_dim = config.n_kv_heads * config.head_dim
        self.wq = _linear(config.dim, config.dim)
        self.wk = _linear(config.dim, kv_dim)
        self.wv = _linear(config.dim, kv_dim)
        self.wo = _linear(config.dim, config.dim)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Q, K, V projections of the normed input (this rank's heads under tensor parallelism)."""
        return self.wq(x), self.wk(x), self.wv(x)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
               mask: Tensor | None = None) -> Tensor:
        """Rotary embeddings, causal attention (or ``mask``'s: [batch, 1, seq, seq], True where
        a token may attend; under context parallelism this rank's rows of it, [batch, 1,
        seq / cp, seq]) and the output projection.

        Heads are counted from the projections' widths ([batch, seq, heads * head_dim]), so the
        same code runs the local heads of a tensor-parallel shard.
        """
        batch, seq = q.shape[:2]
        q = q.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.context is not None:
            out = context_attention(q, k, v, self.context, mask=mask)
            return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
        group = q.shape[1] // k.shape[1]
        if group > 1:  # [batch, kv heads, seq, hd] -> [batch, heads, seq, hd]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.attend(*self.project(x), cos, sin, mask)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = _linear(config.dim, config.ffn_hidden)
        self.w3 = _linear(config.dim, config.ffn_hidden)
        self.w2 = _linear(config.ffn_hidden, config.dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(*self.up(x))

    def up(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The gate and up projections (w1 x, w3 x)."""
        return self.w1(x), self.w3(x)

    def down(self, gate: Tensor, up: Tensor) -> Tensor:
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attention(norm(x)), then + mlp(norm(.)).

    ``recompute`` "lgd" (set with ``set_layer_recompute``) keeps what the planner's LGD keeps
    (planner/transformer.py, docs/planner-model.md): the norm inputs, Q, K, V, the attention
    output and the MLP's gate and up projections; the norm outputs (the projections' input) and
    silu(gate) * up (the down projection's input) are recomputed in the backward
    (training/layer_recompute.py). "full" keeps only the block's input and re-runs the whole block
    before its backward (the planner's FULL, Megatron's full recompute). The values and the
    gradients are the same as "none", bit for bit (layer_recompute.py Note: [lgd gradient
    sums] says what that takes).
    """

    recompute: str = "none"

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None) -> Tensor:
        if self.recompute == "full":
            return recomputed(lambda h: (self._kept(h, cos, sin, mask),), (self,), x)[0]
        if self.recompute == "lgd":
            return self._lgd(x, cos, sin, mask)
        return self._kept(x, cos, sin, mask)

    def _kept(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))

    def _lgd(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None) -> Tensor:
        # Each region passes its input on to the residual: layer_recompute.py Note: [lgd
        # gradient sums] (bit-for-bit the gradients of recompute none).
        attention, mlp = self.attention, self.feed_forward
        q, k, v, x = recomputed(
            lambda h: (*attention.project(self.attention_norm(h)), h.view_as(h)),
            (self.attention_norm, attention.wq, attention.wk, attention.wv), x)
        x = x + attention.attend(q, k, v, cos, sin, mask)
        gate, up, x = recomputed(lambda h: (*mlp.up(self.ffn_norm(h)), h.view_as(h)),
                                 (self.ffn_norm, mlp.w1, mlp.w3), x)
        (down,) = recomputed(lambda g, u: (mlp.down(g, u),), (mlp.w2,), gate, up)
        return x + down


def set_layer_recompute(module: nn.Module, mode: str) -> None:
    """Set what every TransformerBlock of ``module`` keeps for its backward: everything
    ("none"), all but its norm and activation-function outputs ("lgd"), or its input ("full").
    The embedding and the head are not recomputed (as in Megatron and the planner's model)."""
    if mode not in RECOMPUTE_MODES:
        raise ConfigError(f"recompute {mode!r}: choose one of {', '.join(RECOMPUTE_MODES)}")
    for block in module.modules():
        if isinstance(block, TransformerBlock):
            block.recompute = mode


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it: one tensor in, one tensor out.

    With the embedding, ``forward`` takes token ids [batch, seq] (int64); otherwise hidden
    states [batch, seq, dim]. With the head it returns logits [batch, seq, vocab]; otherwise
    hidden states. Parameter names match the full model's (``layers.<global index>.…``).
    Build it through ``build_full_model`` / ``build_stage_modules`` (pipeoffload.training.split),
    which also initialise the weights; the constructor leaves them uninitialised.
    """

    #: Sequence-parallel degree: hidden states are [batch, seq / sequence_shards, dim] shards
    #: (set by training/tensor_parallel.py); rotary positions count the whole sequence.
    sequence_shards: int = 1
    #: Context parallelism (parallel/context.py): the hidden states are this rank's tokens of
    #: each sequence (runtime/sequence.py Note: [causal split]), at their global positions.
    context: SequenceSplit | None = None

    def __init__(
        self, config: ModelConfig, layer_ids: Iterable[int], *, embedding: bool, head: bool
    ) -> None:
        super().__init__()
        self.config = config
        self.layer_ids = tuple(layer_ids)
        bad = [i for i in self.layer_ids if not 0 <= i < config.n_layers]
        if bad:
            raise ConfigError(f"layer {bad[0]} does not exist; the model has {config.n_layers}")
        self.tok_embeddings = (
            skip_init(nn.Embedding, config.vocab_size, config.dim) if embedding else None
        )
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config) for i in self.layer_ids})
        self.norm = RMSNorm(config.dim, config.norm_eps) if head else None
        self.output = _linear(config.dim, config.vocab_size) if head else None

    @property
    def has_embedding(self) -> bool:
        return self.tok_embeddings is not None

    @property
    def has_head(self) -> bool:
        return self.output is not None

    def forward(self, x: Tensor, segments: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Logits (the head's stage), hidden states, or with ``document_eos`` hidden states and
        the document ``segments`` [batch, seq] that the next stage masks attention by."""
        if self.tok_embeddings is not None:
            if x.dim() != 2 or x.dtype.is_floating_point:
                raise ConfigError(
                    f"the embedding stage takes token ids [batch, seq] (int64), got "
                    f"{x.dtype} {list(x.shape)}"
                )
            if self.config.document_eos is not None:  # of the whole sequence under cp
                segments = document_segments_of(x, self.config.document_eos, self.context)
            x = self.tok_embeddings(x)  # [batch, seq, dim]
        elif x.dim() != 3 or x.shape[-1] != self.config.dim:
            raise ConfigError(
                f"stage with layers {list(self.layer_ids)} takes hidden states "
                f"[batch, seq, {self.config.dim}], got {list(x.shape)}"
            )
        seq = x.shape[1] * self.sequence_shards  # x is a sequence shard under TP (+ SP)
        cp = self.context.cp if self.context is not None else 1
        seq *= cp  # and this rank's 1/cp of it under context parallelism
        if seq > self.config.max_seq_len:
            raise ConfigError(
                f"sequence length {seq} exceeds max_seq_len={self.config.max_seq_len}; "
                "use shorter sequences or a config with a larger max_seq_len"
            )
        if self.layers:
            positions = (torch.arange(seq, device=x.device) if self.context is None
                         else self.context.positions(seq, x.device))
            cos, sin = rope_angles(positions, self.config.head_dim, self.config.rope_theta)
            mask = None
            if segments is not None:  # [batch, 1, seq (this rank's under cp), seq]
                mask = (document_mask(segments) if self.context is None
                        else document_rows(segments, self.context))
            for layer in self.layers.values():
                x = layer(x, cos, sin, mask)
        if self.output is not None and self.norm is not None:
            return self.output(self.norm(x))  # [batch, seq, vocab]
        return x if segments is None else (x, segments)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter from generators seeded by (seed, component name).

        Components are the embedding, each layer (by global index), the final norm and the
        head; values are drawn in float32 on the CPU and then copied, so they do not depend on
        the stage split, the device or the dtype (float64 holds the same values exactly).
        """
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        components: list[tuple[str, nn.Module]] = [(f"layers.{i}", self.layers[str(i)])
                                                    for i in self.layer_ids]
        for name in ("tok_embeddings", "norm", "output"):
            if getattr(self, name) is not None:
                components.append((name, getattr(self, name)))
        for component, module in components:
            generator = torch.Generator().manual_seed(derive_seed(seed, component))
            for name, param in sorted(module.named_parameters()):
                if param.dim() == 1:  # norm gains
                    param.fill_(1.0)
                    continue
                scale = residual_std if name.endswith(("wo.weight", "w2.weight")) else std
                values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
                param.copy_(values * scale)


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy of logits [batch, seq, vocab] against targets [batch, seq].

    Half-precision logits are upcast to float32 first; other dtypes are kept.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
