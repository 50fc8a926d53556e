"""What a plan did: the report of an offload planning pass, and the plan it comes with."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeoffload.core.schedule import Schedule
from pipeoffload.offload.select import Item
from pipeoffload.offload.targets import OffloadTarget
from pipeoffload.sim.simulator import SimResult


@dataclass(frozen=True)
class Skipped:
    stage: int
    microbatch: int
    reason: str


@dataclass(frozen=True)
class OffloadReport:
    """What a plan does. Peaks in M_a units (bytes where the cost model has sizes)."""

    target: OffloadTarget
    offloaded: tuple[Item, ...]
    peak_before: tuple[float, ...]
    peak_after: tuple[float, ...]
    peak_bytes_before: tuple[float, ...] | None
    peak_bytes_after: tuple[float, ...] | None
    offloaded_fraction: float
    """Share of all activation (by M_a units, i.e. by bytes when sizes are given) offloaded."""
    bytes_moved: float | None
    """Bytes copied device-to-host, or None without sizes. A RELOAD brings the same back; a
    FETCH reads them once per backward pass (twice with a B/W split)."""
    makespan_before: float
    makespan_after: float
    stall_time: tuple[float, ...]
    skipped: tuple[Skipped, ...] = ()
    notes: tuple[str, ...] = ()

    def summary(self) -> str:
        lines = [
            f"offload {self.target}: {len(self.offloaded)} activations offloaded "
            f"({self.offloaded_fraction:.0%} of activation memory)",
            "peak M_a per rank: " + ", ".join(
                f"{b:.3g}->{a:.3g}" for b, a in zip(self.peak_before, self.peak_after)),
            f"makespan {self.makespan_before:.4g} -> {self.makespan_after:.4g}, "
            f"stall {sum(self.stall_time):.4g}",
        ]
        if self.skipped:
            lines.append(f"{len(self.skipped)} candidates skipped, e.g. "
                         f"stage {self.skipped[0].stage} mb {self.skipped[0].microbatch}: "
                         f"{self.skipped[0].reason}")
        lines.extend(self.notes)
        return "\n".join(lines)


@dataclass(frozen=True)
class OffloadPlan:
    schedule: Schedule
    report: OffloadReport
    result: SimResult = field(repr=False)
