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
``memory_events``).

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

import gc
import heapq
from collections import defaultdict
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from pipeoffload.core.actions import MARKER_KINDS, Action, Kind
from pipeoffload.core.deps import Dependencies
from pipeoffload.core.schedule import Schedule
from pipeoffload.errors import ScheduleError
from pipeoffload.sim.costs import CostModel

_PASSES = (Kind.I, Kind.W, Kind.B)  # the backward passes that read saved activations


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
    timeline: tuple[tuple[TimedAction, ...], ...]
    makespan: float
    compute_time: tuple[float, ...]
    bubble_rate: float
    peak_activation: tuple[float, ...]
    peak_bytes: tuple[float, ...] | None
    memory: tuple[tuple[tuple[float, float], ...], ...]
    stall_time: tuple[float, ...]

    @property
    def total_stall_time(self) -> float:
        return sum(self.stall_time)

    def timed(self, action: Action) -> TimedAction:
        """The timing of one action (linear search; for tests and reports, not hot loops)."""
        rank = self.schedule.rank_of(action.stage)
        for item in self.timeline[rank]:
            if item.action == action:
                return item
        raise KeyError(f"{action} is not in the schedule")


def simulate(schedule: Schedule, costs: CostModel | None = None) -> SimResult:
    """Run ``schedule`` on the cost model's clock; raise ScheduleError on a deadlock. torch's
    markers (UNSHARD / RESHARD / REDUCE_GRAD) cost no time: they are left out of the run and of
    the result (Note: [torch markers], core/actions.py)."""
    costs = costs or CostModel()
    if schedule.has_kind(*MARKER_KINDS):
        schedule = schedule.without(*MARKER_KINDS)
    # The run makes tens of thousands of small tuples and no reference cycles: pausing the
    # cyclic collector keeps it from rescanning them again and again (a third of the time).
    collecting = gc.isenabled()
    gc.disable()
    try:
        timeline, stall = _run(schedule, costs)
        return _summarise(schedule, costs, timeline, stall)
    finally:
        if collecting:
            gc.enable()


def _lane(kind: Kind) -> Lane:
    if kind.blocks:
        return Lane.COMPUTE
    if kind is Kind.OFFLOAD:
        return Lane.D2H
    if kind in (Kind.RELOAD, Kind.FETCH):
        return Lane.H2D
    return Lane.COMM


