"""Context-parallel attention: each rank holds 1/cp of every sequence (runtime/sequence.py
Note: [causal split]) and attention all-gathers K and V over the context-parallel group, as
Llama 3 trained its long-context stage (Dubey et al. 2024, section 3.3.2: all-gather of K/V,
then attention of the local queries); the all-gather's backward reduce-scatters dK / dV.

Every other part of a layer is per token, so it runs on the rank's tokens unchanged. What a
rank keeps for the backward is then its 1/cp of every activation plus the gathered K and V
(whole sequence, this rank's heads) that the attention saves: parallel/context.py's share of
the planner's activation model (planner/transformer.py, docs/planner-model.md).

With --document-mask the keys are masked by document too: the first stage all-gathers the
ids to number the whole sequence's documents (runtime/sequence.py ``document_segments_of``),
and each attention takes this rank's rows of the document mask (``document_rows``).

``apply_context_parallel`` sets the split on the reference model's stages and on Hugging Face
``CausalLMStage``s (Llama, Mistral, Qwen2, Qwen3: the attention is HF's own module with its
attention function replaced through transformers' AttentionInterface).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pipeoffload.errors import ConfigError
from pipeoffload.hf_families import CONTEXT_PARALLEL_MODEL_TYPES
from pipeoffload.runtime.sequence import SequenceSplit

HF_ATTENTION = "pipeoffload_context_parallel"  # its name in transformers' AttentionInterface


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      split: SequenceSplit, *, scale: float | None = None,
                      window: int | None = None, mask: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys.

    q [batch, heads, local, head_dim], k and v [batch, kv heads, local, head_dim] (rotary
    embeddings applied at the tokens' global positions); returns [batch, heads, local,
    head_dim]. ``window``: a sliding window (a key at most window - 1 positions back).
    ``mask``: [batch, 1, local, seq] bool, True where this rank's query may attend a key of
    the whole sequence (runtime/sequence.py ``document_rows``: --document-mask), applied
    besides the causal one.
    Each of the rank's two chunks attends to the keys up to its own end, causal aligned to
    the lower right (``causal_lower_right``: on GPUs the flash kernel, no mask in memory), and
    K / V stay grouped (``enable_gqa``), so what the attention saves is the gathered K and V
    once, this rank's queries and output, and on CPU a chunk x prefix mask, made here so that
    every rank saves the same bytes (chunk lengths (i + 1) + (2 cp - i) prefixes: Note:
    [causal split]; torch's own would skip the square one).
    """
    from torch.nn.attention.bias import causal_lower_right

    chunk = q.shape[2] // 2
    seq = q.shape[2] * split.cp
    k, v = split.gather(k, 2), split.gather(v, 2)  # [batch, kv heads, seq, hd], in order
    outs = []
    for n, (part, c) in enumerate(zip(q.split(chunk, dim=2), split.chunks(), strict=True)):
        end = (c + 1) * chunk
        allowed: Any = causal_lower_right(chunk, end)
        if q.device.type == "cpu" or mask is not None or (window is not None and window < seq):
            q_pos = torch.arange(c * chunk, end, device=q.device)
            back = q_pos[:, None] - torch.arange(end, device=q.device)[None, :]
            allowed = (back >= 0) & (back < (window if window is not None else seq))
            if mask is not None:  # [batch, 1, chunk, end]
                allowed = allowed & mask[:, :, n * chunk:(n + 1) * chunk, :end]
        outs.append(F.scaled_dot_product_attention(part, k[:, :, :end], v[:, :, :end],
                                                   attn_mask=allowed, scale=scale,
                                                   enable_gqa=True))
    return torch.cat(outs, dim=2)


def _hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None, *,
                  scaling: float | None = None, dropout: float = 0.0,
                  sliding_window: int | None = None, context: SequenceSplit | None = None,
                  **_: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract (integrations/sdpa_attention.py): returns
    ([batch, local, heads, head_dim], no weights)."""
    if context is None:
        raise ConfigError("the context-parallel attention was called without its split; "
                          "run the stage through CausalLMStage with context set")
    if dropout:
        raise ConfigError("context parallelism runs attention without dropout; set the "
                          "model's attention_dropout to 0")
    out = context_attention(query, key, value, context, scale=scaling, window=sliding_window,
                            mask=attention_mask)
    return out.transpose(1, 2).contiguous(), None


def apply_context_parallel(stages: dict[int, nn.Module], split: SequenceSplit) -> None:
    """Make ``stages`` (reference Transformer stages or Hugging Face CausalLMStages) attend
    over ``split``'s group, their tokens at ``split``'s positions (in place)."""
    if split.cp == 1:
        return
    for module in stages.values():
        if hasattr(module, "layer_types"):  # a CausalLMStage
            _apply_hf(module, split)
            continue
        for sub in module.modules():
            if hasattr(sub, "context"):
                cast(Any, sub).context = split  # a plain attribute, not a submodule


def _apply_hf(stage: nn.Module, split: SequenceSplit) -> None:
    from transformers import AttentionInterface

    config: Any = stage.config
    if config.model_type not in CONTEXT_PARALLEL_MODEL_TYPES:
        raise ConfigError(f"context parallelism runs the {', '.join(CONTEXT_PARALLEL_MODEL_TYPES)} "
                          f"families; this model is {config.model_type!r}")
    AttentionInterface.register(HF_ATTENTION, _hf_attention)  # the same function each time
    config._attn_implementation = HF_ATTENTION
    cast(Any, stage).context = split  # a plain attribute, not a submodule
