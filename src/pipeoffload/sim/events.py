"""The simulator's event loop: when each action of a numbered schedule (sim/program.py) starts
and ends, by the rules of sim/simulator.py's module docstring.

Each rank's program is a generator (``_EventLoop._program``) that runs the rank's actions in
order, keeping its clock and position in its own frame, and suspends where an action waits for
a dependency not yet timed or for the FETCH read of its pass; the loop resumes it when that is
timed. Transfers wait in a heap by readiness and are placed one at a time on their host-link
queue (``_place_transfer``), since ranks can share a queue. Whatever is placed on a lane goes
through ``_place``, which also resumes the ranks waiting for it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from typing import NamedTuple

from pipeoffload.core.actions import Kind
from pipeoffload.errors import ScheduleError
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.program import Program, Step

# The steps as module names (Note: [hot loops], core/actions.py).
_RUN, _COPY_OUT, _COPY_BACK = Step.RUN, Step.COPY_OUT, Step.COPY_BACK
_FETCH_MARK, _READ_PASS = Step.FETCH_MARK, Step.READ_PASS
_PAIR_PARTNERS = (Kind.I, Kind.B)  # what may run overlapped with a forward


class RunRecord(NamedTuple):
    """What the event loop leaves, by program index (sim/program.py).

    ``order``: per rank, the order it timed the rank's actions in (an index, or ``~index`` for
    the FETCH read of that pass: see ``reads``); ``stall``: per rank, the time its compute
    waited for copies back and reads; ``started`` / ``ended``: when each action started and
    ended on its lane (a FETCH marker, on no lane, ends when its rank reaches it or its copy out
    ends, whichever is later: the latest of ``ended`` is the timeline's latest end); ``waits``:
    how long each action that stalled waited; ``reads``: each FETCH read's (start, end) by its
    pass's index."""

    order: list[list[int]]
    stall: list[float]
    started: list[float]
    ended: list[float]
    waits: dict[int, float]
    reads: dict[int, tuple[float, float]]


def run_program(program: Program, costs: CostModel) -> RunRecord:
    """Time every action of ``program`` under ``costs``; raise ScheduleError on a deadlock."""
    return _EventLoop(program, costs).run()


class _EventLoop:
    """The state of one run (see the module docstring)."""

    def __init__(self, program: Program, costs: CostModel) -> None:
        self.program = program
        self.p2p, self.overlap = costs.p2p_time, costs.overlap_f_b
        ranks = range(program.schedule.num_ranks)
        count = len(program.actions)
        # When each action's result may be used (the last entry: a dependency the schedule
        # lacks, never done); a paired forward's is the pair's end, its lane end in ``lane_end``.
        self.end: list[float | None] = [None] * (count + 1)
        self.began = [0.0] * count
        self.lane_end: dict[int, float] = {}
        self.order: list[list[int]] = [[] for _ in ranks]
        self.stall = [0.0] * len(ranks)
        self.waits: dict[int, float] = {}  # index -> how long it stalled, where it did
        self.reads: dict[int, tuple[float, float]] = {}  # a read pass's index -> its read
        self.at = program.first[:-1]  # where each rank's program is (for a deadlock's report)
        self.waiting: dict[int, list[int]] = {}  # index -> the ranks waiting for it
        self.runnable = list(ranks)  # ranks to resume, the last first
        # Transfers and reads by readiness: (ready, sequence number, rank, index).
        self.pending: list[tuple[float, int, int, int]] = []
        self.sequence = itertools.count()
        self.channel_free = [0.0] * program.channels  # when each host-link queue is next free
        self.reading: dict[int, float] = {}  # queued read pass -> when its other inputs allowed
        self.paired: dict[int, float] = {}  # the backward of an overlapped pair -> its factor
        self.pair_end: dict[int, float] = {}  # the forward of an overlapped pair -> pair's end
        # Which actions' ends count towards a stall: all but copies back and FETCH markers.
        self.not_copy_back = [k is not _COPY_BACK and k is not _FETCH_MARK for k in program.step]
        self.programs = [self._program(rank) for rank in ranks]

    def run(self) -> RunRecord:
        """Resume ranks until none can go on, then place the readiest transfer; repeat until
        no transfer is left."""
        programs, runnable, pending = self.programs, self.runnable, self.pending
        while True:
            while runnable:
                next(programs[runnable.pop()], None)
            if not pending:
                break
            ready, _, rank, j = heapq.heappop(pending)
            self._place_transfer(rank, j, ready)
        self._check_finished()
        ended: list[float] = self.end[:-1]  # type: ignore[assignment]  # all done: checked
        for j, done in self.lane_end.items():
            ended[j] = done
        return RunRecord(self.order, self.stall, self.began, ended, self.waits, self.reads)

    def _program(self, rank: int) -> Iterator[None]:
        """Rank ``rank``'s program: each action starts once its dependencies allow (plus the
        P2P latency for one on another rank) and its rank reached it; compute and waits hold
        the rank until they end, transfers are queued (FETCH read passes hold it until placed).
        Suspends while an action waits for a dependency not yet timed."""
        program, p2p = self.program, self.p2p
        needs, owner, end, steps, duration = (program.needs, program.owner, self.end,
                                              program.step, program.duration)
        blocks, source, began = program.blocks, program.source, self.began
        not_copy_back = self.not_copy_back
        waiting, waits, place = self.waiting, self.waits, self._place
        overlapping = self.overlap is not None
        now = stalled = 0.0  # the rank's clock; its stall so far
        for j in range(program.first[rank], program.first[rank + 1]):
            while True:  # until every dependency of j is timed
                ready = other = now  # when all its inputs allow; all but copies back
                for dep in needs[j]:
                    at = end[dep]
                    if at is None:
                        break
                    if p2p and owner[dep] != rank:  # (adding 0.0 would change nothing)
                        at += p2p
                    if at > ready:
                        ready = at
                    if at > other and not_copy_back[dep]:  # a stall waits for a copy back
                        other = at
                else:
                    break
                waiting.setdefault(dep, []).append(rank)
                self.at[rank] = j
                yield
            step = steps[j]
            if step is _RUN:
                took = duration[j]
                if overlapping:
                    took *= self._pair_factor(rank, j, ready)
                done = ready + took
                if blocks[j]:
                    if ready > other:  # (most actions do not wait: no new float)
                        waited = waits[j] = ready - other
                        stalled += waited
                    now = done
                place(rank, j, ready, done)
                if overlapping and j in self.pair_end:  # its output leaves with the pair's
                    self.lane_end[j] = done
                    end[j] = self.pair_end.pop(j)
            elif step is _FETCH_MARK:  # on no lane: done once its copy out is
                end[j] = ready
                self.runnable.extend(waiting.pop(j, ()))
            else:  # a copy streams out from its forward's start ([streaming offload])
                self._queue(rank, j, began[source[j]] if step is _COPY_OUT else ready)
                if step is _READ_PASS:  # the rank waits until the read is placed
                    self.reading[j] = other
                    yield
                    now = end[j]  # type: ignore[assignment]  # placed with its read
                    stalled += waits[j]
        self.stall[rank] = stalled
        self.at[rank] = program.first[rank + 1]

    def _queue(self, rank: int, j: int, ready: float) -> None:
        heapq.heappush(self.pending, (ready, next(self.sequence), rank, j))

    def _place(self, rank: int, j: int, start: float, done: float) -> None:
        """Time action ``j`` on its lane and resume the ranks that waited for it."""
        self.order[rank].append(j)
        self.began[j] = start
        self.end[j] = done
        woken = self.waiting.pop(j, None)
        if woken:
            self.runnable.extend(woken)

    def _place_transfer(self, rank: int, j: int, ready: float) -> None:
        """Place a copy, or the FETCH read of pass ``j``, on its host-link queue: it starts
        when the queue is free and ends a copy time later; a copy out not before its forward
        (its last bytes exist only then)."""
        program, free = self.program, self.channel_free
        queue = program.channel[j]
        start = free[queue] if free[queue] > ready else ready
        done = start + program.copy_time[j]
        if program.step[j] is _COPY_OUT:
            until: float = self.end[program.source[j]]  # type: ignore[assignment]  # queued after
            if until > done:
                done = until
        free[queue] = done
        if j in self.reading:
            self._place_read_pass(rank, j, ready, start, done)
        else:
            self._place(rank, j, start, done)

    def _place_read_pass(self, rank: int, j: int, ready: float, start: float,
                         done: float) -> None:
        """A backward pass of a fetched activation whose read runs from ``start`` to ``done``
        (Note: [fetch on use]): it cannot end before its read does, so a slow read stretches
        it (the difference is a stall); its rank then goes on."""
        self.reads[j] = (start, done)
        self.order[rank].append(~j)  # the read's entry, right before its pass's
        took = self.program.duration[j]
        begin = max(ready, done - took)
        self.waits[j] = begin - self.reading.pop(j)
        self._place(rank, j, begin, begin + took)
        self.runnable.append(rank)

    def _pair_factor(self, rank: int, j: int, ready: float) -> float:
        """The time factor of action ``j`` (starting at ``ready``) from overlapped pairs (Note:
        [overlapped pair]): its own, if it is the backward of a pair; for a forward that pairs
        with its rank's next blocking action, the pair's (kept for that partner); else 1.0."""
        program = self.program
        if j in self.paired:
            return self.paired.pop(j)
        actions, needs, end = program.actions, program.needs, self.end
        if actions[j].kind is not Kind.F:
            return 1.0
        blocks = program.blocks
        partner = next((k for k in range(j + 1, program.first[rank + 1]) if blocks[k]), None)
        if (partner is None or actions[partner].kind not in _PAIR_PARTNERS
                or actions[partner].microbatch == actions[j].microbatch
                or program.step[partner] is _READ_PASS):
            return 1.0
        for dep in needs[partner]:
            done = end[dep]
            if done is None or done + (self.p2p if program.owner[dep] != rank else 0.0) > ready:
                return 1.0
        f, b = program.duration[j], program.duration[partner]
        if f + b <= 0:
            return 1.0
        factor = 1.0 - (self.overlap or 0.0) * min(f, b) / (f + b)
        self.paired[partner] = factor
        self.pair_end[j] = ready + (f + b) * factor
        return factor

    def _check_finished(self) -> None:
        """Raise ScheduleError naming where each rank stopped, if some did before its end."""
        program = self.program
        stuck = [r for r, at in enumerate(self.at) if at < program.first[r + 1]]
        if not stuck:
            return
        position = {r: self.at[r] - program.first[r] for r in stuck}
        where = "; ".join(f"rank {r} at position {position[r]} ({program.actions[self.at[r]]})"
                          for r in stuck)
        raise ScheduleError(
            f"simulation deadlocked, no rank can continue: {where}. "
            "pipeoffload.core.validate.validate(schedule) explains what each one waits for",
            rank=stuck[0], position=position[stuck[0]], action=program.actions[self.at[stuck[0]]],
        )
