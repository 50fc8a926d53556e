"""The cost model the simulator (and the offload planner) reads: how long each action takes,
how many bytes each (stage, microbatch) keeps, and how ranks reach host memory.

Times are in any unit you like (the simulator only adds them); defaults are the papers'
unit slots, T_F = T_I = T_W = 1 with free P2P.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from pipeoffload.checks import check_number, check_optional
from pipeoffload.core.actions import Action, Kind
from pipeoffload.errors import ConfigError

# Bounds that keep every sum of times finite in float64 (a makespan adds up to millions of
# them); far beyond any real cost model.
_MAX_TIME = 1e12
_MAX_RATIO = 1e6
_MAX_BYTES = 1e18


class Duplex(str, Enum):
    FULL = "full"  # device-to-host and host-to-device copies run at the same time
    HALF = "half"  # one copy at a time on a link, in either direction


@dataclass(frozen=True)
class HostLink:
    """How ranks reach host memory: each link has a D2H and an H2D queue (one queue if half
    duplex); ``ranks_per_link`` consecutive ranks share one link (2 = two GPUs on a PCIe switch)."""

    duplex: Duplex = Duplex.FULL
    ranks_per_link: int = 1

    def __post_init__(self) -> None:
        check_number("HostLink.ranks_per_link", self.ranks_per_link, minimum=1, integer=True)
        if not isinstance(self.duplex, Duplex):
            raise ConfigError(f"HostLink.duplex must be a Duplex (full or half), got "
                              f"{self.duplex!r}")

    def channel(self, rank: int, kind: Kind) -> tuple[int, str]:
        """The queue a transfer of ``kind`` issued by ``rank`` waits in."""
        link = rank // self.ranks_per_link
        if self.duplex is Duplex.HALF:
            return link, "both"
        return link, "d2h" if kind is Kind.OFFLOAD else "h2d"


@dataclass(frozen=True)
class CostModel:
    """Per-chunk, per-microbatch costs.

    - ``f_time``, ``i_time``, ``w_time``: forward, input-gradient and weight-gradient time of one
      stage for one microbatch (a full backward B takes ``i_time + w_time``; a RECOMPUTE takes
      ``f_time``). ``stage_time_scale[s]`` multiplies all three for stage s (e.g. a head stage).
    - ``p2p_time``: latency added to every dependency that crosses ranks.
    - Transfers: ``offload_ratio`` = one-way copy time of one stage's activations / that stage's
      ``f_time + i_time + w_time`` (the authors' --offload-time). Without it, copy time is
      ``activation_bytes / d2h_bytes_per_s`` (``h2d_bytes_per_s`` back); without either, 0.
    - ``overlap_f_b``: None (default) runs a forward and the backward after it back to back, as
      our runtime does; a share in [0, 1] times them as DeepSeek's overlapped pair: one unit
      taking F&B = F + B - overlap_f_b * min(F, B), both outputs ready at its end (Note:
      [overlapped pair], sim/simulator.py).
    - ``activation_bytes``: bytes one microbatch keeps on one stage (one value for every stage,
      or ``stage_activation_bytes`` per stage). Peaks are also reported in M_a units, where one
      unit is one microbatch through all of a rank's stages.
    """

    f_time: float = 1.0
    i_time: float = 1.0
    w_time: float = 1.0
    p2p_time: float = 0.0
    offload_ratio: float | None = None
    activation_bytes: float | None = None
    stage_activation_bytes: tuple[float, ...] = ()
    d2h_bytes_per_s: float | None = None
    h2d_bytes_per_s: float | None = None
    stage_time_scale: tuple[float, ...] = ()
    host_link: HostLink = field(default_factory=HostLink)
    overlap_f_b: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_activation_bytes", tuple(self.stage_activation_bytes))
        object.__setattr__(self, "stage_time_scale", tuple(self.stage_time_scale))
        for name in ("f_time", "i_time", "w_time", "p2p_time"):
            check_number(f"CostModel.{name}", getattr(self, name), minimum=0, maximum=_MAX_TIME)
        check_optional("CostModel.offload_ratio", self.offload_ratio, minimum=0,
                       maximum=_MAX_RATIO)
        check_optional("CostModel.overlap_f_b", self.overlap_f_b, minimum=0, maximum=1)
        check_optional("CostModel.activation_bytes", self.activation_bytes, minimum=0,
                       maximum=_MAX_BYTES)
        for name in ("d2h_bytes_per_s", "h2d_bytes_per_s"):
            check_optional(f"CostModel.{name}", getattr(self, name), above=0,
                           maximum=_MAX_BYTES)
        for s, value in enumerate(self.stage_activation_bytes):
            check_number(f"CostModel.stage_activation_bytes[{s}]", value, minimum=0,
                         maximum=_MAX_BYTES)
        for s, value in enumerate(self.stage_time_scale):
            check_number(f"CostModel.stage_time_scale[{s}]", value, minimum=0,
                         maximum=_MAX_TIME)

    def scale(self, stage: int) -> float:
        return self.stage_time_scale[stage] if stage < len(self.stage_time_scale) else 1.0

    def compute_time(self, action: Action) -> float:
        """Duration of a compute action (0 for anything else)."""
        kind = action.kind
        if kind is Kind.F or kind is Kind.RECOMPUTE:
            base = self.f_time
        elif kind is Kind.I:
            base = self.i_time
        elif kind is Kind.W:
            base = self.w_time
        elif kind is Kind.B:
            base = self.i_time + self.w_time
        else:
            return 0.0
        return base * self.scale(action.stage) if self.stage_time_scale else base

    def chunk_time(self, stage: int) -> float:
        """F + I + W of one stage for one microbatch."""
        return (self.f_time + self.i_time + self.w_time) * self.scale(stage)

    def bytes_of(self, stage: int) -> float | None:
        """Activation bytes of one microbatch on ``stage``, or None when sizes are not given."""
        if stage < len(self.stage_activation_bytes):
            return self.stage_activation_bytes[stage]
        return self.activation_bytes

    def transfer_time(self, stage: int, kind: Kind) -> float:
        """Duration of one OFFLOAD (device to host) or RELOAD (host to device) of ``stage``."""
        if self.offload_ratio is not None:
            return self.offload_ratio * self.chunk_time(stage)
        size = self.bytes_of(stage)
        bandwidth = self.d2h_bytes_per_s if kind is Kind.OFFLOAD else self.h2d_bytes_per_s
        if size is None or bandwidth is None:
            return 0.0
        return size / bandwidth
