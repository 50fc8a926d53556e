"""Hugging Face exports: a folder that ``transformers.AutoModelForCausalLM.from_pretrained``
loads, consolidated from every pipeline stage and tensor-parallel shard, in safetensors.

Layout: ``config.json`` (the model's config, ``dtype`` set to the export's), and the weights
by their full-model names: ``model.safetensors`` when one process writes them all (one
pipeline rank, or ``pipeoffload export``), else one ``model-<r>-of-<pp>.safetensors`` per
pipeline rank (its stages, written by its tensor-parallel rank 0 of replica 0 after the
shards are gathered) and ``model.safetensors.index.json``. A tie is written once, from its
lowest stage (parallel/gradients.py tie_copy_names), and the config's
``tie_word_embeddings`` ties it again on loading. Every file is written atomically (Note:
[atomic checkpoint]); config.json and the index come last, after every rank's weights.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipeoffload.errors import ConfigError, writing
from pipeoffload.integrations.hf_tp_layout import hf_order
from pipeoffload.parallel import arguments
from pipeoffload.parallel import checkpoint as ckpt
from pipeoffload.parallel.dtype_names import EXPORT_DTYPE_NAMES
from pipeoffload.parallel.gradients import tie_copy_names
from pipeoffload.parallel.precision import DTYPES
from pipeoffload.parallel.tokenizer_files import CONFIG, SPECIAL, tokenizer_files
from pipeoffload.runtime.shards import is_dtensor

INDEX = "model.safetensors.index.json"


def check_export_folder(folder: str | Path, flag: str = "--export-hf") -> None:
    """An export goes to a new or empty folder, so nothing stale is mixed into it."""
    path = Path(folder)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ConfigError(f"{flag} {folder}: the folder exists and is not empty; pass a new or "
                          "empty folder (an export never mixes with older files)")


#: What an export writes of the tokenizer (parallel/tokenizer_files.py).
TOKENIZER_FILES = ("tokenizer.json", CONFIG, SPECIAL)
_EXPORT_FILE = re.compile(
    r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|config\.json|"
    + "|".join(map(re.escape, TOKENIZER_FILES)) + r"|\..+\.tmp)$")


def export_complete(folder: str | Path) -> bool:
    """Whether ``folder`` holds a finished export: config.json is written last."""
    return (Path(folder) / "config.json").is_file()


def clear_unfinished_export(folder: str | Path, flag: str = "--export-hf") -> None:
    """Remove what an interrupted export left in ``folder`` (weights, index, tokenizer,
    temporary files: only names an export writes, only plain files), so it can be written
    again; any other file there is refused, named, and left alone."""
    path = Path(folder)
    if not path.exists():
        return
    if not path.is_dir() or path.is_symlink():
        raise ConfigError(f"{flag} {folder}: not a folder; pass a new or empty folder")
    children = sorted(path.iterdir())
    foreign = [c.name for c in children if not _EXPORT_FILE.match(c.name) or c.is_symlink()
               or not c.is_file()]
    if foreign:
        raise ConfigError(f"{flag} {folder}: holds an unfinished export and {foreign[0]!r}, "
                          "which no export writes; move it away or pass another folder")
    for child in children:
        child.unlink()


def export_dtype(name: str) -> torch.dtype:
    if name not in EXPORT_DTYPE_NAMES:
        raise ConfigError(f"export dtype {name!r}: choose one of {', '.join(EXPORT_DTYPE_NAMES)}")
    return DTYPES[name]


def stage_tensors(model: nn.Module, stages: Mapping[int, nn.Module], dtype: torch.dtype,
                  values: Mapping[int, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """{full-model name: tensor on the CPU in ``dtype``} of the stages' parameters, each tie
    once; ``values`` replaces parameters by id (float32 master weights). DTensors are
    gathered whole (a collective over their tensor-parallel group, in the same order on every
    rank of it) and put back in Hugging Face's layout (integrations/hf_tp_layout.py hf_order)."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    copies = tie_copy_names(stages)
    tensors: dict[str, torch.Tensor] = {}
    for s in sorted(stages):
        for local, param in stages[s].named_parameters():
            full = names[id(param)]
            if (s, local) in copies or full in tensors:
                continue
            value = param if values is None else values.get(id(param), param)
            if is_dtensor(value):
                sharded: Any = value
                value = hf_order(local, sharded.full_tensor(), sharded.device_mesh.size())
            tensors[full] = value.detach().to(device="cpu", dtype=dtype).contiguous()
    return tensors


