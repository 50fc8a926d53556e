"""The Hugging Face side of a `pipeoffload train` run: checks before any process starts, this
process's stages, the export at the end (training/hf_model.py, parallel/export.py), and
`pipeoffload export`'s export of such a run's checkpoint."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch

from pipeoffload import hf_families
from pipeoffload.errors import ConfigError
from pipeoffload.integrations.hf_tp_layout import join_shards
from pipeoffload.parallel import checkpoint as ckpt
from pipeoffload.parallel.export import (
    clear_unfinished_export,
    export_dtype,
    export_pretrained,
    write_export,
)
from pipeoffload.parallel.gradients import tie_copy_names
from pipeoffload.parallel.precision import torch_dtype
from pipeoffload.parallel.topology import Topology
from pipeoffload.training.data import vocab_needed
from pipeoffload.training.documents import tokenizer_file
from pipeoffload.training.hf_model import (
    HFStages,
    build_hf_stages,
    hf_config,
    meta_model,
    resolve_model,
)
from pipeoffload.training.hf_model import check_model as check_hf_model
from pipeoffload.training.split import stage_layer_ranges
from pipeoffload.training.train import TrainConfig


def check_model(config: TrainConfig, num_stages: int) -> None:
    """The model fits the layout and the data's tokens fit its vocabulary (before any
    process starts: one error, not one per rank)."""
    needed = vocab_needed(config.data)
    if config.hf_model is None:
        if config.model.n_layers < num_stages:  # said with the flags that set both
            raise ConfigError(f"the reference model's {config.model.n_layers} layers (--layers) "
                              f"cannot fill {num_stages} pipeline stages (--pp {config.pp} x "
                              f"{num_stages // config.pp} stages per rank; each needs a layer); "
                              "lower --pp or --chunks, or raise --layers")
        stage_layer_ranges(config.model.n_layers, num_stages)
        if config.model.vocab_size < needed:
            raise ConfigError(f"the reference model's vocabulary ({config.model.vocab_size}) "
                              f"is smaller than the data's {needed} token ids")
        return
    source = resolve_model(config.hf_model)
    check_hf_model(source, tp=config.tp, recompute=config.recompute,
                   seq_len=config.data.seq_len, vocab_needed=needed, num_stages=num_stages,
                   memory=run_memory(config))
    if config.cp > 1 and source.model_type not in hf_families.CONTEXT_PARALLEL_MODEL_TYPES:
        raise ConfigError(f"--cp {config.cp}: context parallelism runs "
                          f"{', '.join(hf_families.CONTEXT_PARALLEL_MODEL_TYPES)} models; "
                          f"{config.hf_model} is {source.model_type!r}; use --cp 1")
    import pipeoffload.integrations.hf  # noqa: F401 - the [hf] extra, found missing here once


# Weights, gradients and AdamW's two moments per parameter; bf16 adds float32 master weights
# and their gradients (parallel/precision.py).
_BYTES_PER_PARAM = {"fp32": 16, "bf16": 20, "fp64": 32}


def run_memory(config: TrainConfig) -> tuple[int, int, str]:
    """What the whole run needs per parameter (every data-parallel replica holds the model),
    and the memory it has: the GPUs' (one per process) or this machine's."""
    per_param = _BYTES_PER_PARAM[config.dtype] * config.dp * config.cp
    gpus = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if gpus:
        processes = config.processes
        total = torch.cuda.get_device_properties(0).total_memory * processes
        return per_param, total, f"the memory of {processes} GPU(s)"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return per_param, host, "this machine's memory"


def build_hf(config: TrainConfig, num_stages: int, mine: list[int],
             topology: Topology) -> HFStages:
    """This process's stages of the Hugging Face model (Note: [HF stages])."""
    assert config.hf_model is not None
    hf = build_hf_stages(resolve_model(config.hf_model), num_stages, mine, seed=config.seed,
                         dtype=torch_dtype(config.dtype),
                         device=topology.device or torch.device("cpu"),
                         tp_mesh=topology.tp_mesh if topology.tp > 1 else None,
                         recompute=config.recompute)
    for stage in hf.stages.values():  # --document-mask (integrations/hf.py CausalLMStage)
        cast(Any, stage).document_eos = config.model.document_eos
    return hf


def export_run(config: TrainConfig, hf: HFStages, masters: Mapping[int, list[torch.Tensor]],
               topology: Topology) -> Path:
    """``--export-hf``: the trained model as a Hugging Face folder (parallel/export.py); a
    bf16 run exported in fp32 writes its float32 master weights (``masters``: per stage, what
    the optimizer updates, one per trainable parameter)."""
    assert config.export_hf is not None
    name = config.export_dtype or ("bf16" if config.dtype == "bf16" else "fp32")
    values = None
    if config.dtype == "bf16" and name == "fp32":
        values = {id(p): master for s, module in hf.stages.items()
                  for p, master in zip([p for p in module.parameters() if p.requires_grad],
                                       masters[s])}
    tokenizer = None if config.data.tokenizer is None else tokenizer_file(config.data.tokenizer)
    return export_pretrained(config.export_hf, hf.model, hf.stages, topology,
                             dtype=export_dtype(name), values=values, tokenizer=tokenizer)


