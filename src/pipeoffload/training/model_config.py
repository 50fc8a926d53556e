"""The reference transformer's shape (``ModelConfig``), its presets and the recompute modes of
its layers: what a training configuration names, without torch (training/model.py builds
the model)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from pipeoffload.errors import ConfigError, FieldError

RECOMPUTE_MODES = ("none", "lgd", "full")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the reference transformer.

    ``n_kv_heads`` < ``n_heads`` gives grouped-query attention: query head j reads key/value
    head ``j // (n_heads // n_kv_heads)``. ``ffn_hidden`` is the SwiGLU inner width.
    ``init_std`` is the std of every weight matrix at init; the two projections that write
    into the residual stream (attention ``wo``, MLP ``w2``) are further scaled by
    1/sqrt(2 * n_layers) so the residual's variance does not grow with depth.
    ``document_eos``: with an id, attention is masked by document (``--document-mask``): a
    token attends only to earlier tokens of its own document, which ends with that id
    (training/model.py ``document_segments``); None: plain causal attention.
    """

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 8
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 352
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    document_eos: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden",
                     "max_seq_len"):
            if getattr(self, name) < 1:
                raise _refuse(f"{{{name}}} must be >= 1, got {{got}}", got=getattr(self, name))
        if self.dim % self.n_heads:
            raise _refuse("{dim} {d} is not divisible by {n_heads} {h}; choose {dim} = "
                          "{n_heads} x the head width", d=self.dim, h=self.n_heads)
        if self.head_dim % 2:
            raise _refuse("the head width {dim} / {n_heads} = {w} is odd; rotary embeddings "
                          "rotate pairs of features, so choose an even head width", w=self.head_dim)
        if self.n_heads % self.n_kv_heads:
            raise _refuse("{n_heads} {h} is not a multiple of {n_kv_heads} {kv}; each key/value "
                          "head must serve the same number of query heads", h=self.n_heads,
                          kv=self.n_kv_heads)
        if self.document_eos is not None and not 0 <= self.document_eos < self.vocab_size:
            raise ConfigError(f"ModelConfig.document_eos={self.document_eos} is not an id of "
                              f"the vocabulary (0..{self.vocab_size - 1})")
        if self.rope_theta <= 0 or self.norm_eps <= 0 or self.init_std <= 0:
            raise ConfigError("ModelConfig.rope_theta, norm_eps and init_std must be > 0")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def layer_params(self) -> int:
        """Parameter count of one transformer layer."""
        kv = self.n_kv_heads * self.head_dim
        attention = 2 * self.dim * self.dim + 2 * self.dim * kv
        return attention + 3 * self.dim * self.ffn_hidden + 2 * self.dim

    def num_params(self) -> int:
        """Parameter count of the whole model (untied embedding and head)."""
        return self.n_layers * self.layer_params() + 2 * self.vocab_size * self.dim + self.dim


# Parameter counts (ModelConfig.num_params): tiny 53,536; small 1,542,272 (about 0.6 s per
# 16 x 128-token training step on 2 CPU cores); medium (for GPU runs) 75,909,888.
MODEL_PRESETS: Mapping[str, ModelConfig] = MappingProxyType({
    "tiny": ModelConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                        max_seq_len=32),
    "small": ModelConfig(dim=128, n_layers=8, n_heads=4, n_kv_heads=2, ffn_hidden=352,
                         max_seq_len=128),
    "medium": ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_hidden=2048,
                          max_seq_len=1024),
})


def model_preset(name: str) -> ModelConfig:
    """The named ModelConfig ("tiny" for tests, "small" for the CPU demo, "medium" for GPUs)."""
    try:
        return MODEL_PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(
            f"unknown model preset {name!r}; choose one of {', '.join(MODEL_PRESETS)}"
        ) from None


def check_tensor_parallel(config: ModelConfig, tp: int, seq_len: int | None = None) -> None:
    """Raise FieldError (naming TrainConfig's fields) unless the model's heads, widths and
    vocabulary (and ``seq_len``, which sequence parallelism shards) split over ``tp``."""
    if tp < 1:
        raise FieldError("TrainConfig", "{tp} must be >= 1, got {got}", {"got": tp})
    sizes = [("n_heads", config.n_heads, "{model.n_heads}"),
             ("n_kv_heads", config.n_kv_heads, "{model.n_kv_heads}"),
             ("ffn_hidden", config.ffn_hidden, "{model.ffn_hidden}"),
             ("vocab_size", config.vocab_size, "the vocabulary")]
    if seq_len is not None:
        sizes.append(("seq_len", seq_len, "{data.seq_len}"))
    for name, value, source in sizes:
        if value % tp:
            raise FieldError("TrainConfig", "{tp} {n}: tensor parallelism must split "
                             "{name}={value} (from " + source + ") evenly; choose a multiple "
                             "of {n} or a {tp} that divides it",
                             {"n": tp, "name": name, "value": value})


def _refuse(template: str, **values: object) -> FieldError:
    """A ModelConfig error: ``{field}`` placeholders name its fields (the command line says
    them as its flags: --dim, --heads, ...)."""
    return FieldError("ModelConfig", template, values)
