"""Hugging Face causal LMs as pipeline stages: ``split_causal_lm`` and ``causal_lm_loss``.

    model = LlamaForCausalLM(config).double()
    stages = split_causal_lm(model, schedule)               # {stage: module}, every stage
    pipe = Pipeline(stages, schedule, causal_lm_loss)
    loss = pipe.step({"input_ids": ids, "attention_mask": mask}, target=ids)

Stages share the model's modules and parameters (nothing is copied). Each stage makes what HF's
``*Model.forward`` makes once for all layers: position ids, rotary embeddings and the causal (or
sliding-window) mask, from the hidden states it receives and the padding mask carried along as
a tensor. Tied input / output embeddings are declared on every stage (``tied_parameters``:
the first stage's embedding and the last stage's head), so Pipeline sums their gradients across
ranks (Note: [tied parameters], runtime/tied.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from pipeoffload.core.schedule import Schedule
from pipeoffload.errors import ConfigError, IntegrationError
from pipeoffload.hf_families import SUPPORTED_MODEL_TYPES
from pipeoffload.runtime.blocks import balanced_ranges
from pipeoffload.runtime.inputs import document_positions
from pipeoffload.runtime.sequence import document_rows, document_segments_of

# SUPPORTED_MODEL_TYPES: ``config.model_type`` values whose decoder layout split_causal_lm knows
# and tests cover: Llama-family (model.embed_tokens / layers / norm / rotary_emb, lm_head) and
# GPT-2 (transformer.wte / wpe / drop / h / ln_f, lm_head).

try:
    import transformers
    from transformers.masking_utils import (
        create_causal_mask,
        create_sliding_window_causal_mask,
    )
except ImportError as error:  # pragma: no cover - depends on the environment
    raise IntegrationError(
        "pipeoffload.hf needs Hugging Face transformers >= 5: pip install 'pipeoffload[hf]'"
    ) from error

if int(transformers.__version__.split(".")[0]) < 5:  # pragma: no cover
    raise IntegrationError(f"pipeoffload.hf is tested with transformers 5.x; this is "
                           f"{transformers.__version__}: pip install 'transformers>=5'")

_MASKS = {"full_attention": create_causal_mask,
          "sliding_attention": create_sliding_window_causal_mask}
_TIE = "embed_tokens.weight"


class CausalLMStage(nn.Module):
    """Decoder layers ``[first_layer, first_layer + len(layers))`` of a causal LM, with the
    embedding on the first stage and the final norm and head on the last.

    Inputs: first stage ``(input_ids, attention_mask=None)`` (or keywords), others ``(hidden,
    attention_mask=None)``; returns ``(hidden, attention_mask)`` when a mask came in, else
    ``hidden``; the last stage returns the logits ``[batch, seq, vocab]``. With
    ``document_eos`` set (on every stage) attention is masked by document: the first stage
    computes each token's document from the ids (runtime/inputs.py ``document_segments``) and
    sends it on in the mask's place, and every stage gives each token its position within its
    document, from which transformers' mask functions build the packed-sequence causal mask
    (and rotary positions restart per document, as if each were its own row).
    """

    def __init__(self, config: Any, layers: Sequence[nn.Module], first_layer: int,
                 rotary: nn.Module | None, embed: nn.Module | None = None,
                 norm: nn.Module | None = None, head: nn.Module | None = None,
                 positions: nn.Module | None = None, dropout: nn.Module | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = embed
        self.embed_positions = positions  # GPT-2's learnt positions (first stage), else None
        self.embed_dropout = dropout
        self.layers = nn.ModuleList(layers)
        self.layer_types = [_layer_type(config, first_layer + i) for i in range(len(layers))]
        self.rotary_emb = rotary  # Llama family: rotary embeddings made on every stage
        self.norm = norm
        self.lm_head = head
        self.tied_parameters: dict[str, dict[int, str]] = {}  # Note: [tied parameters]
        self.document_eos: int | None = None  # set on every stage: see the class docstring
        # A runtime/sequence.py SequenceSplit under context parallelism (parallel/context.py
        # apply_context_parallel): the hidden states are this rank's tokens.
        self.context: Any = None

    def forward(self, hidden: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, *,
                input_ids: torch.Tensor | None = None) -> Any:
        if self.embed_tokens is not None:
            # stage 0: token ids [batch, seq], positional or as HF's input_ids keyword
            ids = hidden if input_ids is None else input_ids
            if self.document_eos is not None and ids is not None:  # whole sequence's under cp
                attention_mask = document_segments_of(ids, self.document_eos, self.context)
            hidden = self.embed_tokens(ids)
        if hidden is None:
            raise TypeError("CausalLMStage.forward: give the hidden states (token ids, or "
                            "input_ids=, on the first stage)")
        if self.context is not None:
            return self._forward_context(hidden, attention_mask)
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        padding = attention_mask
        if self.document_eos is not None and attention_mask is not None:
            positions, padding = document_positions(attention_mask), None
        if self.embed_positions is not None:
            hidden = hidden + self.embed_positions(positions)
        if self.embed_dropout is not None:
            hidden = self.embed_dropout(hidden)
        extra = {}
        if self.rotary_emb is not None:
            extra = {"position_ids": positions,
                     "position_embeddings": self.rotary_emb(hidden, position_ids=positions)}
        masks = {kind: _MASKS[kind](self.config, hidden, padding, None,
                                    position_ids=positions)
                 for kind in set(self.layer_types)}
        for layer, kind in zip(self.layers, self.layer_types):
            hidden = layer(hidden, attention_mask=masks[kind], **extra)
            if isinstance(hidden, tuple):
                hidden = hidden[0]
        if self.lm_head is not None and self.norm is not None:  # the last stage has both
            return self.lm_head(self.norm(hidden))
        return hidden if attention_mask is None else (hidden, attention_mask)

    def _forward_context(self, hidden: torch.Tensor, segments: torch.Tensor | None) -> Any:
        """The layers on this rank's tokens at their global positions (with ``document_eos``,
        at their positions in their documents, and ``segments`` [batch, seq]: the whole
        sequence's documents); the causal (or sliding-window) mask is the context-parallel
        attention's own (parallel/context.py), and so is the document mask's rows."""
        if (segments is not None and self.document_eos is None) or self.rotary_emb is None:
            raise ConfigError("context parallelism runs rotary-embedding models on whole "
                              "sequences without a padding mask")
        seq = hidden.shape[1] * self.context.cp
        positions = self.context.positions(seq, hidden.device).unsqueeze(0)
        rows = None
        if segments is not None:
            positions = self.context.shard(document_positions(segments), 1)
            rows = document_rows(segments, self.context)  # [batch, 1, seq / cp, seq]
        extra = {"position_ids": positions, "context": self.context,
                 "position_embeddings": self.rotary_emb(hidden, position_ids=positions)}
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=rows, **extra)
            if isinstance(hidden, tuple):
                hidden = hidden[0]
        if self.lm_head is not None and self.norm is not None:
            return self.lm_head(self.norm(hidden))
        return hidden if segments is None else (hidden, segments)


def _layer_type(config: Any, index: int) -> str:
    types = getattr(config, "layer_types", None)
    if types:
        return types[index]
    if config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        return "sliding_attention"
    return "full_attention"


def balanced_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges per stage, sizes differing by at most one (earlier stages get
    the extra layers; the last stage also carries the head)."""
    return balanced_ranges(num_layers, num_stages, "decoder layers")


