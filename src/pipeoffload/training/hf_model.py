"""Hugging Face causal LMs in `pipeoffload train --model PATH`: where the model comes from, the
checks made before any process starts, and this process's stage modules.

PATH is a ``config.json`` (random init) or a folder holding one, whose ``model.safetensors``
or sharded ``model-*.safetensors`` with ``model.safetensors.index.json`` are loaded when
present (fine-tuning). Families: pipeoffload.hf_families.SUPPORTED_MODEL_TYPES.

Note: [HF stages] The model is built on the meta device (no memory, no init) and split with
pipeoffload.hf's ``causal_lm_stages``; then only this process's stages get real tensors, each
parameter filled by its full-model name (``model.layers.3.mlp.up_proj.weight``): from the
weight files, or drawn from a generator seeded by (seed, name) with the init Hugging Face's
``_init_weights`` gives these families (normal(0, initializer_range) for matrices, GPT-2's
residual projections scaled by 1/sqrt(2 * layers), ones for norm gains, zeros for biases). So
every layout (pp, tp, dp, schedule) starts from the same weights. Tied input and output
embeddings become one copy per stage holding them (Pipeline sums their gradients, Note: [tied
parameters]; equal updates keep the copies equal), so optimizers never share a tensor.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from pipeoffload import hf_families
from pipeoffload.errors import ConfigError
from pipeoffload.training.layer_recompute import recomputed
from pipeoffload.training.model import derive_seed

CONFIG = "config.json"
SINGLE_WEIGHTS = "model.safetensors"
WEIGHT_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class HFModelSource:
    """A model named by ``--model PATH``: its config (as read) and weight files (none: random
    init), with ``weight_map`` from each weight's full name to its file."""

    path: str
    config_file: str
    config: dict[str, Any] = field(repr=False)
    weight_map: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def has_weights(self) -> bool:
        return bool(self.weight_map)

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type"))

    @property
    def vocab_size(self) -> int:
        return int(hf_families.sizes(self.config)["vocab_size"])

    @property
    def max_positions(self) -> int:
        return int(hf_families.sizes(self.config)["positions"])

    def describe(self) -> str:
        sizes = hf_families.sizes(self.config)
        weights = (f"weights from {len(set(self.weight_map.values()))} safetensors file(s)"
                   if self.has_weights else "random init")
        return (f"{self.model_type} {sizes['layers']} layers, vocab {sizes['vocab_size']} "
                f"({self.path}, {weights})")


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as error:
        raise ConfigError(f"cannot read {what} {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} is not UTF-8 text") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}:{error.lineno}:{error.colno}: {what} is not valid JSON "
                          f"({error.msg})") from None


def resolve_model(path: str) -> HFModelSource:
    """Find the config and weights ``--model PATH`` names; ConfigError if they are missing,
    unreadable or of a family split_causal_lm does not know."""
    given = Path(path)
    if not given.exists():
        raise ConfigError(f"--model {path}: not a model preset (tiny, small, medium) nor an "
                          "existing file or folder; pass a preset, a Hugging Face config.json or "
                          "a folder holding one")
    folder = given if given.is_dir() else None
    config_file = given / CONFIG if folder is not None else given
    if not config_file.is_file():
        raise ConfigError(f"--model {path}: the folder has no {CONFIG}; pass a folder saved by "
                          "save_pretrained / pipeoffload export, or the config.json itself")
    config = _read_json(config_file, "model config")
    if not isinstance(config, dict):
        raise ConfigError(f"{config_file}: expected a JSON object (a Hugging Face config.json)")
    hf_families.check_family(config, str(config_file))
    hf_families.check_values(config, str(config_file))
    weight_map: dict[str, str] = {}
    if folder is not None:
        weight_map = _weight_map(folder)
        if not weight_map and any(folder.glob("*.bin")):
            raise ConfigError(f"--model {path}: only safetensors weights are read, and the "
                              "folder has none (it holds *.bin files); convert them, or pass "
                              "its config.json for a random init")
    return HFModelSource(path=path, config_file=str(config_file), config=config,
                         weight_map=weight_map)


def _weight_map(folder: Path) -> dict[str, str]:
    """{full weight name: safetensors file} of a folder (empty: no weights)."""
    index = folder / WEIGHT_INDEX
    if index.is_file():
        body = _read_json(index, "weight index")
        files = body.get("weight_map") if isinstance(body, dict) else None
        if not isinstance(files, dict):
            raise ConfigError(f"{index}: no \"weight_map\" object of weight name -> file")
        _check_index_entries(index, files)
        missing = sorted({f for f in files.values() if not (folder / f).is_file()})
        if missing:
            raise ConfigError(f"{index} names weight files that are missing: {missing[:3]}")
        return {name: str(folder / f) for name, f in files.items()}
    single = folder / SINGLE_WEIGHTS
    if not single.is_file():
        return {}
    from safetensors import safe_open

    try:
        with safe_open(str(single), framework="pt") as f:
            return {name: str(single) for name in f.keys()}
    except Exception as error:
        raise ConfigError(f"{single} is not a readable safetensors file ({error})") from None


