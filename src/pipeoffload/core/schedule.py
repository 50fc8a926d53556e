"""Schedule: one ordered action list per pipeline rank, plus where each stage lives.

This is the one representation every layer speaks (design.md, "a schedule is data").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.errors import ScheduleError


class Placement(str, Enum):
    """How stages map to ranks."""

    LOOP = "loop"  # stage s on rank s % p (Megatron's interleaving)
    V = "v"  # rank r holds stages r and 2p-1-r (zero bubble's V shape)
    EXPLICIT = "explicit"  # anything else, given stage by stage


def loop_placement(pp: int, chunks: int) -> tuple[int, ...]:
    """stage -> rank for looped placement: stage s lives on rank s % pp."""
    return tuple(stage % pp for stage in range(pp * chunks))


def v_placement(pp: int) -> tuple[int, ...]:
    """stage -> rank for V placement: rank r holds stage r (chunk 0) and 2pp-1-r (chunk 1)."""
    return tuple(stage if stage < pp else 2 * pp - 1 - stage for stage in range(2 * pp))


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists (``ranks[r]`` runs in order on rank r) and the stage placement.

    ``stage_to_rank[s]`` is the rank holding stage s; every rank holds at least one stage.
    Construction checks only the shape; ``validate`` checks that the schedule can run.
    """

    ranks: tuple[tuple[Action, ...], ...]
    stage_to_rank: tuple[int, ...]
    microbatches: int
    name: str = "custom"

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(tuple(actions) for actions in self.ranks))
        object.__setattr__(self, "stage_to_rank", tuple(self.stage_to_rank))
        if not self.ranks:
            raise ScheduleError("a schedule needs at least one rank")
        if self.microbatches < 1:
            raise ScheduleError(f"microbatches must be >= 1, got {self.microbatches}")
        held = set(self.stage_to_rank)
        bad = [r for r in self.stage_to_rank if not 0 <= r < len(self.ranks)]
        if bad:
            raise ScheduleError(
                f"stage_to_rank names rank {bad[0]}, but the schedule has {len(self.ranks)} ranks"
            )
        empty = [r for r in range(len(self.ranks)) if r not in held]
        if empty:
            raise ScheduleError(f"rank {empty[0]} holds no stage; every rank needs at least one")

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def placement(self) -> Placement:
        pp, stages = self.num_ranks, self.num_stages
        if stages % pp == 0 and self.stage_to_rank == loop_placement(pp, stages // pp):
            return Placement.LOOP
        if stages == 2 * pp and self.stage_to_rank == v_placement(pp):
            return Placement.V
        return Placement.EXPLICIT

    def stages_on_rank(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` holds, in increasing order (its chunks 0, 1, ...)."""
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def rank_of(self, stage: int) -> int:
        return self.stage_to_rank[stage]

    def chunk_of(self, stage: int) -> int:
        """Index of ``stage`` among the stages of its rank (0 = the rank's first chunk)."""
        return self.stages_on_rank(self.rank_of(stage)).index(stage)

    @property
    def chunks(self) -> int:
        """Stages per rank (the largest, if ranks differ)."""
        return max(len(self.stages_on_rank(r)) for r in range(self.num_ranks))

    @property
    def actions(self) -> Iterable[tuple[int, int, Action]]:
        """Every (rank, position, action)."""
        for rank, actions in enumerate(self.ranks):
            for position, action in enumerate(actions):
                yield rank, position, action

    def has_kind(self, *kinds: Kind) -> bool:
        return any(a.kind in kinds for actions in self.ranks for a in actions)

    def with_ranks(self, ranks: Sequence[Sequence[Action]], name: str | None = None) -> Schedule:
        """The same placement and microbatches with other action lists."""
        return dataclasses.replace(
            self, ranks=tuple(tuple(a) for a in ranks), name=self.name if name is None else name
        )

    def without(self, *kinds: Kind) -> Schedule:
        """This schedule with every action of the given kinds removed."""
        return self.with_ranks([[a for a in acts if a.kind not in kinds] for acts in self.ranks])

    def format_grid(self, mark: tuple[int, int] | None = None, context: int = 6) -> str:
        """Steps as rows and ranks as columns; ``mark=(rank, position)`` flags one cell.

        With a mark, only ``context`` steps around it are shown, so errors stay readable.
        """
        steps = max((len(a) for a in self.ranks), default=0)
        first, last = 0, steps
        if mark is not None:
            first, last = max(0, mark[1] - context), min(steps, mark[1] + context + 1)
        header = ["step"] + [f"rank {r}" for r in range(self.num_ranks)]
        rows = []
        for step in range(first, last):
            cells = [str(step)]
            for rank, actions in enumerate(self.ranks):
                text = str(actions[step]) if step < len(actions) else ""
                if mark == (rank, step):
                    text = f">{text}<"
                cells.append(text)
            if mark is not None and mark[1] == step:
                cells.append(f"<-- ERROR HERE (rank {mark[0]})")
            rows.append(cells)
        width = max(len(c) for row in [header, *rows] for c in row[: len(header)])
        lines = ["  ".join(c.ljust(width) for c in row).rstrip() for row in [header, *rows]]
        return "\n".join(lines)


def infer_stage_to_rank(rows: Sequence[Sequence[Action]]) -> tuple[int, ...]:
    """Which rank holds each stage, read off where the stage's actions appear.

    Raises ScheduleError if a stage appears on two ranks or stage indices have gaps.
    """
    owner: dict[int, int] = {}
    for rank, actions in enumerate(rows):
        for position, action in enumerate(actions):
            if action.kind.is_comm:
                continue  # torch's RECV/SEND actions name the local stage too, but be lenient
            previous = owner.setdefault(action.stage, rank)
            if previous != rank:
                raise ScheduleError(
                    f"stage {action.stage} appears on rank {previous} and on rank {rank} "
                    f"(position {position}, action {action}); a stage lives on one rank",
                    rank=rank,
                    position=position,
                    action=action,
                )
    if not owner:
        raise ScheduleError("the schedule has no compute actions")
    missing = [s for s in range(max(owner) + 1) if s not in owner]
    if missing:
        raise ScheduleError(f"stage {missing[0]} has no actions; stages must be numbered 0..S-1")
    return tuple(owner[s] for s in range(len(owner)))
