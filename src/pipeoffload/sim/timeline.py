"""The simulated timeline: when each action ran on which lane of its rank (``TimedAction``), made
from the event loop's record (sim/events.py) when first read."""

from __future__ import annotations

import functools
from enum import Enum
from itertools import repeat
from operator import itemgetter
from typing import NamedTuple

from pipeoffload.core.actions import Action, Kind
from pipeoffload.sim.events import RunRecord
from pipeoffload.sim.program import Program


class Lane(str, Enum):
    COMPUTE = "compute"
    D2H = "d2h"
    H2D = "h2d"
    COMM = "comm"


class TimedAction(NamedTuple):
    """When one action ran on its rank's lane (a tuple: tens of thousands are made per run)."""

    rank: int
    action: Action
    start: float
    end: float
    lane: Lane
    stall: float = 0.0  # time this compute action waited for a RELOAD beyond its other inputs


def lane_of(kind: Kind) -> Lane:
    """The lane an action of ``kind`` runs on."""
    if kind.blocks:
        return Lane.COMPUTE
    if kind is Kind.OFFLOAD:
        return Lane.D2H
    if kind in (Kind.RELOAD, Kind.FETCH):
        return Lane.H2D
    return Lane.COMM


_LANES = {kind: lane_of(kind) for kind in Kind}
_KIND = itemgetter(1)
_BY_START_END = itemgetter(2, 3)  # a TimedAction's (start, end)
# TimedActions made in C from tuples of their fields, without NamedTuple's Python-level
# __new__: 15 ms instead of 41 ms for the 82k actions of po-f at p = 32, m = 256 (the planner
# reads every plan's timeline: planner/host_memory.py).
_timed_action = functools.partial(tuple.__new__, TimedAction)


def make_timeline(program: Program, record: RunRecord) -> tuple[tuple[TimedAction, ...], ...]:
    """Per rank, the timed actions in the order the run timed them, sorted (stably) by (start,
    end); each FETCH read (Note: [fetch on use], sim/simulator.py) is an entry of its own on
    the H2D lane, right before its pass."""
    actions, started, ended = program.actions, record.started, record.ended
    lane = [_LANES[action[1]] for action in actions]
    waited = record.waits.get
    timeline = []
    for rank, order in enumerate(record.order):
        if record.reads and min(order, default=0) < 0:
            rows = [_timed_action((rank, actions[j], started[j], ended[j], lane[j],
                                   waited(j, 0.0))) if j >= 0 else _read(rank, ~j, program, record)
                    for j in order]
        else:  # every entry an action's own
            rows = list(map(_timed_action, zip(
                repeat(rank), map(actions.__getitem__, order), map(started.__getitem__, order),
                map(ended.__getitem__, order), map(lane.__getitem__, order),
                map(waited, order, repeat(0.0)))))
        rows.sort(key=_BY_START_END)
        timeline.append(tuple(rows))
    return tuple(timeline)


def _read(rank: int, j: int, program: Program, record: RunRecord) -> TimedAction:
    """The FETCH read of pass ``j`` (Note: [fetch on use], sim/simulator.py)."""
    stage, _, microbatch = program.actions[j]
    return TimedAction(rank, Action(stage, Kind.FETCH, microbatch), *record.reads[j], Lane.H2D)