def export_checkpoint(checkpoint: str | Path, folder: str | Path,
                      dtype_name: str | None = None, tokenizer: str | Path | None = None
                      ) -> tuple[Path, int]:
    """``pipeoffload export``: the checkpoint of a Hugging Face model (a step folder, or a
    checkpoint folder's newest) as an export, in one process; returns the folder and the step.
    The model's config comes from the checkpoint's manifest; tensor-parallel shards are joined
    as integrations/hf_tp_layout.py split them (``join_shards``), a sharded optimizer's
    data-parallel shards as checkpoint.load_stage joins them; a bf16 run exported in fp32
    writes its float32 master weights. ``tokenizer`` (a tokenizer.json or its folder) goes
    with it as ``--export-hf`` writes it."""
    tokenizer = None if tokenizer is None else tokenizer_file(tokenizer)
    manifest = ckpt.read_manifest(ckpt.find_checkpoint(checkpoint, None))
    info = manifest.info
    model_info = info.get("model")
    config = model_info.get("hf_config") if isinstance(model_info, dict) else None
    if not isinstance(config, dict):
        raise ConfigError(f"checkpoint {manifest.folder} holds no Hugging Face config (the "
                          "reference model's, or a save_checkpoint of your own); export writes "
                          "models trained with `pipeoffload train --model PATH`")
    hf_families.check_family(config, str(manifest.folder / ckpt.MANIFEST))
    hf_families.check_values(config, str(manifest.folder / ckpt.MANIFEST))
    run_dtype, tp, num_stages = _layout(manifest)
    name = dtype_name or ("bf16" if run_dtype == "bf16" else "fp32")
    dtype = export_dtype(name)
    model = meta_model(config)
    # Imported here: the reference model's runs (and a minimal install) never need transformers.
    from pipeoffload.integrations.hf import causal_lm_stages

    stages = causal_lm_stages(model, num_stages, range(num_stages))
    names = {id(p): n for n, p in model.named_parameters()}
    copies = tie_copy_names(stages)
    tensors: dict[str, torch.Tensor] = {}
    use_masters = run_dtype == "bf16" and name == "fp32"
    for s, stage in sorted(stages.items()):
        saved = [ckpt.load_stage(manifest, s, t if tp > 1 else None) for t in range(tp)]
        trainable = [n for n, p in stage.named_parameters() if p.requires_grad]
        for local, param in stage.named_parameters():
            full = names[id(param)]
            if (s, local) in copies or full in tensors:
                continue
            if use_masters:
                shards = [part["masters"][trainable.index(local)] for part in saved]
            else:
                shards = [part["model"][local] for part in saved]
            value = join_shards(local, shards)
            if tuple(value.shape) != tuple(param.shape):
                raise ConfigError(f"{manifest.folder}: {full} has shape {list(value.shape)}, "
                                  f"the config makes {list(param.shape)}")
            tensors[full] = value.to(dtype).contiguous()
    return write_export(folder, hf_config(config), [tensors], dtype, tokenizer), manifest.step


def _layout(manifest: ckpt.Manifest) -> tuple[str, int, int]:
    """The run dtype, tensor-parallel size and stage count a checkpoint's manifest records,
    each checked (a manifest edited by hand names the key it got wrong)."""
    info = manifest.info
    where = manifest.folder / ckpt.MANIFEST
    dtype, tp, placement = info.get("dtype", "fp32"), info.get("tp", 1), info.get("stage_to_rank")
    if dtype not in ("fp32", "bf16", "fp64"):
        raise ckpt.CheckpointError(f"{where}: info.dtype is {dtype!r}, not fp32, bf16 or fp64")
    if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= 4096:
        raise ckpt.CheckpointError(f"{where}: info.tp is {tp!r}, not a whole number in 1..4096")
    if (not isinstance(placement, list) or not placement
            or not all(isinstance(r, int) and not isinstance(r, bool) for r in placement)):
        raise ckpt.CheckpointError(f"{where}: info.stage_to_rank is {placement!r}, not a list "
                                   "of pipeline ranks (the manifest was edited or is damaged)")
    return dtype, tp, len(placement)


def finish_export(config: TrainConfig, checkpoint: Path) -> Path:
    """A requeued run whose training is done (its newest checkpoint at ``--steps``) but whose
    ``--export-hf`` was interrupted: remove what the interrupted export left and write it
    again, in this process, from ``checkpoint`` (one weights file, whatever the pipeline)."""
    assert config.export_hf is not None
    clear_unfinished_export(config.export_hf)
    tokenizer = None if config.data.tokenizer is None else tokenizer_file(config.data.tokenizer)
    dtype = config.export_dtype or ("bf16" if config.dtype == "bf16" else "fp32")
    return export_checkpoint(checkpoint, config.export_hf, dtype, tokenizer)[0]
