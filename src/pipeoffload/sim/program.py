"""A schedule numbered for the simulator's inner loop: every action gets an index, and what the
loop asks of it (its dependencies, how long it takes, which queue it waits in) is looked up once
here instead of once per visit. Plans at p = 32, m = 256 have ~10^5 actions; simulating them is
most of the offload planner's time (docs/offload.md, planning time).
"""

from __future__ import annotations

from enum import IntEnum

from pipeoffload.core.actions import Action, Kind, items_of, positions_of
from pipeoffload.core.deps import numbering
from pipeoffload.core.errors import ScheduleError
from pipeoffload.core.schedule import Schedule
from pipeoffload.sim.costs import CostModel

_PASSES = frozenset({Kind.I, Kind.W, Kind.B})  # the backward passes that read saved activations


class Step(IntEnum):
    """How the simulator's loop treats an action."""

    RUN = 0  # placed when its inputs are ready: compute, OFFLOAD_WAIT, SEND / RECV
    COPY_OUT = 1  # OFFLOAD: queued on the D2H lane, ready when its forward starts
    COPY_BACK = 2  # RELOAD: queued on the H2D lane
    FETCH_MARK = 3  # FETCH: a marker, done when its copy out is (Note: [fetch on use])
    READ_PASS = 4  # a backward pass of a fetched activation: its read queues on the H2D lane


_STEPS = {kind: Step.RUN for kind in Kind} | {
    Kind.OFFLOAD: Step.COPY_OUT, Kind.RELOAD: Step.COPY_BACK, Kind.FETCH: Step.FETCH_MARK}
_BLOCKS = {kind: kind.blocks for kind in Kind}
_COPY_OUT, _COPY_BACK, _READ_PASS = Step.COPY_OUT, Step.COPY_BACK, Step.READ_PASS


class Program:
    """``schedule`` with every action numbered rank by rank (rank r holds indices
    ``first[r]`` to ``first[r + 1] - 1``, in program order).

    Per index: ``actions`` (``index`` maps them back), ``owner`` (its rank), ``step``,
    ``duration`` (compute time), ``needs`` (its dependencies' indices; one the schedule lacks
    is ``len(actions)``, which never completes), ``blocks`` (it holds its rank's program until
    it ends), ``source`` (an OFFLOAD's forward, else -1), ``channel`` and ``copy_time`` (the
    host-link queue, numbered below ``channels``, and duration of its copy or read; -1 and 0.0
    for other actions).
    Raises ScheduleError if an action appears twice (it could not be numbered).
    """

    def __init__(self, schedule: Schedule, costs: CostModel) -> None:
        numbered = numbering(schedule)  # kept with the schedule: numbered once
        if numbered.repeated:
            self._reject_repeats(schedule)
        actions = numbered.actions
        self.schedule, self.actions, self._numbered = schedule, actions, numbered
        self.first, self.owner, self.needs = numbered.first, numbered.owner, numbered.needs
        # What depends on the kind (and stage) only is looked up in tables, not asked of each
        # action (Note: [hot loops], core/actions.py).
        kinds = [action[1] for action in actions]
        self.step: list[Step] = [_STEPS[kind] for kind in kinds]
        fetched = items_of(actions, kinds, Kind.FETCH)
        if fetched:
            read_pass = Step.READ_PASS
            self.step = [read_pass if kind in _PASSES and (s, m) in fetched else step
                         for (s, kind, m), step in zip(actions, self.step)]
        stages = range(schedule.num_stages)
        took = {kind: [costs.compute_time(Action(s, kind, 0)) for s in stages] for kind in Kind}
        self.duration: list[float] = [took[kind][s] for s, kind, _ in actions]
        self.blocks: list[bool] = [_BLOCKS[kind] for kind in kinds]
        self.source = [-1] * len(actions)
        self.channel = [-1] * len(actions)
        self.copy_time = [0.0] * len(actions)
        self.channels = self._number_queues(costs)
        if schedule.classes:
            self._apply_classes(costs)

    def _apply_classes(self, costs: CostModel) -> None:
        """Class choices (Note: [class accounting], core/classes.py): an item's copies and
        reads take its moved share of a whole copy; its first backward pass (I, or B without a
        split) also recomputes its dropped classes."""
        schedule, actions = self.schedule, self.actions
        for j, (s, kind, m) in enumerate(actions):
            choice = schedule.class_choice(s, m)
            if choice is None:
                continue
            if self.channel[j] >= 0:
                self.copy_time[j] *= choice.moved
            if choice.recomputed and (kind is Kind.I or kind is Kind.B):
                self.duration[j] += choice.recompute_time * costs.compute_time(
                    Action(s, Kind.F, m))

    def _number_queues(self, costs: CostModel) -> int:
        """Write each copy's and read's host-link queue and duration (and each copy out's
        forward) by index; return how many queues there are."""
        numbers: dict[tuple[int, str], int] = {}  # host-link queue -> its number
        ranks, stages = range(self.schedule.num_ranks), range(self.schedule.num_stages)
        actions, owner, channel, copy_time = self.actions, self.owner, self.channel, self.copy_time
        for step, kind in ((_COPY_OUT, Kind.OFFLOAD), (_COPY_BACK, Kind.RELOAD),
                           (_READ_PASS, Kind.RELOAD)):
            where = positions_of(self.step, step)
            if not where:
                continue
            queue = [numbers.setdefault(costs.host_link.channel(rank, kind), len(numbers))
                     for rank in ranks]
            seconds = [costs.transfer_time(stage, kind) for stage in stages]
            for j in where:
                channel[j] = queue[owner[j]]
                copy_time[j] = seconds[actions[j][0]]
            if step is _COPY_OUT:  # an OFFLOAD's one dependency: its F
                for j in where:
                    self.source[j] = self.needs[j][0]
        return len(numbers)

    @property
    def index(self) -> dict[Action, int]:
        """action -> its index."""
        return self._numbered.index

    @staticmethod
    def _reject_repeats(schedule: Schedule) -> None:
        seen: set[Action] = set()
        for rank, position, action in schedule.actions:
            if action in seen:
                raise ScheduleError(
                    f"rank {rank}, position {position}: {action} appears twice; each action "
                    "runs exactly once (pipeoffload.core.validate.validate explains)",
                    rank=rank, position=position, action=action)
            seen.add(action)