def _run(schedule: Schedule, costs: CostModel) -> tuple[list[list[TimedAction]], list[float]]:
    """The event loop. Compute is placed as soon as its dependencies are timed (a rank's lane
    has no contention); transfers are placed in order of readiness, since host links can be
    shared between ranks."""
    deps = Dependencies(schedule)
    rank_of = schedule.stage_to_rank
    end: dict[Action, float] = {}
    timed: list[list[TimedAction]] = [[] for _ in schedule.ranks]
    pointer = [0] * schedule.num_ranks
    issue = [0.0] * schedule.num_ranks  # when each rank's program reached its current action
    stall = [0.0] * schedule.num_ranks
    waiting: dict[Action, list[int]] = defaultdict(list)
    forward_start: dict[tuple[int, int], float] = {}
    dependencies: dict[Action, tuple[Action, ...]] = {}
    pending: list[tuple[float, int, int, Action]] = []  # transfers: (ready, seq, rank, action)
    channel_free: dict[tuple[int, str], float] = defaultdict(float)
    seq = 0
    # Backward passes that read a fetched activation queue for the host link like a transfer;
    # their rank's program is blocked until the read is placed (see [fetch on use]).
    fetched = {(a.stage, a.microbatch) for acts in schedule.ranks for a in acts
               if a.kind is Kind.FETCH}
    reading: dict[Action, float] = {}  # queued pass -> time its other inputs allowed
    blocked = [False] * schedule.num_ranks
    paired: dict[Action, float] = {}  # the backward of an overlapped pair -> its time factor
    pair_end: dict[Action, float] = {}  # the forward of an overlapped pair -> when the pair ends

    def pair_factor(rank: int, forward: Action, ready: float) -> float:
        """The time factor of ``forward`` and of its partner if they make an overlapped pair
        (Note: [overlapped pair]); 1.0 otherwise."""
        actions = schedule.ranks[rank]
        partner = next((a for a in actions[pointer[rank]:] if a.kind.blocks), None)
        if (partner is None or partner.kind not in (Kind.I, Kind.B)
                or partner.microbatch == forward.microbatch
                or (partner.stage, partner.microbatch) in fetched):
            return 1.0
        for dep in deps.of(partner):
            hop = costs.p2p_time if rank_of[dep.stage] != rank else 0.0
            if dep not in end or end[dep] + hop > ready:
                return 1.0
        f, b = costs.compute_time(forward), costs.compute_time(partner)
        if f + b <= 0:
            return 1.0
        factor = 1.0 - (costs.overlap_f_b or 0.0) * min(f, b) / (f + b)
        paired[partner] = factor
        pair_end[forward] = ready + (f + b) * factor
        return factor

    def ready_time(rank: int, action: Action) -> tuple[float, float] | None:
        """(time all dependencies allow, time all but RELOADs allow), or None if not timed."""
        ready = other = issue[rank]
        needs = dependencies.get(action)
        if needs is None:
            needs = dependencies[action] = deps.of(action)
        for dep in needs:
            if dep not in end:
                waiting[dep].append(rank)
                return None
            at = end[dep] + (costs.p2p_time if rank_of[dep.stage] != rank else 0.0)
            ready = max(ready, at)
            if dep.kind is not Kind.RELOAD and dep.kind is not Kind.FETCH:
                other = max(other, at)
        return ready, other

    def advance(rank: int) -> None:
        nonlocal seq
        actions = schedule.ranks[rank]
        while not blocked[rank] and pointer[rank] < len(actions):
            action = actions[pointer[rank]]
            times = ready_time(rank, action)
            if times is None:
                return
            ready, other = times
            pointer[rank] += 1
            if action.kind is Kind.OFFLOAD:
                ready = forward_start[(action.stage, action.microbatch)]  # see [streaming offload]
            if action.kind is Kind.FETCH:  # a marker: ready once its copy out is done
                end[action] = ready
                runnable.extend(waiting.pop(action, ()))
                continue
            reads = action.kind in _PASSES and (action.stage, action.microbatch) in fetched
            if action.kind.is_transfer or reads:
                heapq.heappush(pending, (ready, seq, rank, action))
                seq += 1
                if reads:
                    reading[action] = other
                    blocked[rank] = True
                continue
            duration = costs.compute_time(action)
            if action in paired:
                duration *= paired.pop(action)
            elif costs.overlap_f_b is not None and action.kind is Kind.F:
                duration *= pair_factor(rank, action, ready)
            waited = 0.0
            if action.kind.is_compute:
                waited = ready - other
                stall[rank] += waited
            if action.kind.blocks:
                issue[rank] = ready + duration
            if action.kind is Kind.F:
                forward_start[(action.stage, action.microbatch)] = ready
            finish(rank, action, ready, ready + duration, waited)
            if action in pair_end:  # its output leaves with the pair's (runs before any waiter)
                end[action] = pair_end.pop(action)

    def finish(rank: int, action: Action, start: float, stop: float, waited: float = 0.0) -> None:
        timed[rank].append(TimedAction(rank, action, start, stop, _lane(action.kind), waited))
        end[action] = stop
        for woken in waiting.pop(action, ()):
            runnable.append(woken)

    def occupy(rank: int, kind: Kind, stage: int, ready: float,
               until: float = 0.0) -> tuple[float, float]:
        """Place one copy on its host-link queue: (start, end); it ends no earlier than
        ``until``."""
        channel = costs.host_link.channel(rank, kind)
        start = max(ready, channel_free[channel])
        stop = channel_free[channel] = max(start + costs.transfer_time(stage, kind), until)
        return start, stop

    def place_read(rank: int, action: Action, ready: float) -> None:
        """A backward pass of a fetched activation, with its read on the H2D queue."""
        start, stop = occupy(rank, Kind.RELOAD, action.stage, ready)
        fetch = Action(action.stage, Kind.FETCH, action.microbatch)
        timed[rank].append(TimedAction(rank, fetch, start, stop, Lane.H2D))
        duration = costs.compute_time(action)
        begin = max(ready, stop - duration)  # a slow read stretches the pass: counted as a wait
        waited = begin - reading.pop(action)
        stall[rank] += waited
        issue[rank] = begin + duration
        blocked[rank] = False
        finish(rank, action, begin, begin + duration, waited)
        runnable.append(rank)

    runnable = list(range(schedule.num_ranks))
    while True:
        while runnable:
            advance(runnable.pop())
        if not pending:
            break
        ready, _, rank, action = heapq.heappop(pending)
        if action in reading:
            place_read(rank, action, ready)
            continue
        # A copy out cannot end before its forward: its last bytes exist only then.
        until = end[Action(action.stage, Kind.F, action.microbatch)] \
            if action.kind is Kind.OFFLOAD else 0.0
        finish(rank, action, *occupy(rank, action.kind, action.stage, ready, until))

    stuck = [r for r in range(schedule.num_ranks) if pointer[r] < len(schedule.ranks[r])]
    if stuck:
        where = "; ".join(f"rank {r} at position {pointer[r]} ({schedule.ranks[r][pointer[r]]})"
                          for r in stuck)
        rank = stuck[0]
        raise ScheduleError(
            f"simulation deadlocked, no rank can continue: {where}. "
            "pipeoffload.core.validate.validate(schedule) explains what each one waits for",
            rank=rank, position=pointer[rank], action=schedule.ranks[rank][pointer[rank]],
        )
    for rank in range(schedule.num_ranks):
        timed[rank].sort(key=lambda t: (t.start, t.end))
    return timed, stall


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


