"""Discrete-event simulation of a schedule over a cost model.

Each rank runs its action list in order, like a program:
- compute actions (F, I, W, B, RECOMPUTE) occupy the rank's compute lane; the program waits
  for each to finish before reading the next action;
- transfers (OFFLOAD, RELOAD) are issued when the program reaches them and do not block it;
  they wait in their host-link queue (see HostLink) and for their dependencies;
- OFFLOAD_WAIT holds the program until the named OFFLOAD completes (a postponement, not a
  stall);
- FETCH is a marker (it waits for its OFFLOAD); each backward pass (I, W or B) of a fetched
  (stage, microbatch) then reads the activation back while it runs: see Note: [fetch on use];
- SEND / RECV actions, if the schedule has them, take no time; a RECV completes when its peer's
  SEND has completed plus the P2P latency;
- every dependency that crosses ranks adds ``CostModel.p2p_time``.
A compute action that waits on a RELOAD or a FETCH read beyond the time it could otherwise
start is stalled; the stall is reported per rank. Memory follows design.md's accounting (see
``memory_events`` in sim/memory.py).

Note: [fetch on use]
The time-mirror of streaming offload. A backward pass of a fetched (s, m) reads each saved tensor
from host memory when it uses it and drops the copy after use, so nothing of (s, m) is held on the
device between uses (in the fluid limit; in practice about one layer's tensors are in flight).
Each pass is charged a read of the whole activation over the host link. That is an estimate: the
runtime reads each saved storage once per autograd node that unpacks it while no copy of it is
alive, so a B can read a little more than its activation, and an I and its W together often
about what one B reads (``ActivationOffloader.fetched_bytes`` counts it). The read is a
transfer on the rank's H2D queue, queued when the pass could start; the pass cannot end before
its read does (a read slower than the pass stretches it: the difference is a stall). The
timeline shows each read as a FETCH bar on the H2D lane, one per pass.

Note: [overlapped pair]
DualPipe runs a forward of one microbatch and a full backward of another at once, hiding the
communication of each behind the compute of the other; DeepSeek's F&B. We write the pair as its
two actions in order (torch's ``(0F3;7B2)OVERLAP_F_B`` cell loads as ``0F3, 7B2``), so the
validator, the passes, the renderers, CSV and the runtime (which runs them one after the other,
as torch does) need nothing new. By default (``CostModel.overlap_f_b`` None) the simulator times
them as our runtime runs them: back to back, the F's output leaving when the F ends. Given
``overlap_f_b`` (0..1) it times as DeepSeek's executor runs a pair: any F whose next blocking
action on its rank is an I or B of another microbatch already free to start when the F is (a
pair never delays the F) makes a pair with it; the pair takes F&B = F + B - overlap_f_b *
min(F, B) (both passes shortened by one factor, so the lane still shows F then B), and both
outputs leave when the pair ends. With overlap_f_b = 0 this reproduces DeepSeek-V3's Table 2
bubble for DualPipe (docs/schedules.md).
"""

from __future__ import annotations

import functools
import heapq
import operator
from dataclasses import dataclass, field
from enum import Enum
from itertools import repeat
from typing import NamedTuple

from pipeoffload.core.actions import MARKER_KINDS, Action, Kind, positions_of
from pipeoffload.core.schedule import Schedule
from pipeoffload.errors import ScheduleError
from pipeoffload.sim.collector import cyclic_gc_paused
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.memory import Change, copy_seconds, curve, peak, rank_changes
from pipeoffload.sim.program import Program, Step


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


