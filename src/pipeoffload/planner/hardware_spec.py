"""The ``Hardware`` record: how fast a GPU computes and how fast it reaches host memory and
its peers, with the pricing helpers every cost reads (matmul by shape, attention, memory-bound
work, copies, collectives). The presets and the lookup by name are in hardware.py."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from pipeoffload.checks import parse_json
from pipeoffload.errors import ConfigError
from pipeoffload.planner.gemm import (
    Gemm,
    check_points,
    curve_fraction,
    roofline_points,
    wave_efficiency,
)
from pipeoffload.sim.costs import Duplex, HostLink


@dataclass(frozen=True)
class Hardware:
    """One GPU model in its usual server.

    - ``bf16_flops_per_s``: the dense 16-bit rate large GEMMs achieve (a measured maximum, not
      the datasheet); ``gemm_points`` / ``gemm_ridge_flops_per_byte`` scale it by shape.
    - ``peak_flops_per_s``: the datasheet dense 16-bit rate that MFU is quoted against (0: use
      ``bf16_flops_per_s``, which quotes higher MFU figures).
    - ``hbm_bytes``: device memory capacity.
    - ``hbm_bytes_per_s``: the device-memory bandwidth memory-bound kernels achieve (norms,
      activations, softmax, dropout, residual adds, the optimizer step); 0: such work is not
      timed.
    - ``attention_flops_per_s``: the rate of flash-attention kernels (forward and backward
      together); 0: ``bf16_flops_per_s``.
    - ``kernel_launch_s``: fixed cost of one kernel (the gap between dependent kernels of an
      eager framework); 0: none.
    - ``d2h_bytes_per_s`` / ``h2d_bytes_per_s``: pinned host-link copy bandwidth of one GPU.
    - ``full_duplex``: both directions run at once at their own rates (PCIe is full duplex).
    - ``intra_node_bytes_per_s`` / ``inter_node_bytes_per_s``: per-GPU, per-direction bandwidth
      of collectives and P2P inside a node (NVLink) and across nodes (NIC per GPU).
    - ``gpus_per_host_link``: GPUs that share one host link (two A100s behind one PCIe switch).
    - ``host_bytes_per_node``: host (CPU) memory of one node, the default budget for pinned
      offload buffers; 0: unknown (no host-memory check).
    - ``intra_node_busbw_fraction`` / ``inter_node_busbw_fraction``: the share of those nominal
      link rates NCCL achieves as bus bandwidth (nccl-tests' busbw at large messages); every
      collective and P2P transfer is priced at the achieved rate. 1.0 means nominal.
    - ``gemm_ridge_flops_per_byte``: the datasheet math rate over HBM bandwidth (NVIDIA's
      ops:byte ratio), which draws the default GEMM efficiency curve; 0 means every matmul runs
      at ``bf16_flops_per_s`` whatever its shape.
    - ``sm_count``: streaming multiprocessors, for GEMM wave quantization (gemm.py); 0: none.
    - ``collective_sms``: SMs an NCCL collective inside a node holds while it runs (one thread
      block per channel), taken from a matmul it overlaps (layer_time.py, Note [collectives
      share the SMs]); 0: overlapped collectives cost the matmul nothing.
    - ``inter_node_one_gpu_busbw_fraction``: the busbw fraction of a NIC when one GPU per node
      takes part (a pipeline hop, a data-parallel group of a TP8 layout); 0: the same as
      ``inter_node_busbw_fraction``, which is for collectives where every GPU of a node drives
      its own NIC.
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
    peak_flops_per_s: float = 0.0
    hbm_bytes_per_s: float = 0.0
    attention_flops_per_s: float = 0.0
    kernel_launch_s: float = 0.0
    host_bytes_per_node: float = 0.0
    sm_count: int = 0
    collective_sms: int = 0
    inter_node_one_gpu_busbw_fraction: float = 0.0

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
        if self.inter_node_one_gpu_busbw_fraction > 1:
            raise ConfigError(
                f"hardware {self.name!r}: inter_node_one_gpu_busbw_fraction must be in [0, 1] "
                f"(0: inter_node_busbw_fraction), got {self.inter_node_one_gpu_busbw_fraction!r}"
            )
        for field, meaning in _OPTIONAL_RATES.items():
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 <= value < math.inf:
                raise ConfigError(
                    f"hardware {self.name!r}: {field} must be >= 0 (0: {meaning}), got {value!r}"
                )
        for spec_field in dataclasses.fields(self):
            value = getattr(self, spec_field.name)
            if spec_field.name in ("name", "full_duplex", "intra_node_busbw_fraction",
                                   "inter_node_busbw_fraction", "gemm_points",
                                   *_OPTIONAL_RATES):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not 0 < value < math.inf:
                raise ConfigError(
                    f"hardware {self.name!r}: {spec_field.name} must be a positive number, "
                    f"got {value!r}"
                )
        for field in ("gpus_per_node", "gpus_per_host_link", "sm_count", "collective_sms"):
            if not float(getattr(self, field)).is_integer() or getattr(self, field) > MAX_COUNT:
                raise ConfigError(
                    f"hardware {self.name!r}: {field} must be a whole number up to "
                    f"{MAX_COUNT}, got {getattr(self, field)!r}"
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

    def attention_s(self, flops: float) -> float:
        """Seconds of flash-attention work of ``flops`` (the preset's kernel rate)."""
        return flops / (self.attention_flops_per_s or self.bf16_flops_per_s)

    def memory_s(self, nbytes: float, kernels: float = 0.0) -> float:
        """Seconds of memory-bound kernels moving ``nbytes`` through device memory, plus each
        kernel's fixed cost; 0 when the preset does not time memory-bound work."""
        if not self.hbm_bytes_per_s:
            return 0.0
        return nbytes / self.hbm_bytes_per_s + kernels * self.kernel_launch_s

    @property
    def mfu_peak_flops_per_s(self) -> float:
        """What MFU divides by: the datasheet peak, else the achievable GEMM rate."""
        return self.peak_flops_per_s or self.bf16_flops_per_s

    def gemm_fraction(self, gemm: Gemm) -> float:
        """The fraction of ``bf16_flops_per_s`` a GEMM of this shape reaches: the probe's
        measured curve, else the default roofline curve times its wave efficiency (gemm.py) when
        the SM count is known, else 1."""
        if self.gemm_points:  # measured shapes: their own wave quantization is in the points
            return curve_fraction(self.gemm_points, gemm.intensity)
        waves = wave_efficiency(gemm, self.sm_count)
        if self.gemm_ridge_flops_per_byte > 0:
            return curve_fraction(roofline_points(self.gemm_ridge_flops_per_byte),
                                  gemm.intensity) * waves
        return waves

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

    def achieved_bytes_per_s(self, *, cross_node: bool, one_gpu_per_node: bool = False) -> float:
        """Per-GPU, per-direction bandwidth NCCL achieves inside a node or across nodes; across
        nodes with ``one_gpu_per_node`` of the communicator in each node (a pipeline hop, the
        data-parallel group of a TP8 layout), NCCL reaches a smaller share of the NIC."""
        if cross_node:
            fraction = self.inter_node_busbw_fraction
            if one_gpu_per_node and self.inter_node_one_gpu_busbw_fraction:
                fraction = self.inter_node_one_gpu_busbw_fraction
            return self.inter_node_bytes_per_s * fraction
        return self.intra_node_bytes_per_s * self.intra_node_busbw_fraction

    @property
    def collective_sm_share(self) -> float:
        """The share of the SMs a running collective holds (0 without both counts)."""
        if not self.collective_sms or not self.sm_count:
            return 0.0
        return min(1.0, self.collective_sms / self.sm_count)

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


#: The largest GPU or SM count a preset may give: far above any machine (a node of 72 GPUs,
#: 144 SMs), low enough that a typo (1e300) is refused instead of searching for minutes.
MAX_COUNT = 1 << 16

#: Fields that may be 0, and what 0 means.
_OPTIONAL_RATES = {
    "gemm_ridge_flops_per_byte": "no GEMM shape model",
    "peak_flops_per_s": "MFU against bf16_flops_per_s",
    "hbm_bytes_per_s": "memory-bound work not timed",
    "attention_flops_per_s": "attention at bf16_flops_per_s",
    "kernel_launch_s": "no per-kernel cost",
    "host_bytes_per_node": "host memory unknown",
    "sm_count": "no wave quantization",
    "collective_sms": "overlapped collectives take no SMs",
    "inter_node_one_gpu_busbw_fraction": "inter_node_busbw_fraction",
}