def memory_events(schedule: Schedule, rank_timeline: tuple[TimedAction, ...] | list[TimedAction],
                  sizes: tuple[float, ...], costs: CostModel) -> list[tuple[float, float]]:
    """Rank's resident-activation changes as (time, delta), in the order they happen.

    At a time tie, events follow the rank's program: an event of a compute action (its start,
    then its end) comes where that action is in the program, so zero-length actions still
    allocate and free in order; the end of a copy out frees right after its forward starts,
    and the start of a copy back allocates right before its backward. With positive durations
    this is "frees before allocations at a tie".

    Note: [memory accounting] (design.md) the activation of (s, m) is resident from the start of
    F(s, m) to the end of W(s, m) or B(s, m), except from the end of OFFLOAD(s, m) to the start
    of RELOAD(s, m); a fetched (s, m) stays off the device until its backward ends (Note:
    [fetch on use]). A recomputed (s, m) runs its F without autograd recording and keeps only
    its input (not counted: it is the previous stage's output), so it is resident from the
    start of its RECOMPUTE only.

    Note: [streaming offload] an offloaded (s, m) is copied out while its F runs, tensor by
    tensor as autograd saves it: the copy starts when the F starts (or when the D2H queue frees
    up) and cannot end before the F does. Only the part not yet copied is on the device, so
    such an (s, m) counts ``streamed_fraction`` of its size from the F's start to the copy's
    end: 0 when the copy keeps up with the forward, all of it when the copy starts after the
    forward ended.
    """
    timed = {t.action: t for t in rank_timeline}
    if not rank_timeline:
        return []
    order = {a: 2 * i for i, a in enumerate(schedule.ranks[rank_timeline[0].rank])}
    first_backward: dict[tuple[int, int], int] = {}
    for action, at in order.items():
        if action.kind.is_backward:
            first_backward.setdefault((action.stage, action.microbatch), at)
    events = []  # (time, program order, delta)
    for t in rank_timeline:
        s, kind, m = t.action
        size = sizes[s]
        if kind is Kind.F:
            copy = timed.get(Action(s, Kind.OFFLOAD, m))
            if copy is not None:
                part = size * streamed_fraction(t.start, t.end, copy.start,
                                                costs.transfer_time(s, Kind.OFFLOAD))
                events.extend(((t.start, order[t.action], part),
                               (copy.end, order[t.action] + 0.5, -part)))
                continue
            if Action(s, Kind.RECOMPUTE, m) not in timed:
                events.append((t.start, order[t.action], size))
        elif kind in (Kind.W, Kind.B):
            if Action(s, Kind.FETCH, m) not in timed:
                events.append((t.end, order[t.action] + 1, -size))
        elif kind is Kind.RECOMPUTE:
            events.append((t.start, order[t.action], size))
        elif kind is Kind.RELOAD:
            events.append((t.start, first_backward.get((s, m), order[t.action]) - 0.5, size))
    events.sort(key=lambda e: (e[0], e[1]))
    return [(time, delta) for time, _, delta in events]


def streamed_fraction(f_start: float, f_end: float, copy_start: float, copy_time: float) -> float:
    """The largest share of a forward's activation on the device while it streams out (the
    forward produces at a constant rate, the copy drains at one; see [streaming offload])."""
    if copy_start >= f_end:
        return 1.0
    f_time = f_end - f_start
    before = (copy_start - f_start) / f_time if f_time > 0 else 1.0
    if copy_time <= f_time or copy_time <= 0:
        return min(1.0, max(0.0, before))
    return min(1.0, max(0.0, 1.0 - (f_end - copy_start) / copy_time))


def _curve(events: list[tuple[float, float]]) -> tuple[tuple[tuple[float, float], ...], float]:
    level = peak = 0.0
    points = [(0.0, 0.0)]
    for time, delta in events:
        level += delta
        peak = max(peak, level)
        points.append((time, level))
    return tuple(points), peak


def _summarise(schedule: Schedule, costs: CostModel, timed: list[list[TimedAction]],
               stall: list[float]) -> SimResult:
    units = activation_units(schedule, costs)
    byte_sizes = [costs.bytes_of(s) for s in range(schedule.num_stages)]
    have_bytes = all(b is not None for b in byte_sizes)
    memory, peaks, peak_bytes = [], [], []
    for rank_timeline in timed:
        curve, peak = _curve(memory_events(schedule, rank_timeline, units, costs))
        memory.append(curve)
        peaks.append(peak)
        if have_bytes:
            _, peak_b = _curve(memory_events(schedule, rank_timeline, tuple(byte_sizes), costs))
            peak_bytes.append(peak_b)
    makespan = max((t.end for rank in timed for t in rank), default=0.0)
    compute = tuple(
        sum(t.end - t.start for t in rank if t.action.kind in (Kind.F, Kind.I, Kind.W, Kind.B))
        for rank in timed
    )
    bubble = 1.0 - sum(compute) / (schedule.num_ranks * makespan) if makespan > 0 else 0.0
    return SimResult(
        schedule=schedule,
        costs=costs,
        timeline=tuple(tuple(r) for r in timed),
        makespan=makespan,
        compute_time=compute,
        bubble_rate=bubble,
        peak_activation=tuple(peaks),
        peak_bytes=tuple(peak_bytes) if have_bytes else None,
        memory=tuple(memory),
        stall_time=tuple(stall),
    )
