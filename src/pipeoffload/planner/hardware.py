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

from pipeoffload.errors import ConfigError
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

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in ("name", "full_duplex"):
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

    def d2h_s(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` from this GPU to pinned host memory."""
        return nbytes / self.d2h_bytes_per_s

    def h2d_s(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` from pinned host memory to this GPU."""
        return nbytes / self.h2d_bytes_per_s

    def link_bytes_per_s(self, group_size: int) -> float:
        """Per-GPU bandwidth of a collective among ``group_size`` consecutive GPUs: NVLink when the
        group fits in one node, else the inter-node network (the slowest hop sets a ring's pace)."""
        return self.intra_node_bytes_per_s if group_size <= self.gpus_per_node else (
            self.inter_node_bytes_per_s
        )

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
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{source}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg})"
            ) from None
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