def _check_index_entries(index: Path, files: Mapping[Any, Any]) -> None:
    """Every entry of a weight index maps a name to a file inside the index's folder: an entry
    that is not a string, or a path that leaves the folder (``../x``, ``/etc/passwd``, a
    symlink out), is refused before any file is opened."""
    folder = index.parent.resolve()
    for name, file in files.items():
        if not isinstance(file, str) or not file or "\0" in file:
            raise ConfigError(f"{index}: weight_map[{name!r}] is {file!r}, not a file name")
        if folder not in (folder / file).resolve().parents:
            raise ConfigError(f"{index}: weight_map[{name!r}] names {file!r}, which is outside "
                              f"the model folder {index.parent}; an index names files beside it")


def weights_note(path: str) -> str | None:
    """What to tell a user who passed a config.json next to weights that are not loaded."""
    given = Path(path)
    if given.is_file() and _weight_map_exists(given.parent):
        return (f"--model {path} is a config file, so the model starts from random weights; "
                f"the weights in {given.parent} are loaded when you pass the folder instead")
    return None


def _weight_map_exists(folder: Path) -> bool:
    return (folder / SINGLE_WEIGHTS).is_file() or (folder / WEIGHT_INDEX).is_file()


def check_model(source: HFModelSource, *, tp: int, recompute: str, seq_len: int,
                vocab_needed: int, num_stages: int | None = None,
                memory: tuple[int, int, str] | None = None) -> None:
    """Everything about the model that would otherwise fail on every rank at once: family,
    tensor parallelism, recompute, vocabulary, sequence length, layers per stage, and
    (``memory``: bytes per parameter, the bytes the run has, where they are) its size."""
    where = source.config_file
    if memory is not None:
        _check_size(source, *memory)
    hf_families.check_parallel(source.config, where, tp=tp, recompute=recompute)
    sizes = hf_families.sizes(source.config)
    if sizes["vocab_size"] < vocab_needed:
        raise ConfigError(
            f"{where}: vocab_size {sizes['vocab_size']} is smaller than the data's "
            f"{vocab_needed} token ids (bytes need 256; a --tokenizer needs its vocabulary); "
            "use a model with a larger vocabulary or another --tokenizer")
    if source.model_type == "gpt2" and seq_len > sizes["positions"]:
        raise ConfigError(f"--seq-len {seq_len} exceeds {where}'s n_positions "
                          f"{sizes['positions']} (GPT-2 learns one embedding per position); "
                          "lower --seq-len")
    if num_stages is not None and sizes["layers"] < num_stages:
        raise ConfigError(f"{where}: {sizes['layers']} decoder layers cannot fill "
                          f"{num_stages} pipeline stages (each needs one); lower --pp or "
                          "--chunks")


def _check_size(source: HFModelSource, bytes_per_param: int, have_bytes: int, what: str) -> None:
    """Refuse a model whose weights, gradients and optimizer state cannot fit ``have_bytes``
    (before anything is allocated: a vocabulary of 10^8 took 6 GB and then failed)."""
    params = hf_families.parameter_estimate(source.config)
    need = params * bytes_per_param
    if need > have_bytes:
        raise ConfigError(
            f"{source.config_file}: about {params:,} parameters need about {need / 2**30:,.1f} "
            f"GiB for weights, gradients and AdamW state ({bytes_per_param} bytes each), more "
            f"than {what} ({have_bytes / 2**30:,.1f} GiB); check vocab_size, hidden_size and "
            "num_hidden_layers")


def hf_config(config: Mapping[str, Any]) -> Any:
    """A transformers config object from a config.json's contents."""
    import transformers

    values = dict(config)
    return transformers.AutoConfig.for_model(values.pop("model_type"), **values)


def meta_model(config: Mapping[str, Any]) -> nn.Module:
    """The whole model on the meta device: shapes and names, no memory (Note: [HF stages])."""
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(hf_config(config))


@dataclass
class HFStages:
    """This process's stage modules and the (meta, partly materialised) model they come from,
    whose ``named_parameters`` give every stage parameter its full-model name."""

    model: nn.Module
    stages: dict[int, nn.Module]


