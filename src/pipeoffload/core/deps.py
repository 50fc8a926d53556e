"""What each action waits for: the one dependency rule that the validator, the passes, the
simulator and the runtime all use.

Note: [data dependencies]
- F(s, m) needs stage s-1's output for m: RECV_F(s, m) where the schedule has explicit comms,
  else F(s-1, m) directly (a same-rank hand-off in V placement needs no communication).
- I(s, m) / B(s, m) need F(s, m), the output gradient (RECV_B(s, m), or the backward of s+1),
  the activations back on the device (RELOAD(s, m) if offloaded), readable from the host
  (FETCH(s, m)) or rebuilt (RECOMPUTE(s, m)).
- W(s, m) needs I(s, m). OFFLOAD needs F; RELOAD, FETCH and OFFLOAD_WAIT need OFFLOAD;
  RECOMPUTE needs F. (OFFLOAD_WAIT holds the rank's program until the copy out is done: it
  postpones a forward so that device memory is freed before the next allocation.)
- SEND_F / SEND_B follow the computation they send; RECV_x follows the peer's SEND_x.
"Stage s-1" and "stage s+1" are the neighbours on the microbatch's route: the first stage of a
route needs no input and its last no output gradient (Note: [routes], core/schedule.py).
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Container
from dataclasses import dataclass
from typing import cast

from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.collector import cyclic_gc_paused
from pipeoffload.core.schedule import Schedule


class Dependencies:
    """Answers ``of(action)`` for one schedule (which kinds are present changes the answer)."""

    def __init__(self, schedule: Schedule, present: Container[Action] | None = None) -> None:
        """``present``: every action of ``schedule`` (e.g. a dict keyed by them), when the
        caller has that already."""
        self._present = (present if present is not None
                         else set(itertools.chain.from_iterable(schedule.ranks)))
        kinds = {action[1] for actions in schedule.ranks for action in actions}
        # Questions about kinds the schedule never has are answered without a lookup.
        self._recv_f, self._recv_b = Kind.RECV_F in kinds, Kind.RECV_B in kinds
        self._local_inputs = tuple(kind for kind in _LOCAL_INPUTS if kind in kinds)
        stages = range(schedule.num_stages)
        self._first = frozenset(s for s in stages if schedule.is_first_stage(s))
        self._last = frozenset(s for s in stages if schedule.is_last_stage(s))

    def has(self, action: Action) -> bool:
        return action in self._present

    def backward_of(self, stage: int, microbatch: int) -> Action:
        """The action that produces stage's input gradient: I if the schedule splits it, else B."""
        return Action(*self._backward_key(stage, microbatch))

    def of(self, action: Action) -> tuple[Action, ...]:
        """The actions that must complete before ``action`` may start."""
        return tuple(Action(*key) for key in self.keys_of(action))

    def keys_of(self, action: Action) -> list[tuple[int, Kind, int]]:
        """``of(action)`` as plain (stage, kind, microbatch) tuples: equal to the Actions and
        hashed alike, several times cheaper to make (the simulator asks for every action)."""
        s, kind, m = action
        present = self._present
        if kind is _F:
            if self._recv_f and (s, _RECV_F, m) in present:
                return [(s, _RECV_F, m)]
            return [(s - 1, _F, m)] if s not in self._first else []
        if kind is _I or kind is _B:
            deps = [(s, _F, m)]
            for local in self._local_inputs:
                if (s, local, m) in present:
                    deps.append((s, local, m))
            if s not in self._last:
                recv = (s, _RECV_B, m)
                deps.append(recv if self._recv_b and recv in present
                            else self._backward_key(s + 1, m))
            return deps
        if kind is _W:
            return [(s, _I, m)]
        if kind in (_OFFLOAD, _RECOMPUTE, _SEND_F):
            return [(s, _F, m)]
        if kind in (_RELOAD, _FETCH, _OFFLOAD_WAIT):
            return [(s, _OFFLOAD, m)]
        if kind is _SEND_B:
            return [self._backward_key(s, m)]
        if kind is _RECV_F:
            return [(s - 1, _SEND_F, m)]
        if kind is _RECV_B:
            return [(s + 1, _SEND_B, m)]
        raise AssertionError(f"unhandled kind {kind}")

    def _backward_key(self, stage: int, microbatch: int) -> tuple[int, Kind, int]:
        split = (stage, _I, microbatch)
        return split if split in self._present else (stage, _B, microbatch)


