"""Which (stage, microbatch) activations a memory target picks: the longest-lived first.

Shared by offload planning and recomputation: both buy memory for the time an activation
would otherwise sit on the device, so both take the longest-lived activations first.
"""

from __future__ import annotations

from itertools import repeat
from operator import itemgetter, neg, sub

from pipeoffload.core.actions import Kind
from pipeoffload.offload.targets import OffloadTarget, TargetKind
from pipeoffload.sim.simulator import SimResult

Item = tuple[int, int]  # (stage, microbatch)
_F, _W, _B = Kind.F, Kind.W, Kind.B  # Note: [hot loops], core/actions.py
_ITEM = itemgetter(0, 2)  # an action's (stage, microbatch)
_STAGE, _MICROBATCH, _LAST = itemgetter(0), itemgetter(1), itemgetter(-1)  # of an item


class Lifespans:
    """Every (stage, microbatch)'s lifespan (F start to W / B end) in one simulation, and each
    rank's items ordered longest-lived first."""

    def __init__(self, result: SimResult) -> None:
        schedule = result.schedule
        self.schedule = schedule
        reversed_order = [_bit_reversed(m, schedule.microbatches)
                          for m in range(schedule.microbatches)]
        self.lifespan: dict[Item, float] = {}
        self.by_rank: list[list[Item]] = []
        for rank in range(schedule.num_ranks):
            # Each item's F start and W (else B) end, read by position in the rank's program,
            # not off the timeline (SimResult.kind_times): 10^6 actions at p = 64, m = 1024.
            (forwards, starts, _), *lasts = result.kind_times(rank, _F, _B, _W)
            items = list(map(_ITEM, forwards))
            freed: dict[Item, float] = {}
            for last, _, ends in lasts:  # a W's end where there is one
                freed.update(zip(map(_ITEM, last), ends))
            spans = list(map(sub, map(freed.__getitem__, items), starts))
            self.lifespan.update(zip(items, spans))
            # Equal lifespans (a steady state) are taken in bit-reversed microbatch order, so
            # any prefix spreads evenly over time and lowers the whole plateau, not one end.
            # The keys (-span, reversed microbatch, stage) differ for any two items.
            keys = zip(map(neg, map(round, spans, repeat(9))),
                       map(reversed_order.__getitem__, map(_MICROBATCH, items)),
                       map(_STAGE, items), items)
            self.by_rank.append(list(map(_LAST, sorted(keys))))

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