def check_causal_lm(model_or_config: Any) -> str:
    """The ``model_type`` of a model (or its config) that split_causal_lm knows; raises
    IntegrationError otherwise. Call it before creating any process group, so an unsupported
    model is refused once, not by every rank of the job."""
    if not (isinstance(model_or_config, nn.Module)
            or any(hasattr(model_or_config, a) for a in ("config", "model_type"))):
        raise TypeError(f"expected a transformers model or its config, got "
                        f"{type(model_or_config).__name__} {model_or_config!r:.60}")
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise IntegrationError(
            f"split_causal_lm knows {', '.join(SUPPORTED_MODEL_TYPES)} causal LMs; got "
            f"{type(model_or_config).__name__} with model_type {model_type!r}. Write the stage "
            "modules yourself (docs/runtime.md, stage contract)")
    return model_type


def split_causal_lm(model: nn.Module, schedule: Schedule,
                    rank: int | None = None) -> dict[int, nn.Module]:
    """``{stage: CausalLMStage}`` for ``schedule``'s stages (all, or those on ``rank``).

    ``model`` is a ``*ForCausalLM`` (or GPT2LMHeadModel) of SUPPORTED_MODEL_TYPES: embedding
    first, final norm and head last, decoder layers balanced. The stages share ``model``'s
    parameters; with tied embeddings the first and last stage hold the same Parameter and
    declare the tie, so Pipeline keeps their gradients whole when they sit on different ranks.
    """
    check_causal_lm(model)
    if rank is not None and not 0 <= rank < schedule.num_ranks:
        raise ConfigError(f"rank={rank}, but schedule {schedule.name!r} has ranks "
                          f"0..{schedule.num_ranks - 1}")
    wanted = range(schedule.num_stages) if rank is None else schedule.stages_on_rank(rank)
    return causal_lm_stages(model, schedule.num_stages, wanted)