@dataclass(frozen=True)
class SimResult:
    """What a schedule does in time and memory under a cost model.

    ``peak_activation`` is in M_a units (one microbatch through all of a rank's stages);
    ``peak_bytes`` is set when the cost model gives activation bytes. ``memory[r]`` is rank r's
    resident-activation curve as (time, units) points, one after each change.
    """

    schedule: Schedule
    costs: CostModel
    makespan: float
    compute_time: tuple[float, ...]
    bubble_rate: float
    peak_activation: tuple[float, ...]
    peak_bytes: tuple[float, ...] | None
    stall_time: tuple[float, ...]
    program: Program = field(repr=False, compare=False)
    """The numbered schedule the run used, for passes that walk the same dependencies again
    (offload/forecast.py)."""
    times: tuple[list[float], list[float]] = field(repr=False, compare=False)
    """When each action of ``program`` started and ended, by its index (what ``memory``
    is read off; the timeline's floats)."""
    run: _Run = field(repr=False, compare=False)
    """The event loop's record, which ``timeline`` is made from."""
    changes: tuple[list[Change], ...] | None = field(default=None, repr=False, compare=False)
    """Each rank's memory changes, where ``simulate`` was asked to keep them."""

    # The timeline and the memory curves are made when first read: a plan at p = 64,
    # m = 1024 has 1.3 M timed actions and 1.7 M curve points, which the offload planner's
    # probes never read (they read peaks, times and changes). Both are fixed by the result's
    # other fields (the schedule, the cost model and the run), so equality needs neither.
    @functools.cached_property
    def timeline(self) -> tuple[tuple[TimedAction, ...], ...]:
        """Per rank, when each action ran on its lane, sorted by (start, end) and, at equal
        times, in the order the run timed them; each FETCH read (Note: [fetch on use]) is an
        entry of its own on the H2D lane, timed right before its pass."""
        return _timeline(self.program, self.run)

    @functools.cached_property
    def memory(self) -> tuple[tuple[tuple[float, float], ...], ...]:
        """Per rank, the resident-activation curve as (time, units) points, one after each
        change, from (0, 0)."""
        units = activation_units(self.schedule, self.costs)
        return tuple(curve(self.memory_changes(rank), units)[0]
                     for rank in range(self.schedule.num_ranks))

    @property
    def total_stall_time(self) -> float:
        return sum(self.stall_time)

    def rank_times(self, rank: int) -> tuple[list[float], list[float]]:
        """When each action of the rank's program started and ended, by position (a FETCH
        marker's own times; ``memory.rank_times`` of the timeline puts one of its reads there:
        no memory change reads them)."""
        here = slice(self.program.first[rank], self.program.first[rank + 1])
        return self.times[0][here], self.times[1][here]

    def kind_times(self, rank: int, *kinds: Kind
                   ) -> list[tuple[list[Action], list[float], list[float]]]:
        """For each of ``kinds``: the rank's actions of that kind in program order, when each
        started and when it ended, picked out by position in C (the offload planner's passes
        read these instead of the timeline: Note: [hot loops], core/actions.py)."""
        actions = self.schedule.ranks[rank]
        start, end = self.rank_times(rank)
        kind_at = list(map(_KIND, actions))
        out = []
        for kind in kinds:
            where = positions_of(kind_at, kind)
            out.append((list(map(actions.__getitem__, where)), list(map(start.__getitem__, where)),
                        list(map(end.__getitem__, where))))
        return out

    def rank_waits(self, rank: int) -> list[float]:
        """How long each action of the rank's program waited for a copy back or a read beyond
        its other inputs (the timeline's ``stall``), by position."""
        first = self.program.first[rank]
        return list(map(self.run.waits.get, range(first, self.program.first[rank + 1]),
                        repeat(0.0)))

    def memory_changes(self, rank: int) -> list[Change]:
        """The rank's memory changes, sorted (sim/memory.py ``rank_changes``): what
        ``memory[rank]`` sums; the kept list itself (not to be changed) where ``simulate``
        kept them, else made again."""
        if self.changes is not None:
            return self.changes[rank]
        return rank_changes(self.schedule.ranks[rank], *self.rank_times(rank),
                            copy_seconds(self.schedule, self.costs))

    def timed(self, action: Action) -> TimedAction:
        """The timing of one action (linear search; for tests and reports, not hot loops)."""
        rank = self.schedule.rank_of(action.stage)
        for item in self.timeline[rank]:
            if item.action == action:
                return item
        raise KeyError(f"{action} is not in the schedule")


def simulate(schedule: Schedule, costs: CostModel | None = None, *,
             keep_changes: bool = False) -> SimResult:
    """Run ``schedule`` on the cost model's clock; raise ScheduleError on a deadlock. torch's
    markers (UNSHARD / RESHARD / REDUCE_GRAD) cost no time: they are left out of the run and of
    the result (Note: [torch markers], core/actions.py). ``keep_changes``: keep each rank's
    memory changes on the result (``SimResult.memory_changes``; about 100 bytes a change,
    ~4 per offloaded activation) for a caller that reads them all again."""
    costs = costs or CostModel()
    schedule = schedule.without(*MARKER_KINDS)  # itself when it has none
    with cyclic_gc_paused():
        program = Program(schedule, costs)
        return _summarise(schedule, costs, _run(program, costs), program, keep_changes)


def _lane(kind: Kind) -> Lane:
    if kind.blocks:
        return Lane.COMPUTE
    if kind is Kind.OFFLOAD:
        return Lane.D2H
    if kind in (Kind.RELOAD, Kind.FETCH):
        return Lane.H2D
    return Lane.COMM


