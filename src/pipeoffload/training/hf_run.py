"""The Hugging Face side of a `pipeoffload train` run: checks before any process starts, this
process's stages, and the export at the end (training/hf_model.py, training/export.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeoffload.errors import ConfigError
from pipeoffload.training.data import vocab_needed
from pipeoffload.training.export import export_dtype, export_pretrained
from pipeoffload.training.hf_model import HFStages, build_hf_stages, resolve_model
from pipeoffload.training.hf_model import check_model as check_hf_model
from pipeoffload.training.launch import Topology
from pipeoffload.training.precision import MasterWeights, torch_dtype
from pipeoffload.training.split import stage_layer_ranges

if TYPE_CHECKING:
    from pipeoffload.training.train import TrainConfig


def check_model(config: TrainConfig, num_stages: int) -> None:
    """The model fits the layout and the data's tokens fit its vocabulary (before any
    process starts: one error, not one per rank)."""
    needed = vocab_needed(config.data)
    if config.hf_model is None:
        stage_layer_ranges(config.model.n_layers, num_stages)
        if config.model.vocab_size < needed:
            raise ConfigError(f"the reference model's vocabulary ({config.model.vocab_size}) "
                              f"is smaller than the data's {needed} token ids")
        return
    check_hf_model(resolve_model(config.hf_model), tp=config.tp, recompute=config.recompute,
                   seq_len=config.data.seq_len, vocab_needed=needed, num_stages=num_stages)


def build_hf(config: TrainConfig, num_stages: int, mine: list[int],
             topology: Topology) -> HFStages:
    """This process's stages of the Hugging Face model (Note: [HF stages])."""
    return build_hf_stages(resolve_model(config.hf_model), num_stages, mine, seed=config.seed,
                           dtype=torch_dtype(config.dtype), device=topology.device,
                           tp_mesh=topology.tp_mesh if topology.tp > 1 else None,
                           recompute=config.recompute)


def export_run(config: TrainConfig, hf: HFStages, masters: MasterWeights,
               topology: Topology) -> Any:
    """``--export-hf``: the trained model as a Hugging Face folder (training/export.py); a
    bf16 run exported in fp32 writes its float32 master weights."""
    name = config.export_dtype or ("bf16" if config.dtype == "bf16" else "fp32")
    values = None
    if masters.mixed and name == "fp32":
        values = {id(p): master for s, module in hf.stages.items()
                  for p, master in zip([p for p in module.parameters() if p.requires_grad],
                                       masters.params[s])}
    return export_pretrained(config.export_hf, hf.model, hf.stages, topology,
                             dtype=export_dtype(name), values=values,
                             tokenizer=config.data.tokenizer)
