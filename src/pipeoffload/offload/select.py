"""Which (stage, microbatch) activations a memory target picks: the longest-lived first.

Shared by offload planning and recomputation: both buy memory for the time an activation
would otherwise sit on the device, so both take the longest-lived activations first.
"""

from __future__ import annotations

from pipeoffload.core.actions import Kind
from pipeoffload.offload.targets import OffloadTarget, TargetKind
from pipeoffload.sim.simulator import SimResult

Item = tuple[int, int]  # (stage, microbatch)
_F, _W, _B = Kind.F, Kind.W, Kind.B  # Note: [hot loops], core/actions.py


class Lifespans:
    """Every (stage, microbatch)'s lifespan (F start to W / B end) in one simulation, and each
    rank's items ordered longest-lived first."""

    def __init__(self, result: SimResult) -> None:
        schedule = result.schedule
        self.schedule = schedule
        # One pass over the timeline: each item's F start and W (else B) end.
        born: dict[Item, float] = {}
        freed_w: dict[Item, float] = {}
        freed_b: dict[Item, float] = {}
        # Only the fields each kind needs are read (each object touched costs, at 10^6
        # actions); a TimedAction is (rank, action, start, end, lane, stall).
        for rank in result.timeline:
            for t in rank:
                action = t[1]
                kind = action[1]
                if kind is _F:
                    born[(action[0], action[2])] = t[2]
                elif kind is _W:
                    freed_w[(action[0], action[2])] = t[3]
                elif kind is _B:
                    freed_b[(action[0], action[2])] = t[3]
        reversed_order = [_bit_reversed(m, schedule.microbatches)
                          for m in range(schedule.microbatches)]
        self.lifespan: dict[Item, float] = {}
        self.by_rank: list[list[Item]] = []
        lifespan = self.lifespan
        for actions in schedule.ranks:
            items = [(a[0], a[2]) for a in actions if a[1] is _F]
            for item in items:
                end = freed_w[item] if item in freed_w else freed_b[item]
                lifespan[item] = end - born[item]
            # Equal lifespans (a steady state) are taken in bit-reversed microbatch order, so
            # any prefix spreads evenly over time and lowers the whole plateau, not one end.
            items.sort(key=lambda it: (-round(lifespan[it], 9), reversed_order[it[1]], it[0]))
            self.by_rank.append(items)

    def stages_by_lifespan(self, rank: int) -> list[int]:
        """The rank's stages (chunks), longest total lifespan first."""
        stages = self.schedule.stages_on_rank(rank)
        total = {s: 0.0 for s in stages}
        for (s, _), span in self.lifespan.items():
            if s in total:
                total[s] += span
        return sorted(stages, key=lambda s: (-total[s], s))

    def choose(self, target: OffloadTarget, units: tuple[float, ...],
               verb: str = "offloads") -> tuple[list[Item], tuple[str, ...]]:
        """The items an ALL / CHUNKS / FRACTION target picks, per rank, and notes on it."""
        notes: list[str] = []
        chosen: list[Item] = []
        for rank, items in enumerate(self.by_rank):
            if target.kind is TargetKind.ALL:
                chosen.extend(items)
            elif target.kind is TargetKind.CHUNKS:
                stages = self.stages_by_lifespan(rank)
                k = int(target.value)
                if k > len(stages):
                    notes.append(f"rank {rank} holds {len(stages)} chunks; chunks:{k} {verb} all")
                keep = set(stages[:k])
                chosen.extend(item for item in items if item[0] in keep)
            elif target.kind is TargetKind.FRACTION:
                total = sum(units[s] for s, _ in items)
                taken = 0.0
                for item in items:
                    if taken >= target.value * total - 1e-12:
                        break
                    chosen.append(item)
                    taken += units[item[0]]
            elif target.kind is not TargetKind.NONE:
                raise ValueError(f"choose() does not handle {target.kind.value} targets")
        return chosen, tuple(notes)


def _bit_reversed(index: int, count: int) -> int:
    bits = max(1, (count - 1).bit_length())
    return int(format(index, f"0{bits}b")[::-1], 2)
