"""The shared mechanism behind the schedule families: building blocks, slot order, tightening.

Note: [building blocks] (docs/method.md sections 3 and 6, after "Pipeline Parallelism with
Controllable Memory", NeurIPS 2024). With T_F = T_I = T_W = 1 slot (a full backward B = 2), a
family assigns every pass of microbatch 0 an ideal slot on its rank; microbatch j's passes sit
``j * period`` slots later. Each rank's order is its actions sorted by ideal slot. Running that
order as soon as dependencies allow ("squeezing") is what the simulator and the runtime do, so
only the order is stored. Peak activation then depends only on each rank's order.

Note: [tightening] ``tighten`` replays an order on a unit clock and, where a rank would sit
idle, lets it run something else that is ready. Its moves never raise a rank's peak:
- an I (or B) may run before W's listed ahead of it, but never before an F, so the resident
  count at every F is unchanged (this is how zero-bubble cool-downs put the critical I first);
- a ready W fills a gap (running a W earlier only frees memory sooner);
- optionally a ready F fills a gap while the rank stays within a given cap (the paper's
  "reordering the warm-up" that pulls forwards into the fill bubble).
With unit costs every event falls on an integer time, so a one-slot filler delays nothing.
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.deps import numbering
from pipeoffload.core.errors import ScheduleError
from pipeoffload.core.schedule import Schedule

FirstSlotFn = Callable[[int, Kind], int]
"""(stage, kind) -> ideal slot of microbatch 0's pass; ties are broken by the order kinds are
listed in, then by stage."""

_UNIT_TIME = {Kind.F: 1, Kind.I: 1, Kind.W: 1, Kind.B: 2}
_F, _I, _W, _B = Kind.F, Kind.I, Kind.W, Kind.B  # Note: [hot loops], core/actions.py


def order_by_slot(
    stage_to_rank: Sequence[int],
    microbatches: int,
    kinds: Sequence[Kind],
    first_slot: FirstSlotFn,
    later: Sequence[int],
) -> list[list[Action]]:
    """Each rank's actions of ``kinds`` (for every stage and microbatch) sorted by ideal slot:
    ``first_slot(stage, kind) + later[mb]`` (``later[0] == 0``, strictly increasing: every
    family repeats its block microbatch after microbatch, so one shift serves all passes).

    Ties go to the kind listed first in ``kinds``, then to the lower stage. Each slot is made
    one integer key, slot * width + (that pair's rank in the tie order), so that sorting and
    building the actions run in C (75 -> 45 ms for zbv at p = 64, m = 256, against sorting
    (slot, kind, stage, microbatch) tuples made by a slot function per action).
    """
    later = list(later)
    if (len(later) != microbatches or not all(map(isinstance, later, itertools.repeat(int)))
            or later[:1] not in ([], [0]) or not all(map(operator.lt, later, later[1:]))):
        raise ValueError("order_by_slot: later[mb] must be integers from 0, strictly increasing, "
                         "one per microbatch")
    stages_of: dict[int, list[int]] = {}
    for stage, rank in enumerate(stage_to_rank):
        stages_of.setdefault(rank, []).append(stage)
    out = []
    for rank in range(max(stage_to_rank) + 1):
        pairs = [(tie, stage) for tie in range(len(kinds)) for stage in stages_of.get(rank, ())]
        width = len(pairs)
        shifted = [shift * width for shift in later]
        by_key: dict[int, Action] = {}
        for position, (tie, stage) in enumerate(pairs):
            kind = kinds[tie]
            first = first_slot(stage, kind)
            if not isinstance(first, int):
                raise ValueError(f"order_by_slot: slot {first!r} of stage {stage} {kind.value} "
                                 "is no integer")
            # Keys and Actions made in C (Actions by tuple.__new__, without NamedTuple's
            # Python-level __new__): 53 ms instead of 73 ms for a loop, zbv at p = 64, m = 256.
            by_key.update(zip(map((first * width + position).__add__, shifted),
                              map(tuple.__new__, itertools.repeat(Action),
                                  zip(itertools.repeat(stage), itertools.repeat(kind),
                                      range(microbatches)))))
        out.append(list(map(by_key.__getitem__, sorted(by_key))))
    return out


def first_free_slot(taken: set[int], start: int, period: int) -> int:
    """The first slot at or after ``start`` whose residue mod ``period`` is not yet taken."""
    for slot in range(start, start + period):
        if slot % period not in taken:
            return slot
    raise ValueError(f"no free slot left in a period of {period}")


def order_peaks(ranks: Iterable[Sequence[Action]]) -> tuple[int, ...]:
    """Per rank, the most (stage, microbatch) activations resident at once, in chunk units.

    Counts each F at its start and each W / B at its end, on the order alone (a rank runs one
    compute action at a time, so the order fixes this count).
    """
    peaks = []
    for actions in ranks:  # the count only falls after a W or B: its peak follows an F
        changes = [1 if kind is _F else -1 for _, kind, _ in actions
                   if kind is _F or kind is _W or kind is _B]
        peaks.append(max(0, max(itertools.accumulate(changes), default=0)))
    return tuple(peaks)


def tighten(
    schedule: Schedule,
    *,
    i_first: bool = True,
    fill_w: bool = True,
    f_cap: Sequence[int] | None = None,
) -> Schedule:
    """Replay ``schedule`` (compute actions only, valid) on a unit clock (F = I = W = 1, B = 2)
    and return the order actually run when idle slots are filled as Note [tightening] says.

    ``f_cap[r]``: let rank r pull a ready forward into a gap if the rest of its order, run as
    listed after it, then never holds more than ``f_cap[r]`` activations (chunk units); pass
    the order's own ``order_peaks`` to keep every peak. None disables forward pulling.
    """
    return schedule.with_ranks(_Replay(schedule, i_first, fill_w, f_cap).run())


class _Replay:
    """One ``tighten`` replay. Actions are replayed by index (core/deps.py ``numbering``): a
    dependency is a list lookup, not a hashed Action (about three times faster at p = 64)."""

    def __init__(self, schedule: Schedule, i_first: bool, fill_w: bool,
                 f_cap: Sequence[int] | None) -> None:
        numbered = numbering(schedule)
        if numbered.repeated:
            raise ScheduleError(f"{schedule.name}: an action appears twice; "
                                "validate(schedule) shows where")
        self.name, self.i_first, self.fill_w, self.f_cap = schedule.name, i_first, fill_w, f_cap
        self.actions, self.needs = numbered.actions, numbered.needs
        self.kind_of = [action[1] for action in self.actions]
        self.stage_of = [action[0] for action in self.actions]
        self.weight_of = {self.needs[w][0]: w for w, kind in enumerate(self.kind_of)
                          if kind is _W}  # I -> its W
        never = len(self.actions) * 2 + 2  # later than any unit-clock time of this replay
        self.done = [never] * (len(self.actions) + 1)  # the last: a dependency it lacks
        ranks = range(schedule.num_ranks)
        self.remaining = [list(range(numbered.first[r], numbered.first[r + 1])) for r in ranks]
        self.free_at = [0] * len(ranks)  # when each rank's current action ends
        self.level = [0] * len(ranks)  # each rank's resident activations, in chunk units
        self.ready_w: list[deque[int]] = [deque() for _ in ranks]  # Ws whose I has run
        self.stage_count = [len(schedule.stages_on_rank(r)) for r in ranks]
        self.now = 0

    def run(self) -> list[list[Action]]:
        """Each rank's order as run: at each time a rank is free, it starts the head of its
        order if that is a ready F, I or B, else what ``_choose`` picks, else it waits. An
        action started moves the rank's level (F up, W or B down) and makes its W ready."""
        out: list[list[Action]] = [[] for _ in self.remaining]
        actions, needs, done, kind_of = self.actions, self.needs, self.done, self.kind_of
        free_at, level, ready_w, weight_of = self.free_at, self.level, self.ready_w, self.weight_of
        left = len(actions)
        while left:
            now = self.now
            for rank, todo in enumerate(self.remaining):
                if free_at[rank] > now or not todo:
                    continue
                head = todo[0]
                for dep in needs[head]:
                    if done[dep] > now:
                        position = self._choose(rank, False)
                        break
                else:  # the head is ready: an F, I or B runs at once (most steps do this)
                    position = 0 if kind_of[head] is not _W else self._choose(rank, True)
                if position is None:
                    continue
                index = todo.pop(position)
                kind = kind_of[index]
                if kind is _W:
                    ready_w[rank].remove(index)
                elif kind is _I and index in weight_of:
                    ready_w[rank].append(weight_of[index])
                if kind is _F:
                    level[rank] += 1
                elif kind is _W or kind is _B:
                    level[rank] -= 1
                free_at[rank] = done[index] = now + _UNIT_TIME[kind]
                out[rank].append(actions[index])
                left -= 1
            busy = [t for t in free_at if t > now]
            if not busy:
                raise ScheduleError(f"{self.name}: the order deadlocks at slot {now}; "
                                    "validate(schedule) shows where")
            self.now = min(busy)
        return out

    def _ready(self, index: int) -> bool:
        done, now = self.done, self.now
        for dep in self.needs[index]:
            if done[dep] > now:
                return False
        return True

    def _choose(self, rank: int, head_ready: bool) -> int | None:
        """The position in the rank's remaining order of what it runs now, if anything, when
        its head is not a ready F, I or B (``run`` takes those itself)."""
        if self.i_first:
            position = self._critical_backward(rank)
            if position is not None:
                return position
        if head_ready:
            return 0
        if self.fill_w:
            position = self._ready_weight(rank)
            if position is not None:
                return position
        if self.f_cap is not None:
            return self._pullable_forward(rank, self.f_cap[rank])
        return None

    def _critical_backward(self, rank: int) -> int | None:
        """A ready I or B listed before the rank's next F (it may pass Ws, never an F)."""
        kind_of = self.kind_of
        for position, index in enumerate(self.remaining[rank]):
            kind = kind_of[index]
            if kind is _F:
                break
            if (kind is _I or kind is _B) and self._ready(index):
                return position
        return None

    def _ready_weight(self, rank: int) -> int | None:
        """A W whose I has ended, to fill a gap (it only frees memory sooner)."""
        for index in self.ready_w[rank]:
            if self.done[self.needs[index][0]] <= self.now:
                return self.remaining[rank].index(index)
        return None

    def _pullable_forward(self, rank: int, cap: int) -> int | None:
        """A ready F that may run before everything listed ahead of it: each F among those
        then holds one more, so it fits if the level plus one plus ``rise`` (the most the level
        climbs at an F before it, 0 if it never does) stays within ``cap``. One pass answers
        this for every candidate; only each stage's next forward may be pulled."""
        seen_stages: set[int] = set()
        climb = rise = 0
        fits_below = cap - self.level[rank] - 1
        for position, index in enumerate(self.remaining[rank]):
            kind = self.kind_of[index]
            if kind is _F:
                stage = self.stage_of[index]
                if stage not in seen_stages:
                    seen_stages.add(stage)
                    if rise <= fits_below and self._ready(index):
                        return position
                    if len(seen_stages) == self.stage_count[rank]:
                        break
                climb += 1
                if climb > rise:
                    rise = climb
            elif kind is _W or kind is _B:
                climb -= 1
        return None