def build_hf_stages(source: HFModelSource, num_stages: int, stage_indices: Iterable[int], *,
                    seed: int, dtype: torch.dtype, device: torch.device,
                    tp_mesh: Any = None, recompute: str = "none") -> HFStages:
    """This process's stages of the model, filled (Note: [HF stages]), in ``dtype`` on
    ``device``, sharded over ``tp_mesh`` (HF_TENSOR_PARALLEL) and recomputing whole decoder
    layers with ``recompute="full"``."""
    from pipeoffload.integrations.hf import causal_lm_stages
    from pipeoffload.training.hf_tensor_parallel import apply_hf_tensor_parallel

    model = meta_model(source.config)
    names = {id(p): n for n, p in model.named_parameters()}
    stages = causal_lm_stages(model, num_stages, sorted(stage_indices))
    fill = _Weights(source) if source.has_weights else _RandomInit(model.config, seed)
    rotary = None
    for stage in stages.values():
        _materialise(stage, names, fill, dtype, device)
        if getattr(stage, "rotary_emb", None) is not None:
            if rotary is None:  # its buffers are computed in __init__, not loaded
                rotary = type(stage.rotary_emb)(model.config).to(device)
            stage.rotary_emb = rotary
        left = [n for n, t in (*stage.named_parameters(), *stage.named_buffers()) if t.is_meta]
        if left:
            raise ConfigError(f"{source.path}: the stage's tensors {left[:3]} could not be made "
                              "(an unknown buffer of this model family)")
        stage.train()
        if tp_mesh is not None:
            apply_hf_tensor_parallel(stage, tp_mesh)
        if recompute == "full":
            for layer in cast(nn.ModuleList, stage.layers):
                _recompute_whole(layer)
    return HFStages(model, stages)


def _materialise(stage: nn.Module, names: Mapping[int, str], fill: Any, dtype: torch.dtype,
                 device: torch.device) -> None:
    """Replace the meta parameters of ``stage`` by filled ones (one per meta parameter, so a tie
    inside the stage stays one tensor)."""
    made: dict[int, nn.Parameter] = {}
    for module in stage.modules():
        for key, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in made:
                name = names[id(param)]
                values = fill(name, param)
                if tuple(values.shape) != tuple(param.shape):
                    raise ConfigError(f"weight {name} has shape {list(values.shape)} in "
                                      f"{fill.where(name)}, but the config makes "
                                      f"{list(param.shape)}; the weights belong to another "
                                      "config")
                made[id(param)] = nn.Parameter(values.to(device=device, dtype=dtype),
                                               requires_grad=param.requires_grad)
            module._parameters[key] = made[id(param)]


class _Weights:
    """Weights by full name from the model's safetensors files (Hugging Face also accepts names
    without the base-model prefix, ``layers.0...`` for ``model.layers.0...``)."""

    def __init__(self, source: HFModelSource) -> None:
        self._map = source.weight_map
        self._path = source.path
        self._prefix = "transformer." if source.model_type == "gpt2" else "model."

    def _key(self, name: str) -> str:
        if name in self._map:
            return name
        short = name.removeprefix(self._prefix)
        if short in self._map:
            return short
        raise ConfigError(f"--model {self._path}: the weight files have no {name} (they hold "
                          f"{len(self._map)} tensors, e.g. {sorted(self._map)[:2]}); they "
                          "belong to another model")

    def where(self, name: str) -> str:
        return self._map.get(self._key(name), self._path)

    def __call__(self, name: str, param: torch.Tensor) -> torch.Tensor:
        from safetensors import safe_open

        key = self._key(name)
        with safe_open(self._map[key], framework="pt") as f:
            return f.get_tensor(key)


class _RandomInit:
    """Hugging Face's init for these families, drawn per parameter from (seed, name)."""

    def __init__(self, config: Any, seed: int) -> None:
        self._std = float(getattr(config, "initializer_range", 0.02))
        layers = int(getattr(config, "num_hidden_layers", 1))
        self._residual_std = self._std / math.sqrt(2 * layers)
        self._gpt2 = config.model_type == "gpt2"
        self._seed = seed

    def where(self, name: str) -> str:
        return "the random init"

    def __call__(self, name: str, param: torch.Tensor) -> torch.Tensor:
        if param.dim() == 1:
            return torch.zeros(param.shape) if name.endswith(".bias") else torch.ones(param.shape)
        generator = torch.Generator().manual_seed(derive_seed(self._seed, f"hf:{name}"))
        std = self._residual_std if self._gpt2 and name.endswith("c_proj.weight") else self._std
        return torch.randn(param.shape, generator=generator, dtype=torch.float32) * std


def _recompute_whole(layer: nn.Module) -> None:
    """Make ``layer`` keep only its input for the backward and re-run itself there
    (training/layer_recompute.py: what it keeps goes through the saved-tensor hooks)."""
    forward = layer.forward

    def run(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        def region(h: torch.Tensor) -> tuple[torch.Tensor]:
            out = forward(h, *args, **kwargs)
            return (out[0] if isinstance(out, tuple) else out,)
        return recomputed(region, (layer,), hidden)[0]

    layer.forward = run
