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
``memory_events`` in sim/memory.py). The event loop that applies these rules is sim/events.py.

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import itemgetter, sub

from pipeoffload.checks import check_instance
from pipeoffload.core.actions import MARKER_KINDS, Action, Kind, positions_of
from pipeoffload.core.schedule import Schedule
from pipeoffload.sim.collector import cyclic_gc_paused
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.events import RunRecord, run_program
from pipeoffload.sim.memory import Change, copy_seconds, curve, peak, rank_changes
from pipeoffload.sim.program import Program
from pipeoffload.sim.timeline import Lane, TimedAction, make_timeline

__all__ = ["Lane", "SimResult", "TimedAction", "activation_units", "simulate"]


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
    run: RunRecord = field(repr=False, compare=False)
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
        return make_timeline(self.program, self.run)

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
                            copy_seconds(self.schedule, self.costs), self.schedule.class_shares)

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
    check_instance("simulate: schedule", schedule, Schedule, "a Schedule")
    check_instance("simulate: costs", costs, CostModel, "a CostModel", optional=True)
    costs = costs or CostModel()
    schedule = schedule.without(*MARKER_KINDS)  # itself when it has none
    with cyclic_gc_paused():
        program = Program(schedule, costs)
        return _summarise(schedule, costs, run_program(program, costs), program,
                          keep_changes)


_KIND = itemgetter(1)
_COMPUTE_PASSES = frozenset({Kind.F, Kind.I, Kind.W, Kind.B})  # what compute_time counts


def activation_units(schedule: Schedule, costs: CostModel) -> tuple[float, ...]:
    """Per stage: one microbatch's activation in M_a units of its rank (by bytes if known)."""
    units = []
    for stage in range(schedule.num_stages):
        local = schedule.stages_on_rank(schedule.rank_of(stage))
        sizes = [size for s in local if (size := costs.bytes_of(s)) is not None]
        own = costs.bytes_of(stage)
        if len(sizes) == len(local) and own is not None and sum(sizes) > 0:
            units.append(own / sum(sizes))
        else:
            units.append(1.0 / len(local))
    return tuple(units)


def _summarise(schedule: Schedule, costs: CostModel, run: RunRecord, program: Program,
               keep_changes: bool = False) -> SimResult:
    first = program.first
    units = activation_units(schedule, costs)
    byte_sizes = [size for s in range(schedule.num_stages)
                  if (size := costs.bytes_of(s)) is not None]
    have_bytes = len(byte_sizes) == schedule.num_stages
    copy_time = copy_seconds(schedule, costs)
    shares = schedule.class_shares
    peaks, peak_bytes, kept, compute = [], [], [], []
    for rank, actions in enumerate(schedule.ranks):
        here = slice(first[rank], first[rank + 1])
        start, end = run.started[here], run.ended[here]
        compute.append(_compute_time(actions, start, end))
        changes = rank_changes(actions, start, end, copy_time, shares)
        if keep_changes:
            kept.append(changes)
        peaks.append(peak(changes, units))
        if have_bytes:
            peak_bytes.append(peak(changes, byte_sizes))
    makespan = max(run.ended, default=0.0)  # as the timeline's: see RunRecord
    bubble = 1.0 - sum(compute) / (schedule.num_ranks * makespan) if makespan > 0 else 0.0
    return SimResult(
        schedule=schedule,
        costs=costs,
        makespan=makespan,
        compute_time=tuple(compute),
        bubble_rate=bubble,
        peak_activation=tuple(peaks),
        peak_bytes=tuple(peak_bytes) if have_bytes else None,
        stall_time=tuple(run.stall),
        program=program,
        times=(run.started, run.ended),
        changes=tuple(kept) if keep_changes else None,
        run=run,
    )


def _compute_time(actions: Sequence[Action], start: list[float], end: list[float]) -> float:
    """The time a rank's F, I, W and B actions ran (``start`` / ``end`` by position), summed in
    program order."""
    counted = list(map(_COMPUTE_PASSES.__contains__, map(_KIND, actions)))
    return sum(map(sub, compress(end, counted), compress(start, counted)))