def causal_lm_stages(model: nn.Module, num_stages: int,
                     wanted: Sequence[int]) -> dict[int, nn.Module]:
    """split_causal_lm without a schedule: the ``wanted`` stages of ``num_stages``."""
    model_type = check_causal_lm(model)
    gpt2 = model_type == "gpt2"
    inner = getattr(model, "transformer" if gpt2 else "model", None)
    head = getattr(model, "lm_head", None)
    if inner is None or head is None:
        raise IntegrationError(
            f"{type(model).__name__} (model_type {model_type!r}) has no "
            f"{'transformer' if gpt2 else 'model'} and lm_head; pass the *ForCausalLM model")
    layers = inner.h if gpt2 else inner.layers
    embed = inner.wte if gpt2 else inner.embed_tokens
    norm = inner.ln_f if gpt2 else inner.norm
    last = num_stages - 1
    ranges = balanced_layers(len(layers), num_stages)
    tied = head.weight is embed.weight
    stages: dict[int, nn.Module] = {}
    for s in wanted:
        stage = CausalLMStage(
            model.config, [layers[i] for i in ranges[s]], ranges[s].start,
            None if gpt2 else inner.rotary_emb,
            embed=embed if s == 0 else None,
            norm=norm if s == last else None, head=head if s == last else None,
            positions=inner.wpe if gpt2 and s == 0 else None,
            dropout=inner.drop if gpt2 and s == 0 else None)
        if tied:  # on every stage, so that every rank knows where the tie lives
            stage.tied_parameters[_TIE] = {0: "embed_tokens.weight", last: "lm_head.weight"}
        stages[s] = stage
    return stages


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor,
                   ignore_index: int = -100) -> torch.Tensor:
    """Next-token cross entropy: position t predicts label t+1; labels equal to
    ``ignore_index`` (padding) are left out of the mean. Computed in ``logits``' dtype (HF
    upcasts to float32; keeping float64 keeps exactness tests exact)."""
    for name, value in (("logits", logits), ("labels", labels)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"causal_lm_loss: {name} must be a torch.Tensor, got "
                            f"{type(value).__name__}")
    vocab = logits.shape[-1]
    shifted = logits[:, :-1].reshape(-1, vocab)
    targets = labels[:, 1:].reshape(-1).to(logits.device)
    return nn.functional.cross_entropy(shifted, targets, ignore_index=ignore_index)
