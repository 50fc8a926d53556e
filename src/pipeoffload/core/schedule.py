"""Schedule: one ordered action list per pipeline rank, plus where each stage lives.

This is the one representation every layer speaks (design.md, "a schedule is data").
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar, cast

from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.classes import ClassChoice, Shares
from pipeoffload.core.errors import ScheduleError

T = TypeVar("T")

_KIND = operator.itemgetter(1)
_ACTION_TYPE = {Action}


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


@dataclass(frozen=True, init=False)
class Schedule:
    """Per-rank action lists (``ranks[r]`` runs in order on rank r) and the stage placement.

    ``stage_to_rank[s]`` is the rank holding stage s; every rank holds at least one stage.
    ``routes`` is empty when every microbatch runs stages 0..S-1 (every family but DualPipe).
    Construction checks only the shape; ``validate`` checks that the schedule can run.

    Note: [routes]
    A bidirectional schedule (DualPipe) sends half of the microbatches through the model from
    rank 0 and half from the last rank. We express it as several chains of stages: ``routes``
    splits stages 0..S-1 into consecutive runs, and microbatch m runs through route
    ``m * len(routes) // microbatches`` only (so the first half of the microbatches takes the
    first route). The first stage of each route takes inputs, the last applies the loss; the
    one dependency rule (core/deps.py) asks ``is_first_stage`` / ``is_last_stage`` instead of
    "stage 0" / "stage S-1". Stages of different routes that stand for the same model part
    (DualPipe's two copies) are separate stages here: their weights are the user's to tie and
    their gradients to sum (see docs/schedules.md).

    ``classes``: per (stage, microbatch), which tensor classes its transfers move and which it
    recomputes (core/classes.py, Note: [class accounting]), sorted by item; an item without a
    choice moves whole. Passes that rewrite the actions (``with_ranks``) keep them.
    """

    ranks: tuple[tuple[Action, ...], ...]
    stage_to_rank: tuple[int, ...]
    microbatches: int
    name: str = "custom"
    routes: tuple[tuple[int, ...], ...] = ()
    classes: tuple[tuple[tuple[int, int], ClassChoice], ...] = ()
    _derived: dict[Callable[[Schedule], object], object] = field(
        default_factory=dict, init=False, repr=False, compare=False)
    """What passes derived from this schedule (``derived``); a new schedule starts empty."""

    def __init__(self, ranks: Iterable[Iterable[Action]], stage_to_rank: Iterable[int],
                 microbatches: int, name: str = "custom",
                 routes: Iterable[Iterable[int]] = (),
                 classes: Mapping[tuple[int, int], ClassChoice]
                 | Iterable[tuple[tuple[int, int], ClassChoice]] = ()) -> None:
        # Any iterables in (generators build lists), tuples kept: a schedule is immutable.
        object.__setattr__(self, "ranks", tuple(tuple(actions) for actions in ranks))
        object.__setattr__(self, "stage_to_rank", tuple(stage_to_rank))
        object.__setattr__(self, "microbatches", microbatches)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "routes", tuple(tuple(route) for route in routes))
        pairs = classes.items() if isinstance(classes, Mapping) else classes
        object.__setattr__(self, "classes", tuple(sorted(
            ((int(item[0]), int(item[1])), choice) for item, choice in pairs)))
        object.__setattr__(self, "_derived", {})
        self._check_shape()

    def _check_shape(self) -> None:
        for rank, actions in enumerate(self.ranks):
            if set(map(type, actions)) <= _ACTION_TYPE:  # the usual case, in one C-level pass
                continue
            for position, action in enumerate(actions):
                if not isinstance(action, Action):
                    raise ScheduleError(
                        f"rank {rank}, position {position}: {action!r} is a "
                        f"{type(action).__name__}, not an Action; build actions with "
                        "Action(stage, Kind.F, microbatch) or parse_action('0F3'), or load "
                        "text with core.text.parse_rows / read_csv",
                        rank=rank, position=position)
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
        if self.routes:
            _check_routes(self.routes, len(self.stage_to_rank), self.microbatches)
        for (stage, microbatch), choice in self.classes:
            if not isinstance(choice, ClassChoice):
                raise ScheduleError(f"classes of ({stage}, {microbatch}): {choice!r} is not a "
                                    "ClassChoice (core/classes.py)")
            if not (0 <= stage < len(self.stage_to_rank) and 0 <= microbatch < self.microbatches):
                raise ScheduleError(f"classes name ({stage}, {microbatch}), which is not a "
                                    f"(stage, microbatch) of this schedule")
        if len({item for item, _ in self.classes}) != len(self.classes):
            raise ScheduleError("classes name one (stage, microbatch) twice")

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

    def route_of(self, microbatch: int) -> tuple[int, ...]:
        """The stages ``microbatch`` runs through, in order (Note: [routes])."""
        if not self.routes:
            return tuple(range(self.num_stages))
        return self.routes[microbatch * len(self.routes) // self.microbatches]

    def is_first_stage(self, stage: int) -> bool:
        """Does ``stage`` take the microbatches' inputs (the start of a route)?"""
        return stage == 0 if not self.routes else any(r[0] == stage for r in self.routes)

    def is_last_stage(self, stage: int) -> bool:
        """Does ``stage`` apply the loss (the end of a route)?"""
        if not self.routes:
            return stage == self.num_stages - 1
        return any(r[-1] == stage for r in self.routes)

    def previous_stage(self, stage: int) -> int | None:
        """The stage whose output ``stage`` takes: the one before it on its route, None at the
        start of a route (Note: [routes]: routes are consecutive runs of stages)."""
        return None if self.is_first_stage(stage) else stage - 1

    def next_stage(self, stage: int) -> int | None:
        """The stage that takes ``stage``'s output: the one after it on its route, None at the
        end of a route."""
        return None if self.is_last_stage(stage) else stage + 1

    def stages_on_rank(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` holds, in increasing order (its chunks 0, 1, ...)."""
        return self._stages_by_rank[rank]

    @functools.cached_property
    def _stages_by_rank(self) -> tuple[tuple[int, ...], ...]:
        """Every rank's stages, made in one pass (callers ask per rank: thousands of ranks)."""
        by_rank: list[list[int]] = [[] for _ in self.ranks]
        for stage, rank in enumerate(self.stage_to_rank):
            by_rank[rank].append(stage)
        return tuple(tuple(stages) for stages in by_rank)

    @functools.cached_property
    def class_shares(self) -> Shares:
        """(stage, microbatch) -> (moved, dropped) share of the items with a class choice
        (Note: [class accounting], core/classes.py); empty without classes."""
        return {item: (choice.moved, choice.dropped) for item, choice in self.classes}

    def class_choice(self, stage: int, microbatch: int) -> ClassChoice | None:
        """The classes chosen for (stage, microbatch), None when it moves whole."""
        return self._class_choices.get((stage, microbatch))

    @functools.cached_property
    def _class_choices(self) -> dict[tuple[int, int], ClassChoice]:
        return dict(self.classes)

    def with_classes(self, classes: Mapping[tuple[int, int], ClassChoice]) -> Schedule:
        """The same actions with these class choices instead of the schedule's."""
        return dataclasses.replace(self, classes=tuple(classes.items()))

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

    @functools.cached_property
    def kind_set(self) -> frozenset[Kind]:
        """The kinds of action the schedule holds (one C-level pass, made once: the planner,
        the simulator and the CLI each ask, of 10^6 actions at p = 64)."""
        return frozenset(map(_KIND, itertools.chain.from_iterable(self.ranks)))

    def has_kind(self, *kinds: Kind) -> bool:
        return not self.kind_set.isdisjoint(kinds)

    def with_ranks(self, ranks: Sequence[Sequence[Action]], name: str | None = None) -> Schedule:
        """The same placement and microbatches with other action lists."""
        return dataclasses.replace(
            self, ranks=tuple(tuple(a) for a in ranks), name=self.name if name is None else name
        )

    def without(self, *kinds: Kind) -> Schedule:
        """This schedule with every action of the given kinds removed (itself if it has none:
        a schedule is immutable, and it keeps what was ``derived`` from it)."""
        if not self.has_kind(*kinds):
            return self
        return self.with_ranks([[a for a in acts if a.kind not in kinds] for acts in self.ranks])

    def derived(self, make: Callable[[Schedule], T]) -> T:
        """``make(self)``, made on the first request and kept with this schedule: a schedule is
        immutable, so what a pass derives from it (e.g. its numbering, core/deps.py
        ``numbering``) holds as long as the schedule does, and the passes that ask share it."""
        kept = self._derived
        if make not in kept:
            kept[make] = make(self)
        return cast(T, kept[make])

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


def _check_routes(routes: tuple[tuple[int, ...], ...], stages: int, microbatches: int) -> None:
    flat = [s for route in routes for s in route]
    consecutive = all(list(r) == list(range(r[0], r[0] + len(r))) for r in routes if r)
    if len(flat) != stages or flat != list(range(stages)) or not consecutive:
        raise ScheduleError(
            f"routes {[list(r) for r in routes]} must split stages 0..{stages - 1} into "
            "consecutive runs, in order (Note: [routes])")
    if microbatches < len(routes):
        raise ScheduleError(f"{len(routes)} routes need at least {len(routes)} microbatches, "
                            f"got {microbatches}")


def infer_routes(rows: Sequence[Sequence[Action]],
                 microbatches: int) -> tuple[tuple[int, ...], ...]:
    """The routes read off which stages run each microbatch's F (``()``: every microbatch runs
    every stage). Used when loading a CSV, which has no other place to say it."""
    forward: dict[int, set[int]] = {}
    for actions in rows:
        for action in actions:
            if action.kind is Kind.F:
                forward.setdefault(action.microbatch, set()).add(action.stage)
    stage_sets = {frozenset(v) for v in forward.values()}
    if len(stage_sets) <= 1:
        return ()
    routes = tuple(tuple(sorted(s)) for s in sorted(stage_sets, key=min))
    try:
        _check_routes(routes, 1 + max(max(r) for r in routes), microbatches)
    except ScheduleError:
        return ()  # not a split into routes: leave it to the validator to say what is missing
    if len(forward) != microbatches:  # some microbatch has no F: the validator says which
        return ()
    expected = [routes[m * len(routes) // microbatches] for m in range(microbatches)]
    if any(tuple(sorted(forward.get(m, ()))) != expected[m] for m in range(microbatches)):
        return ()
    return routes


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
    if max(owner) + 1 != len(owner):  # a gap; looked for among the stages present, as a
        # range up to the largest index could be astronomically long (a typo in one cell)
        missing = next(s for s, present in enumerate(sorted(owner)) if s != present)
        raise ScheduleError(f"stage {missing} has no actions; stages must be numbered 0..S-1")
    return tuple(owner[s] for s in range(len(owner)))