def _safetensors_bytes(tensors: Mapping[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(dict(sorted(tensors.items())), metadata={"format": "pt"})


def _write_config(folder: Path, config: Any, dtype: torch.dtype,
                  token_ids: Mapping[str, int] | None = None) -> None:
    values = {**json.loads(config.to_json_string()), **(token_ids or {})}
    values["dtype"] = str(dtype).removeprefix("torch.")
    values.pop("torch_dtype", None)
    ckpt.write_atomic(folder / "config.json",
                      (json.dumps(values, indent=2, sort_keys=True) + "\n").encode())


def write_export(folder: str | Path, config: Any, parts: list[dict[str, torch.Tensor]],
                 dtype: torch.dtype, tokenizer: str | Path | None = None) -> Path:
    """Write an export from one process: ``parts`` are the weight files' contents."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    files = _part_names(len(parts))
    weight_map = {}
    for name, tensors in zip(files, parts):
        ckpt.write_atomic(folder / name, _safetensors_bytes(tensors))
        weight_map.update({key: name for key in tensors})
    _finish(folder, config, dtype, weight_map, sum(_nbytes(p) for p in parts), tokenizer)
    return folder


def _part_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _finish(folder: Path, config: Any, dtype: torch.dtype, weight_map: dict[str, str],
            total_bytes: int, tokenizer: str | Path | None) -> None:
    """The index (several weight files), the tokenizer and config.json, last; refused if a
    file no export writes appeared in the folder meanwhile (it would sit beside the export)."""
    several = len(set(weight_map.values())) > 1
    ours = set(weight_map.values()) | {"config.json"} | ({INDEX} if several else set()) | (
        set(TOKENIZER_FILES) if tokenizer is not None else set())
    strangers = sorted(c.name for c in folder.iterdir() if c.name not in ours)
    if strangers:
        raise ConfigError(f"export folder {folder}: {strangers[0]!r} appeared there while the "
                          "export was written; an export never mixes with other files, so "
                          "move it away and export again (pipeoffload export CHECKPOINT DIR)")
    if several:
        index = {"metadata": {"total_size": total_bytes},
                 "weight_map": dict(sorted(weight_map.items()))}
        ckpt.write_atomic(folder / INDEX, (json.dumps(index, indent=2) + "\n").encode())
    token_ids: dict[str, int] = {}
    if tokenizer is not None:
        files, token_ids = tokenizer_files(tokenizer, json.loads(config.to_json_string()))
        for name, contents in files.items():
            with writing(folder / name):
                ckpt.write_atomic(folder / name, contents)
    _write_config(folder, config, dtype, token_ids)


def export_pretrained(folder: str | Path, model: nn.Module, stages: Mapping[int, nn.Module],
                      topology: Any = None, *, dtype: torch.dtype = torch.float32,
                      values: Mapping[int, torch.Tensor] | None = None,
                      tokenizer: str | Path | None = None) -> Path:
    """Export the model ``stages`` were cut from (``model``: the ``*ForCausalLM`` whose
    ``named_parameters`` name them; split_causal_lm's or train's), with the ``tokenizer``
    (a tokenizer.json) if given, its tokenizer_config.json and special_tokens_map.json copied
    or generated (parallel/tokenizer_files.py). Under torch.distributed (``topology``, a
    parallel/topology.py Topology) every process calls it: tensor-parallel shards are
    gathered, each pipeline rank writes its stages, global rank 0 the index and config last.
    ``folder`` must be new or empty (checked again at the end: files copied in meanwhile are
    named, not left beside the export)."""
    arguments.float_dtype("dtype", dtype)
    arguments.stage_modules("stages", stages)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be the nn.Module the stages were cut from, got "
                        f"{type(model).__name__}")
    check_export_folder(folder, "folder")
    folder = Path(folder)
    tensors = stage_tensors(model, stages, dtype, values)
    if topology is None or not topology.distributed:
        return write_export(folder, model.config, [tensors], dtype, tokenizer)
    writer = topology.dp_index == 0 and topology.tp_index == 0
    name = _part_names(topology.pp)[topology.pp_rank]
    if topology.rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    mine: dict[str, Any] = {}
    if writer:
        ckpt.write_atomic(folder / name, _safetensors_bytes(tensors))
        mine = {"names": sorted(tensors), "file": name, "bytes": _nbytes(tensors)}
    everyone = ckpt._gather_json(mine)
    if topology.rank == 0:
        weight_map = {key: part["file"] for part in everyone if part for key in part["names"]}
        total = sum(part["bytes"] for part in everyone if part)
        _finish(folder, model.config, dtype, weight_map, total, tokenizer)
    dist.barrier()
    return folder