_LANES = {kind: _lane(kind) for kind in Kind}
_COMPUTE_PASSES = frozenset({Kind.F, Kind.I, Kind.W, Kind.B})  # what compute_time counts
_COUNTED = {kind: kind in _COMPUTE_PASSES for kind in Kind}
_KIND = operator.itemgetter(1)
_BY_START_END = operator.itemgetter(2, 3)  # a TimedAction's (start, end)
# TimedAction from a full tuple of its fields, without NamedTuple's Python-level __new__.
_timed_action = functools.partial(tuple.__new__, TimedAction)
# The steps as module names (Note: [hot loops], core/actions.py).
_RUN, _COPY_OUT, _COPY_BACK = Step.RUN, Step.COPY_OUT, Step.COPY_BACK
_FETCH_MARK, _READ_PASS = Step.FETCH_MARK, Step.READ_PASS


class _Run(NamedTuple):
    """What the event loop leaves: per rank the order it timed the rank's actions in (an
    index, or ``~index`` for the FETCH read of that pass, see ``reads``), the stall and the
    seconds of each F, I, W and B in program order; per program index when the action started
    and ended on its lane (for the memory accounting and the timeline), the waits of those that
    stalled, and each FETCH read's (start, end) by its pass's index."""

    order: list[list[int]]
    stall: list[float]
    passes: list[list[float]]
    started: list[float]
    ended: list[float]
    """Its largest is the timeline's latest end: a FETCH marker ends when its rank reaches it
    or its copy out ends, whichever is later, and a FETCH read before its pass ends."""
    waits: dict[int, float]
    reads: dict[int, tuple[float, float]]


