"""Hardware presets: how fast a GPU computes and how fast it reaches host memory and its peers.

Figures are *achievable* rates for whole transformer layers and pinned-memory copies, not
datasheet peaks; each preset's docstring entry in ``_PRESETS`` and docs/planner-model.md say
where its numbers come from. ``pipeoffload probe`` measures the local GPU and saves a preset as
JSON (``Hardware.to_json`` / ``Hardware.from_json`` / ``load_hardware``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from pipeoffload.checks import parse_json
from pipeoffload.errors import ConfigError
from pipeoffload.planner.gemm import Gemm, check_points, curve_fraction, roofline_points
from pipeoffload.sim.costs import Duplex, HostLink

_MIB = 2**20


@dataclass(frozen=True)
class Hardware:
    """One GPU model in its usual server.

    - ``bf16_flops_per_s``: matmul FLOP/s a transformer layer achieves in 16-bit (MFU-level).
    - ``hbm_bytes``: device memory capacity.
    - ``d2h_bytes_per_s`` / ``h2d_bytes_per_s``: pinned host-link copy bandwidth of one GPU.
    - ``full_duplex``: both directions run at once at their own rates (PCIe is full duplex).
    - ``intra_node_bytes_per_s`` / ``inter_node_bytes_per_s``: per-GPU, per-direction bandwidth
      of collectives and P2P inside a node (NVLink) and across nodes (NIC per GPU).
    - ``gpus_per_host_link``: GPUs that share one host link (two A100s behind one PCIe switch).
    - ``intra_node_busbw_fraction`` / ``inter_node_busbw_fraction``: the share of those nominal
      link rates NCCL achieves as bus bandwidth (nccl-tests' busbw at large messages); every
      collective and P2P transfer is priced at the achieved rate. 1.0 means nominal.
    - ``gemm_ridge_flops_per_byte``: the datasheet math rate over HBM bandwidth (NVIDIA's
      ops:byte ratio), which draws the default GEMM efficiency curve; 0 means every matmul runs
      at ``bf16_flops_per_s`` whatever its shape.
    - ``gemm_points``: measured (intensity FLOP/byte, fraction of the large-GEMM rate) pairs from
      ``pipeoffload probe``; when present they replace the default curve (gemm.py, Note [GEMM
      efficiency curve]).
    """

    name: str
    bf16_flops_per_s: float
    hbm_bytes: float
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    gpus_per_node: int = 8
    gpus_per_host_link: int = 1
    full_duplex: bool = True
    intra_node_busbw_fraction: float = 1.0
    inter_node_busbw_fraction: float = 1.0
    gemm_ridge_flops_per_byte: float = 0.0
    gemm_points: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.gemm_points, (list, tuple)) or not all(
                isinstance(point, (list, tuple)) for point in self.gemm_points):
            raise ConfigError(
                f"hardware {self.name!r}: gemm_points must be [intensity, fraction] pairs"
            )
        points = tuple(tuple(point) for point in self.gemm_points)
        object.__setattr__(self, "gemm_points", points)
        check_points(points, f"hardware {self.name!r}")
        for field in ("intra_node_busbw_fraction", "inter_node_busbw_fraction"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value <= 1:
                raise ConfigError(
                    f"hardware {self.name!r}: {field} must be in (0, 1] (achieved over nominal "
                    f"bandwidth), got {value!r}"
                )
        ridge = self.gemm_ridge_flops_per_byte
        if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or ridge < 0:
            raise ConfigError(
                f"hardware {self.name!r}: gemm_ridge_flops_per_byte must be >= 0 (0: no shape "
                f"model), got {ridge!r}"
            )
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in ("name", "full_duplex", "intra_node_busbw_fraction",
                              "inter_node_busbw_fraction", "gemm_ridge_flops_per_byte",
                              "gemm_points"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not 0 < value < math.inf:
                raise ConfigError(
                    f"hardware {self.name!r}: {field.name} must be a positive number, "
                    f"got {value!r}"
                )
        for field in ("gpus_per_node", "gpus_per_host_link"):
            if not float(getattr(self, field)).is_integer():
                raise ConfigError(
                    f"hardware {self.name!r}: {field} must be a whole number, "
                    f"got {getattr(self, field)!r}"
                )
            object.__setattr__(self, field, int(getattr(self, field)))
        if not isinstance(self.full_duplex, bool):
            raise ConfigError(
                f"hardware {self.name!r}: full_duplex must be true or false, "
                f"got {self.full_duplex!r}"
            )

    def compute_s(self, flops: float) -> float:
        """Seconds to run ``flops`` of matmul work."""
        return flops / self.bf16_flops_per_s

    def gemm_fraction(self, gemm: Gemm) -> float:
        """The fraction of ``bf16_flops_per_s`` a GEMM of this shape reaches: the probe's
        measured curve, else the default roofline curve, else 1."""
        if self.gemm_points:
            return curve_fraction(self.gemm_points, gemm.intensity)
        if self.gemm_ridge_flops_per_byte > 0:
            return curve_fraction(roofline_points(self.gemm_ridge_flops_per_byte),
                                  gemm.intensity)
        return 1.0

    def gemm_s(self, gemm: Gemm) -> float:
        """Seconds to run one GEMM, its shape's efficiency included."""
        return gemm.flops / (self.bf16_flops_per_s * self.gemm_fraction(gemm))

    def d2h_s(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` from this GPU to pinned host memory."""
        return nbytes / self.d2h_bytes_per_s

    def h2d_s(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` from pinned host memory to this GPU."""
        return nbytes / self.h2d_bytes_per_s

    def link_bytes_per_s(self, group_size: int) -> float:
        """Per-GPU bandwidth NCCL achieves in a collective among ``group_size`` consecutive GPUs:
        NVLink when the group fits in one node, else the inter-node network (the slowest hop sets
        a ring's pace); nominal rate times its busbw fraction."""
        return self.achieved_bytes_per_s(cross_node=group_size > self.gpus_per_node)

    def achieved_bytes_per_s(self, *, cross_node: bool) -> float:
        """Per-GPU, per-direction bandwidth NCCL achieves inside a node or across nodes."""
        if cross_node:
            return self.inter_node_bytes_per_s * self.inter_node_busbw_fraction
        return self.intra_node_bytes_per_s * self.intra_node_busbw_fraction

    def host_link(self) -> HostLink:
        """The simulator's view of how this machine's GPUs reach host memory."""
        return HostLink(
            duplex=Duplex.FULL if self.full_duplex else Duplex.HALF,
            ranks_per_link=self.gpus_per_host_link,
        )

    def to_json(self) -> str:
        """This preset as a JSON object (every field, units in the names)."""
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str, *, source: str = "<json>") -> Hardware:
        """A preset from ``to_json``'s output; ``source`` names the file in error messages."""
        data = parse_json(text, source)
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a JSON object of hardware fields")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ConfigError(
                f"{source}: unknown hardware field(s) {', '.join(unknown)}; "
                f"known fields: {', '.join(names)}"
            )
        required = [
            f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
        ]
        missing = [n for n in required if n not in data]
        if missing:
            raise ConfigError(f"{source}: missing hardware field(s) {', '.join(missing)}")
        if "gemm_points" in data and not isinstance(data["gemm_points"], list):
            raise ConfigError(f"{source}: gemm_points must be a list of [intensity, fraction]")
        return cls(**data)


def _preset(**kwargs: object) -> Hardware:
    return Hardware(**kwargs)  # type: ignore[arg-type]


# Sources (docs/planner-model.md, "Hardware presets", has the full reasoning):
# - FLOP/s and host-link GB/s of A100 / H100: the PipeOffload authors' code (paper-notes.md s2).
# - Memory: nvidia-smi's total (A100 80GB 81920 MiB, H100 80GB 81559 MiB, H200 143771 MiB).
# - NVLink per direction: A100 NVLink3 300 GB/s, H100/H200 NVLink4 450 GB/s (datasheets).
# - Network: one 200 Gb/s (A100) / 400 Gb/s (H100, H200) NIC per GPU, as in DGX systems.
# - A100s share a PCIe switch in pairs (PipeOffload paper, section 4.2).
# - H200: the H100's compute die and PCIe 5 link, so the H100's 440 TFLOP/s and 21 GB/s.
# - busbw fractions: nccl-tests' large-message bus bandwidth over the nominal link rate,
#   A100 NVLink 3 ~235 of 300 GB/s; H100 / H200 all-gather and reduce-scatter ~360 of 450
#   [assumption]; networks 0.9 of line rate [assumption].
# - GEMM ridge: datasheet dense bf16 over HBM bandwidth (A100 80GB 312 TFLOP/s / 2.039 TB/s,
#   H100 SXM 989 / 3.35, H200 989 / 4.8), NVIDIA's ops:byte ratio.
_PRESETS: dict[str, Hardware] = {
    "a100-80gb": _preset(
        name="a100-80gb",
        bf16_flops_per_s=220e12,
        hbm_bytes=81920 * _MIB,
        d2h_bytes_per_s=15e9,
        h2d_bytes_per_s=15e9,
        intra_node_bytes_per_s=300e9,
        inter_node_bytes_per_s=25e9,
        gpus_per_node=8,
        gpus_per_host_link=2,
        intra_node_busbw_fraction=0.78,
        inter_node_busbw_fraction=0.9,
        gemm_ridge_flops_per_byte=312e12 / 2.039e12,
    ),
    "h100-80gb": _preset(
        name="h100-80gb",
        bf16_flops_per_s=440e12,
        hbm_bytes=81559 * _MIB,
        d2h_bytes_per_s=21e9,
        h2d_bytes_per_s=21e9,
        intra_node_bytes_per_s=450e9,
        inter_node_bytes_per_s=50e9,
        gpus_per_node=8,
        gpus_per_host_link=1,
        intra_node_busbw_fraction=0.8,
        inter_node_busbw_fraction=0.9,
        gemm_ridge_flops_per_byte=989e12 / 3.35e12,
    ),
    "h200": _preset(
        name="h200",
        bf16_flops_per_s=440e12,
        hbm_bytes=143771 * _MIB,
        d2h_bytes_per_s=21e9,
        h2d_bytes_per_s=21e9,
        intra_node_bytes_per_s=450e9,
        inter_node_bytes_per_s=50e9,
        gpus_per_node=8,
        gpus_per_host_link=1,
        intra_node_busbw_fraction=0.8,
        inter_node_busbw_fraction=0.9,
        gemm_ridge_flops_per_byte=989e12 / 4.8e12,
    ),
}

_ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb", "h200-141gb": "h200"}


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def hardware_names() -> tuple[str, ...]:
    """Names ``hardware_preset`` accepts (aliases not included)."""
    return tuple(_PRESETS)


def hardware_preset(name: str) -> Hardware:
    """The preset called ``name`` (case-insensitive; "a100", "h100" are aliases)."""
    key = _key(name)
    key = _ALIASES.get(key, key)
    if key not in _PRESETS:
        raise ConfigError(
            f"unknown hardware {name!r}; known presets: {', '.join(_PRESETS)} "
            f"(or a JSON file written by `pipeoffload probe`)"
        )
    return _PRESETS[key]


def load_hardware(name_or_path: str) -> Hardware:
    """A preset by name, or one saved as JSON (a path ending in .json, or any existing file)."""
    path = Path(name_or_path)
    if name_or_path.lower().endswith(".json") or path.is_file():
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read hardware file {name_or_path}: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"hardware file {name_or_path} is not UTF-8 text (byte "
                              f"{exc.start}: {exc.reason}); pass a probe JSON or a preset "
                              "name") from None
        return Hardware.from_json(text, source=name_or_path)
    return hardware_preset(name_or_path)
