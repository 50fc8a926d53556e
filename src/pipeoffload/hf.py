"""``pipeoffload.hf``: Hugging Face causal LMs (Llama, Mistral, Qwen2/3, GPT-2) as stages, and
back: ``export_pretrained`` writes the trained stages as a folder ``from_pretrained`` loads.
Needs the ``hf`` extra (transformers >= 5); see integrations/hf.py for the contract and
parallel/export.py for the export."""

from __future__ import annotations

from pipeoffload.integrations.hf import (
    SUPPORTED_MODEL_TYPES,
    CausalLMStage,
    balanced_layers,
    causal_lm_loss,
    check_causal_lm,
    split_causal_lm,
)
from pipeoffload.parallel.export import export_pretrained

__all__ = ["SUPPORTED_MODEL_TYPES", "CausalLMStage", "balanced_layers", "causal_lm_loss",
           "check_causal_lm", "export_pretrained", "split_causal_lm"]