def _run(program: Program, costs: CostModel) -> _Run:
    """The event loop. Compute is placed as soon as its dependencies are timed (a rank's lane
    has no contention); transfers are placed in order of readiness, since host links can be
    shared between ranks. Works on ``Program`` indices: actions are looked up once, not per
    visit."""
    schedule = program.schedule
    actions, step, needs, duration = (program.actions, program.step, program.needs,
                                      program.duration)
    blocks, is_compute, is_forward = program.blocks, program.is_compute, program.is_forward
    channel, copy_time, source = program.channel, program.copy_time, program.source
    owner, p2p = program.owner, costs.p2p_time
    kinds = list(map(_KIND, actions))
    end: list[float | None] = [None] * (len(actions) + 1)  # the last: a dependency never done
    began = [0.0] * len(actions)  # starts (a copy out streams from its forward's)
    counted = list(map(_COUNTED.__getitem__, kinds))  # what compute_time sums
    not_copy_back = [k is not _COPY_BACK and k is not _FETCH_MARK for k in step]
    passes: list[list[float]] = [[] for _ in schedule.ranks]  # their seconds, program order
    pair_done: dict[int, float] = {}  # a paired forward's lane end (``end`` has the pair's)
    # The timeline is recorded as indices, made into TimedActions only if read (_timeline).
    order: list[list[int]] = [[] for _ in schedule.ranks]
    waits: dict[int, float] = {}  # index -> how long it stalled, where it did
    reads: dict[int, tuple[float, float]] = {}  # a read pass's index -> its FETCH read
    pointer = program.first[:-1]
    stop = program.first[1:]
    issue = [0.0] * schedule.num_ranks  # when each rank's program reached its current action
    stall = [0.0] * schedule.num_ranks
    waiting: dict[int, list[int]] = {}
    pending: list[tuple[float, int, int, int]] = []  # transfers: (ready, seq, rank, index)
    channel_free = [0.0] * program.channels  # when each host-link queue is next free
    seq = 0
    # Backward passes that read a fetched activation queue for the host link like a transfer;
    # their rank's program is blocked until the read is placed (see [fetch on use]).
    reading: dict[int, float] = {}  # queued pass -> time its other inputs allowed
    blocked = [False] * schedule.num_ranks
    paired: dict[int, float] = {}  # the backward of an overlapped pair -> its time factor
    pair_end: dict[int, float] = {}  # the forward of an overlapped pair -> when the pair ends
    overlap = costs.overlap_f_b
    heappush, heappop = heapq.heappush, heapq.heappop

    def pair_factor(rank: int, forward: int, ready: float) -> float:
        """The time factor of ``forward`` and of its partner if they make an overlapped pair
        (Note: [overlapped pair]); 1.0 otherwise."""
        partner = next((j for j in range(pointer[rank], stop[rank]) if blocks[j]), None)
        if (partner is None or actions[partner].kind not in (Kind.I, Kind.B)
                or actions[partner].microbatch == actions[forward].microbatch
                or step[partner] is _READ_PASS):
            return 1.0
        for dep in needs[partner]:
            done = end[dep]
            if done is None or done + (p2p if owner[dep] != rank else 0.0) > ready:
                return 1.0
        f, b = duration[forward], duration[partner]
        if f + b <= 0:
            return 1.0
        factor = 1.0 - (overlap or 0.0) * min(f, b) / (f + b)
        paired[partner] = factor
        pair_end[forward] = ready + (f + b) * factor
        return factor

    def advance(rank: int) -> None:
        """Run rank's program from its pointer until an action waits for a dependency (or a
        read blocks it). The rank's clock, stall and lists are kept in locals and written back
        on leaving: nothing else touches them while this runs."""
        nonlocal seq
        if blocked[rank]:
            return
        i, last = pointer[rank], stop[rank]
        now, stalled = issue[rank], stall[rank]
        record, spent = order[rank].append, passes[rank].append
        while i < last:
            ready = other = now  # all dependencies allow / all but copies back allow
            for dep in needs[i]:
                at = end[dep]
                if at is None:
                    waiting.setdefault(dep, []).append(rank)
                    pointer[rank], issue[rank], stall[rank] = i, now, stalled
                    return
                if p2p and owner[dep] != rank:  # (adding 0.0 would change nothing)
                    at += p2p
                if at > ready:
                    ready = at
                if at > other and not_copy_back[dep]:  # a stall is a wait for a copy back
                    other = at
            j, i = i, i + 1
            kind_step = step[j]
            if kind_step is _RUN:
                took = duration[j]
                if paired and j in paired:
                    took *= paired.pop(j)
                elif overlap is not None and is_forward[j]:
                    pointer[rank] = i  # where pair_factor looks for the partner
                    took *= pair_factor(rank, j, ready)
                done = ready + took  # finish(), inlined: this is the path most actions take
                if is_compute[j]:  # compute blocks the rank's program
                    if ready > other:  # (most actions do not: no new float)
                        waited = waits[j] = ready - other
                        stalled += waited
                    now = done
                    if counted[j]:
                        spent(done - ready)
                elif blocks[j]:
                    now = done
                began[j] = ready
                record(j)
                end[j] = done
                woken = waiting.pop(j, None)
                if woken:
                    runnable.extend(woken)
                if pair_end and j in pair_end:  # its output leaves with the pair's
                    pair_done[j] = done
                    end[j] = pair_end.pop(j)
            elif kind_step is _FETCH_MARK:  # a marker: ready once its copy out is done
                end[j] = ready
                runnable.extend(waiting.pop(j, ()))
            else:
                if kind_step is _COPY_OUT:
                    ready = began[source[j]]  # see [streaming offload], sim/memory.py
                heappush(pending, (ready, seq, rank, j))
                seq += 1
                if kind_step is _READ_PASS:
                    reading[j] = other
                    blocked[rank] = True
                    break
        pointer[rank], issue[rank], stall[rank] = i, now, stalled

    def finish(rank: int, j: int, start: float, stop: float) -> None:
        order[rank].append(j)
        began[j] = start
        end[j] = stop
        woken = waiting.pop(j, None)
        if woken:
            runnable.extend(woken)

    def occupy(j: int, ready: float, until: float = 0.0) -> tuple[float, float]:
        """Place one copy (or read) on its host-link queue: (start, end); it ends no earlier
        than ``until``."""
        queue = channel[j]
        start = max(ready, channel_free[queue])
        stop = channel_free[queue] = max(start + copy_time[j], until)
        return start, stop

    def place_read(rank: int, j: int, ready: float) -> None:
        """A backward pass of a fetched activation, with its read on the H2D queue."""
        reads[j] = occupy(j, ready)
        order[rank].append(~j)  # the read's entry, right before its pass's
        took = duration[j]
        begin = max(ready, reads[j][1] - took)  # a slow read stretches the pass: a wait
        waited = waits[j] = begin - reading.pop(j)
        stall[rank] += waited
        issue[rank] = begin + took
        blocked[rank] = False
        finish(rank, j, begin, begin + took)
        passes[rank].append((begin + took) - begin)  # a read pass is an I, W or B
        runnable.append(rank)

    runnable = list(range(schedule.num_ranks))
    while True:
        while runnable:
            advance(runnable.pop())
        if not pending:
            break
        ready, _, rank, j = heappop(pending)
        if reading and j in reading:
            place_read(rank, j, ready)
            continue
        # occupy() and finish(), inlined: every copy comes here. A copy out cannot end before
        # its forward: its last bytes exist only then.
        queue = channel[j]
        free = channel_free[queue]
        start = free if free > ready else ready
        until = end[source[j]] if step[j] is _COPY_OUT else 0.0
        done = start + copy_time[j]
        if until > done:  # type: ignore[operator]
            done = until
        channel_free[queue] = done  # type: ignore[assignment]
        order[rank].append(j)
        began[j] = start
        end[j] = done
        woken = waiting.pop(j, None)
        if woken:
            runnable.extend(woken)

    stuck = [r for r in range(schedule.num_ranks) if pointer[r] < stop[r]]
    if stuck:
        at = {r: pointer[r] - program.first[r] for r in stuck}
        where = "; ".join(f"rank {r} at position {at[r]} ({actions[pointer[r]]})" for r in stuck)
        rank = stuck[0]
        raise ScheduleError(
            f"simulation deadlocked, no rank can continue: {where}. "
            "pipeoffload.core.validate.validate(schedule) explains what each one waits for",
            rank=rank, position=at[rank], action=actions[pointer[rank]],
        )
    ended = end[:-1]
    for j, done in pair_done.items():
        ended[j] = done
    return _Run(order, stall, passes, began, ended, waits, reads)