# The kinds as module names (Note: [hot loops], core/actions.py).
_F, _I, _W, _B = Kind.F, Kind.I, Kind.W, Kind.B
_SEND_F, _RECV_F, _SEND_B, _RECV_B = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
_OFFLOAD, _RELOAD, _FETCH = Kind.OFFLOAD, Kind.RELOAD, Kind.FETCH
_OFFLOAD_WAIT, _RECOMPUTE = Kind.OFFLOAD_WAIT, Kind.RECOMPUTE
# What a backward pass reads its saved activations from, besides its F, in this order.
_LOCAL_INPUTS = (_RELOAD, _FETCH, _RECOMPUTE)
# The kinds the dependency rule knows (torch's markers carry none).
_DEPENDENT = frozenset({_F, _I, _W, _B, _SEND_F, _RECV_F, _SEND_B, _RECV_B, _OFFLOAD,
                        _RELOAD, _FETCH, _OFFLOAD_WAIT, _RECOMPUTE})
_STAGE, _MICROBATCH = operator.itemgetter(0), operator.itemgetter(2)
_REPEATED: list[list[int]] = []  # _dense_needs found an action twice (compared by identity)


@dataclass(frozen=True)
class Numbered:
    """A schedule's actions numbered rank by rank (rank r holds indices ``first[r]`` to
    ``first[r + 1] - 1`` in program order), each with its rank and its dependencies as indices
    (``len(actions)`` for one the schedule lacks, which never completes). The validator's walk,
    the simulator and the compute-only pass all start from this; ``numbering`` keeps it with
    the schedule so that they number it once. ``repeated``: some action appears twice
    (then ``index`` keeps its last position and ``needs`` is empty)."""

    actions: list[Action]
    first: list[int]
    owner: list[int]
    needs: list[list[int]]
    repeated: bool

    @functools.cached_property
    def index(self) -> dict[Action, int]:
        """action -> its index (made on first use: numbering itself needs no lookup by action
        where ``_dense_needs`` applies)."""
        return dict(zip(self.actions, range(len(self.actions))))

    @functools.cached_property
    def walk(self) -> tuple[list[int], list[int]]:
        """Every rank's list run without a clock, each action once its dependencies ran: (the
        indices in the order they ran, each rank's position where it stopped, relative to its
        first action). A rank that stopped before its end waits forever (a deadlock)."""
        needs, first = self.needs, self.first
        ranks = len(first) - 1
        done = bytearray(len(self.actions) + 1)  # the last: a dependency never done
        order: list[int] = []
        waiting: dict[int, list[int]] = {}
        pointer = first[:-1]
        runnable = list(range(ranks))
        while runnable:
            rank = runnable.pop()
            i, stop = pointer[rank], first[rank + 1]
            while i < stop:
                for dep in needs[i]:
                    if not done[dep]:
                        waiting.setdefault(dep, []).append(rank)
                        break
                else:
                    done[i] = 1
                    order.append(i)
                    if i in waiting:
                        runnable.extend(waiting.pop(i))
                    i += 1
                    continue
                break
            pointer[rank] = i
        return order, [pointer[r] - first[r] for r in range(ranks)]


def numbering(schedule: Schedule) -> Numbered:
    """``schedule`` numbered (see Numbered), made once per schedule object and kept with it
    (``Schedule.derived``): the validator, the families' passes and the simulator share it."""
    return schedule.derived(number)


def number(schedule: Schedule) -> Numbered:
    """``schedule`` numbered (see Numbered) anew; ``numbering`` keeps it with the schedule."""
    with cyclic_gc_paused():  # one list per action, no cycles: collections would rescan them
        return _number(schedule)


