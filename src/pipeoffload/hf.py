"""``pipeoffload.hf``: Hugging Face causal LMs (Llama, Mistral, Qwen2/3, GPT-2) as stages.
Needs the ``hf`` extra (transformers >= 5); see integrations/hf.py for the contract."""

from __future__ import annotations

from pipeoffload.integrations.hf import (
    SUPPORTED_MODEL_TYPES,
    CausalLMStage,
    balanced_layers,
    causal_lm_loss,
    check_causal_lm,
    split_causal_lm,
)

__all__ = ["SUPPORTED_MODEL_TYPES", "CausalLMStage", "balanced_layers", "causal_lm_loss",
           "check_causal_lm", "split_causal_lm"]