def _timeline(program: Program, run: _Run) -> tuple[tuple[TimedAction, ...], ...]:
    """``SimResult.timeline`` from the event loop's record: each rank's entries in the order
    they were timed, sorted (stably) by (start, end)."""
    actions, started, ended = program.actions, run.started, run.ended
    lane = list(map(_LANES.__getitem__, map(_KIND, actions)))
    waited = run.waits.get
    timeline = []
    for rank, order in enumerate(run.order):
        if run.reads and min(order, default=0) < 0:
            rows = [_timed_action((rank, actions[j], started[j], ended[j], lane[j],
                                   waited(j, 0.0))) if j >= 0 else _read(rank, ~j, program, run)
                    for j in order]
        else:  # every entry an action's own, made in C
            rows = list(map(_timed_action, zip(
                repeat(rank), map(actions.__getitem__, order), map(started.__getitem__, order),
                map(ended.__getitem__, order), map(lane.__getitem__, order),
                map(waited, order, repeat(0.0)))))
        rows.sort(key=_BY_START_END)
        timeline.append(tuple(rows))
    return tuple(timeline)


def _read(rank: int, j: int, program: Program, run: _Run) -> TimedAction:
    """The FETCH read of pass ``j`` (Note: [fetch on use])."""
    stage, _, microbatch = program.actions[j]
    return TimedAction(rank, Action(stage, Kind.FETCH, microbatch), *run.reads[j], Lane.H2D)


def activation_units(schedule: Schedule, costs: CostModel) -> tuple[float, ...]:
    """Per stage: one microbatch's activation in M_a units of its rank (by bytes if known)."""
    units = []
    for stage in range(schedule.num_stages):
        local = schedule.stages_on_rank(schedule.rank_of(stage))
        sizes = [costs.bytes_of(s) for s in local]
        if all(size is not None for size in sizes) and sum(sizes) > 0:  # type: ignore[arg-type]
            units.append(costs.bytes_of(stage) / sum(sizes))  # type: ignore[operator,arg-type]
        else:
            units.append(1.0 / len(local))
    return tuple(units)


def _summarise(schedule: Schedule, costs: CostModel, run: _Run, program: Program,
               keep_changes: bool = False) -> SimResult:
    first = program.first
    units = activation_units(schedule, costs)
    byte_sizes = [costs.bytes_of(s) for s in range(schedule.num_stages)]
    have_bytes = all(b is not None for b in byte_sizes)
    copy_time = copy_seconds(schedule, costs)
    peaks, peak_bytes, kept = [], [], []
    for rank, actions in enumerate(schedule.ranks):
        here = slice(first[rank], first[rank + 1])
        changes = rank_changes(actions, run.started[here], run.ended[here], copy_time)
        if keep_changes:
            kept.append(changes)
        peaks.append(peak(changes, units))
        if have_bytes:
            peak_bytes.append(peak(changes, byte_sizes))  # type: ignore[arg-type]
    makespan = max(run.ended, default=0.0)  # as the timeline's: see _Run
    compute = tuple(map(sum, run.passes))
    bubble = 1.0 - sum(compute) / (schedule.num_ranks * makespan) if makespan > 0 else 0.0
    return SimResult(
        schedule=schedule,
        costs=costs,
        makespan=makespan,
        compute_time=compute,
        bubble_rate=bubble,
        peak_activation=tuple(peaks),
        peak_bytes=tuple(peak_bytes) if have_bytes else None,
        stall_time=tuple(run.stall),
        program=program,
        times=(run.started, run.ended),
        changes=tuple(kept) if keep_changes else None,
        run=run,
    )