def _number(schedule: Schedule) -> Numbered:
    actions = list(itertools.chain.from_iterable(schedule.ranks))
    first = [0]
    for acts in schedule.ranks:
        first.append(first[-1] + len(acts))
    owner = [r for r, acts in enumerate(schedule.ranks) for _ in acts]
    dense = _dense_needs(schedule, actions)
    if dense is not None:
        return Numbered(actions, first, owner, dense or [], dense is _REPEATED)
    index = dict(zip(actions, range(len(actions))))
    needs: list[list[int]] = []
    repeated = len(index) != len(actions)
    if not repeated:
        keys_of = Dependencies(schedule, present=index).keys_of
        # An Action hashes and compares as its (stage, kind, microbatch) tuple.
        by_key = cast(dict[tuple[int, Kind, int], int], index)
        missing = len(actions)
        needs = [[by_key.get(key, missing) for key in keys_of(a)] for a in actions]
    result = Numbered(actions, first, owner, needs, repeated)
    result.__dict__["index"] = index  # made already: the cached property's value
    return result


def _dense_needs(schedule: Schedule, actions: list[Action]) -> list[list[int]] | None:
    """``Dependencies.keys_of`` of every action as indices, looked up in one list per kind
    indexed by ``microbatch * stages + stage`` instead of hashing an action per dependency
    (a planned po-f: 130 instead of 203 ms at p = 32, m = 256, 82k actions; 358 instead of
    685 ms at p = 64, m = 512, 330k; medians of 5); ``_REPEATED`` if an action appears twice.
    None where that does not apply: a stage or microbatch out of range, a marker, far more
    (stage, microbatch) slots than actions (the caller then asks ``keys_of``). The rule is
    the one of ``keys_of`` (the readable one); tests/test_sim_fast_paths.py checks that the
    two agree over the zoo and its transformed schedules."""
    stages, count, missing = schedule.num_stages, schedule.microbatches, len(actions)
    if not actions:
        return []
    if stages * count > 2 * len(actions) + 64:  # sparse (a CSV may declare 10^13 microbatches)
        return None
    try:
        if (min(map(_STAGE, actions)) < 0 or max(map(_STAGE, actions)) >= stages
                or min(map(_MICROBATCH, actions)) < 0
                or max(map(_MICROBATCH, actions)) >= count):
            return None
    except TypeError:  # a marker without a microbatch
        return None
    at: dict[Kind, list[int]] = {}
    try:
        for i, (s, kind, m) in enumerate(actions):
            slots = at.get(kind)
            if slots is None:
                if kind not in _DEPENDENT:
                    return None
                slots = at[kind] = [missing] * (stages * count)
            k = m * stages + s
            if slots[k] != missing:
                return _REPEATED
            slots[k] = i
    except TypeError:  # a stage or microbatch that is no integer (e.g. 1.0): keys_of hashes it
        return None
    none = [missing] * (stages * count)
    forward, split, full = at.get(_F, none), at.get(_I), at.get(_B, none)
    recv_f, recv_b = at.get(_RECV_F), at.get(_RECV_B)
    send_f, send_b = at.get(_SEND_F, none), at.get(_SEND_B, none)
    offload, weight = at.get(_OFFLOAD, none), split or none
    local = [at[kind] for kind in _LOCAL_INPUTS if kind in at]
    backward = (full if split is None else  # I where the schedule splits, else B
                [i if i != missing else b for i, b in zip(split, full)])
    is_first = [schedule.is_first_stage(s) for s in range(stages)]
    is_last = [schedule.is_last_stage(s) for s in range(stages)]
    needs: list[list[int]] = []
    add = needs.append
    for s, kind, m in actions:
        k = m * stages + s
        if kind is _F:
            if recv_f is not None and recv_f[k] != missing:
                add([recv_f[k]])
            else:
                add([] if is_first[s] else [forward[k - 1]])
        elif kind is _I or kind is _B:
            deps = [forward[k]]
            for slots in local:
                if slots[k] != missing:
                    deps.append(slots[k])
            if not is_last[s]:
                deps.append(recv_b[k] if recv_b is not None and recv_b[k] != missing
                            else backward[k + 1])
            add(deps)
        elif kind is _W:
            add([weight[k]])
        elif kind is _OFFLOAD or kind is _RECOMPUTE or kind is _SEND_F:
            add([forward[k]])
        elif kind is _RELOAD or kind is _FETCH or kind is _OFFLOAD_WAIT:
            add([offload[k]])
        elif kind is _SEND_B:
            add([backward[k]])
        elif kind is _RECV_F:  # stage s - 1 (none before stage 0: k - 1 is another row)
            add([send_f[k - 1] if s > 0 else missing])
        else:  # RECV_B: stage s + 1
            add([send_b[k + 1] if s + 1 < stages else missing])
    return needs
