"""The offload planning pass: schedule + costs + target -> the same schedule with OFFLOAD /
RELOAD or FETCH (and OFFLOAD_WAIT) actions, and a report of what it bought and what it could
not do.

Assumes a valid schedule (existing transfer actions are replaced; the target ``given`` keeps
them and only reports). Guarantees a valid schedule whose per-rank peak is never above the
input's (a plan that would raise a peak is dropped), and never raises for an unreachable
target: it returns the best plan it found and says why in ``OffloadReport.notes`` and
``OffloadReport.skipped``.

How (PipeOffload's selective offload, generalised to any schedule):
1. Simulate the schedule; every (stage, microbatch) gets its lifespan, F start to W/B end.
2. The target picks candidates, longest-lived first (they free the most memory per byte moved).
3. OFFLOAD goes right after the F (the copy streams out while the F runs; see the simulator's
   [streaming offload] note). RELOADs are placed by a backward pass over each rank's H2D queue
   so that each copy back ends ``reload_margin`` before its backward (``place_reloads``). With
   ``OffloadPolicy.fetch_on_use``, an item whose every backward pass is at least as long as
   reading its activation back comes back by FETCH instead (read on use, never held whole on
   the device; the simulator's [fetch on use] note), placed right before its backward.
4. Simulate; re-place what stalled; drop what cannot hide (unless the target demands it, see
   OffloadTarget.demands) or gains nothing. Then postpone forwards that would start while
   more than ``max_pending_offloads`` copies out are unfinished (OFFLOAD_WAIT), each only
   within its slack (its latest start in the plain schedule for a makespan grown by at most
   ``postpone_slack``; offload/forecast.py): back-to-back warm-up forwards would otherwise
   pile activations up behind a slow link. The first waits and which copies gain nothing are
   forecast from the plain timeline and the host-link queue, so a plan whose forecast holds
   is simulated once. Repeat until stable or ``max_rounds``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from typing import cast

from pipeoffload.checks import check_instance, check_number, check_optional
from pipeoffload.core.actions import OFFLOAD_KINDS, Action, Kind, positions_of
from pipeoffload.core.schedule import Schedule
from pipeoffload.errors import ConfigError
from pipeoffload.offload.forecast import Forwards, LatestStarts
from pipeoffload.offload.limit import plan_limit
from pipeoffload.offload.placement import ComputeIndex, Timing, insert, place_reloads
from pipeoffload.offload.postpone import (
    RankCopies,
    forecast_copies,
    late_waits,
    postpone,
    simulated_copies,
)
from pipeoffload.offload.recompute import add_recompute
from pipeoffload.offload.report import OffloadPlan, OffloadReport, Skipped
from pipeoffload.offload.select import Item, Lifespans
from pipeoffload.offload.targets import OffloadTarget, TargetKind, parse_target
from pipeoffload.sim.collector import cyclic_gc_paused
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.simulator import SimResult, TimedAction, activation_units, simulate

__all__ = ["OffloadPlan", "OffloadPolicy", "OffloadReport", "Skipped", "add_offload"]

# The kinds as module names (Note: [hot loops], core/actions.py).
_F, _I, _B, _OFFLOAD, _RECOMPUTE = Kind.F, Kind.I, Kind.B, Kind.OFFLOAD, Kind.RECOMPUTE
_STAGE, _KIND, _ITEM = itemgetter(0), itemgetter(1), itemgetter(0, 2)  # of an Action


@dataclass(frozen=True)
class OffloadPolicy:
    """Constants that shape a plan (each one is reported when it bound the result)."""

    reload_margin: float = 0.0
    """Time (cost-model units) by which a RELOAD should finish before its backward starts.
    0 trusts the simulator's clock; on real hardware use a fraction of one I time."""
    stall_tolerance: float = 1e-9
    """Waiting shorter than this (cost-model units) does not count as a stall."""
    max_rounds: int = 24
    """Simulate-and-fix rounds before the planner stops moving RELOADs and adding waits."""
    max_pending_offloads: int | None = 1
    """A forward waits (OFFLOAD_WAIT) until at most this many copies out of its rank are
    unfinished, so back-to-back forwards (warm-up) do not pile activations up behind a slow
    link. None: never postpone."""
    postpone_slack: float = 0.0
    """Postponing may grow the makespan by at most this fraction: a forward waits only until
    its latest start for that makespan (offload/forecast.py)."""
    fetch_on_use: bool = False
    """Bring an activation back by FETCH (each backward pass reads it from host memory as it
    uses it) where the reads hide behind the passes, instead of a RELOAD that holds it whole on
    the device from before its backward to the end of its W. Lower peaks (the activation being
    backpropagated no longer counts), more host-to-device traffic with a B/W split (I and W
    each read it). Off by default: its cost on a GPU is unmeasured."""

    def __post_init__(self) -> None:
        check_number("OffloadPolicy.reload_margin", self.reload_margin, minimum=0)
        check_number("OffloadPolicy.stall_tolerance", self.stall_tolerance, minimum=0)
        check_number("OffloadPolicy.max_rounds", self.max_rounds, minimum=1, integer=True)
        check_optional("OffloadPolicy.max_pending_offloads", self.max_pending_offloads,
                       minimum=0, integer=True)
        check_number("OffloadPolicy.postpone_slack", self.postpone_slack, minimum=0)
        if not isinstance(self.fetch_on_use, bool):
            raise ConfigError(f"OffloadPolicy.fetch_on_use must be True or False, got "
                              f"{self.fetch_on_use!r}")


def add_offload(
    schedule: Schedule,
    costs: CostModel | None = None,
    target: str | OffloadTarget | None = "all",
    policy: OffloadPolicy | None = None,
    *,
    base: SimResult | None = None,
) -> OffloadPlan:
    """Plan activation offload into ``schedule`` (see the module docstring for the contract).
    ``base``: the simulation of ``schedule`` without its transfers under ``costs``, when the
    caller has it (a planner pricing several targets of one schedule); else it is simulated."""
    check_instance("add_offload: schedule", schedule, Schedule, "a Schedule")
    check_instance("add_offload: costs", costs, CostModel, "a CostModel", optional=True)
    check_instance("add_offload: policy", policy, OffloadPolicy, "an OffloadPolicy",
                   optional=True)
    with cyclic_gc_paused():
        return _add_offload(schedule, costs, target, policy, base)


def _add_offload(schedule: Schedule, costs: CostModel | None,
                 target: str | OffloadTarget | None, policy: OffloadPolicy | None,
                 base: SimResult | None) -> OffloadPlan:
    costs = costs or CostModel()
    policy = policy or OffloadPolicy()
    target = parse_target(target)
    bare = schedule.without(*OFFLOAD_KINDS)
    if (base is None or base.costs != costs or base.schedule.ranks != bare.ranks
            or base.schedule.classes != bare.classes):
        base = simulate(bare, costs)
    if target.kind is TargetKind.RECOMPUTE_CHUNKS_THEN_ALL:
        return _recompute_then_offload(bare, costs, target, policy, base)
    planner = _Planner(bare, costs, policy, base, keep_stalling=target.demands)
    if target.kind is TargetKind.NONE:
        return planner.finish(target, bare, base, {}, ())
    if target.kind is TargetKind.GIVEN:
        return planner.report(target, schedule, simulate(schedule, costs), {}, ())
    if target.kind is TargetKind.LIMIT:
        return plan_limit(planner, target)
    chosen, notes = planner.spans.choose(target, planner.units)
    chosen = [item for item in chosen if item not in planner.recomputed]
    planned, result, skipped = planner.plan(chosen)
    plan = planner.finish(target, planned, result, skipped, notes)
    if (target.kind is TargetKind.CHUNKS and policy.max_pending_offloads
            and _peaks_while_copying(plan.result)):
        # Note: [wait for every copy] a forward that starts while one copy out is still
        # streaming keeps that copy's rest on the device; waiting for all of them, where the
        # slack allows, can lower the peak at the same makespan. Tried for ``chunks:K`` only
        # (issue 36, item 6): for ``all`` it would lower po-f's 1.5 M_a to 1.17 at the same
        # makespan, with a wait before most forwards on a GPU, unmeasured; not done here.
        strict = dataclasses.replace(policy, max_pending_offloads=0)
        other = _add_offload(schedule, costs, target, strict, base)
        if (max(other.result.peak_activation) < max(plan.result.peak_activation) - 1e-9
                and other.result.makespan <= plan.result.makespan + policy.stall_tolerance):
            return other
    return plan


def _peaks_while_copying(result: SimResult) -> bool:
    """Whether the highest rank peaks while one of its copies out is running."""
    peaks = result.peak_activation
    rank = max(range(len(peaks)), key=peaks.__getitem__)
    top = peaks[rank]
    times = [t for t, level in result.memory[rank] if level >= top - 1e-12]
    copies = result.kind_times(rank, _OFFLOAD)[0]
    _, starts, ends = copies if copies else ([], [], [])
    return any(s <= t < e for t in times for s, e in zip(starts, ends))


def _recompute_then_offload(bare: Schedule, costs: CostModel, target: OffloadTarget,
                            policy: OffloadPolicy, base: SimResult) -> OffloadPlan:
    """The RECOMPUTE_CHUNKS_THEN_ALL target: each rank's K longest-lived chunks recomputed
    (offload/recompute.py), then every other activation offloaded as ``all`` plans it. ``bare``
    has no transfers, ``base`` is its simulation. The report names ``target``; its "before"
    is the recomputed schedule's."""
    chunks = OffloadTarget(TargetKind.CHUNKS, target.value)
    recomputed = add_recompute(bare, costs, chunks, base=base)
    offload = OffloadTarget(TargetKind.ALL, allow_stall=target.allow_stall)
    plan = _add_offload(recomputed.schedule, costs, offload, policy, recomputed.result)
    return dataclasses.replace(plan, report=dataclasses.replace(plan.report, target=target))


class _Planner:
    """Shared state of one planning call: the bare schedule, its base simulation, and helpers."""

    def __init__(self, schedule: Schedule, costs: CostModel, policy: OffloadPolicy,
                 base: SimResult, keep_stalling: bool) -> None:
        self.schedule, self.costs, self.policy, self.base = schedule, costs, policy, base
        self.keep_stalling = keep_stalling
        self.units = activation_units(schedule, costs)
        self.compute_index = ComputeIndex(schedule)
        self.spans = Lifespans(base)
        # Recomputed items keep nothing to offload (see offload/recompute.py).
        self.recomputed = {(a.stage, a.microbatch) for acts in schedule.ranks for a in acts
                           if a[1] is _RECOMPUTE}
        self.by_lifespan = [[it for it in items if it not in self.recomputed]
                            for items in self.spans.by_rank] if self.recomputed else \
            self.spans.by_rank
        self._reload_time = [costs.transfer_time(s, Kind.RELOAD)
                             for s in range(schedule.num_stages)]
        self._moved = {item: share[0] for item, share in schedule.class_shares.items()}

    @functools.cached_property
    def base_timing(self) -> Timing:
        """The plain schedule's timing (made once: every plan starts from it)."""
        return Timing(self.compute_index, self.base)

    @functools.cached_property
    def base_forwards(self) -> Forwards:
        """The plain schedule's forwards, sorted for the forecasts (made once)."""
        return Forwards(self.base)

    def backward(self, item: Item) -> Action:
        """The action that consumes the item's activation first (I, or B without a split)."""
        return self.compute_index.backward_action(item)

    def place_reloads(self, items: Iterable[Item], timing: Timing, skipped: dict[Item, str],
                      out_ends: dict[Item, float]) -> dict[Item, int]:
        """For each item, how many compute actions ahead of its backward its RELOAD goes
        (placement.place_reloads)."""
        return place_reloads(self.compute_index, items, timing, self._reload_time,
                             self.policy.reload_margin, self.policy.stall_tolerance,
                             self.keep_stalling, skipped, out_ends, self._moved)

    def passes(self, item: Item) -> list[Action]:
        """The backward passes that read the item's activation: B, or I and W."""
        first = self.backward(item)
        return [first] if first.kind is Kind.B else [first, Action(item[0], Kind.W, item[1])]

    def reads_hide(self, item: Item) -> bool:
        """Whether each backward pass of ``item`` lasts at least as long as its FETCH read."""
        read = self.costs.transfer_time(item[0], Kind.RELOAD) * self._moved.get(item, 1.0)
        return all(read <= self.costs.compute_time(p) + self.policy.stall_tolerance
                   for p in self.passes(item))

    def insert(self, leads: dict[Item, int], waits: dict[Action, Item],
               fetches: set[Item]) -> Schedule:
        """The schedule with the transfers and waits placed (placement.insert)."""
        return insert(self.compute_index, leads, waits, fetches)

    def plan(self, chosen: Iterable[Item], keep_changes: bool = False
             ) -> tuple[Schedule, SimResult, dict[Item, str]]:
        """Place transfers for ``chosen`` from a simulation, re-simulate, and repeat until
        nothing stalls; then postpone forwards that would start while too many copies out are
        pending (only while that does not grow the makespan beyond ``postpone_slack``).
        ``keep_changes``: the result keeps its memory changes (``simulate``)."""
        skipped: dict[Item, str] = {}
        items = []
        for item in chosen:
            if item in self._adjacent:
                skipped[item] = "its backward directly follows its forward"
            else:
                items.append(item)
        fetches = ({item for item in items if self.reads_hide(item)}
                   if self.policy.fetch_on_use else set())
        timing = self.base_timing
        out_ends = self.base_forwards.copy_out_ends(items)
        waits: dict[Action, Item] = {}
        postponing = self.policy.max_pending_offloads is not None
        leads = self.place_reloads([i for i in items if i not in fetches], timing, skipped,
                                   out_ends)
        planned, result = self.schedule, self.base
        unpostponed: SimResult | None = None  # the last result without waits
        if postponing:  # a first guess from the forecast saves a round when it holds
            offloaded = [*leads, *fetches]
            same = len(offloaded) == len(items)  # nothing skipped: the forecast made above holds
            self._postpone(waits, forecast_copies(self.base_forwards, offloaded,
                                                  out_ends if same else None))
        for _ in range(self.policy.max_rounds):
            planned = self.insert(leads, waits, fetches)
            result = simulate(planned, self.costs, keep_changes=keep_changes)
            if waits and result.makespan > self._horizon() + self.policy.stall_tolerance:
                late = self._late_waits(waits, result)
                if late and len(late) < len(waits):
                    waits = {f: it for f, it in waits.items() if f not in late}
                    continue
                waits, postponing = {}, False  # postponing cost time: plan without it
                if unpostponed is not None:
                    timing = Timing(self.compute_index, unpostponed)
                leads = self.place_reloads(leads, timing, skipped, out_ends)
                continue
            if not waits:
                unpostponed = result
            if result.total_stall_time > self.policy.stall_tolerance:
                timing = Timing(self.compute_index, result)
                new_leads = self.place_reloads(leads, timing, skipped, out_ends)
                if new_leads != leads:
                    leads = new_leads
                    waits = {f: it for f, it in waits.items() if it in leads or it in fetches}
                    continue
            if postponing and self._postpone(waits, simulated_copies(result)):
                continue
            break
        # Dropping a stalled copy lets later compute start sooner, which can expose another
        # copy; repeat until nothing stalls (each pass drops at least one item).
        while not self.keep_stalling and result.total_stall_time > self.policy.stall_tolerance:
            timed = _timing(result)
            stalled = [i for i in [*leads, *fetches] if self._stalled(i, timed)]
            if not stalled:
                break
            for item in stalled:
                skipped[item] = "its copies cannot hide behind compute (stall)"
                leads.pop(item, None)
                fetches.discard(item)
            waits = {f: it for f, it in waits.items() if it in leads or it in fetches}
            planned = self.insert(leads, waits, fetches)
            result = simulate(planned, self.costs, keep_changes=keep_changes)
        return planned, result, skipped

    def _stalled(self, item: Item, timing: dict[Action, TimedAction]) -> bool:
        """Whether a backward pass of ``item`` waited for its copy back (a W only waits for a
        FETCH read)."""
        return any(timing[p].stall > self.policy.stall_tolerance for p in self.passes(item))

    @functools.cached_property
    def _adjacent(self) -> set[Item]:
        """The items whose backward directly follows their F on the rank's compute lane (found
        once: every plan asks about its items)."""
        adjacent = set()
        for comp in self.compute_index.compute:
            for before, after in zip(comp, comp[1:]):
                if before[1] is _F and (after[1] is _I or after[1] is _B) \
                        and before[0] == after[0] and before[2] == after[2]:
                    adjacent.add((before[0], before[2]))
        return adjacent

    def _horizon(self) -> float:
        """The makespan postponing may not exceed."""
        return self.base.makespan * (1 + self.policy.postpone_slack)

    @functools.cached_property
    def _latest(self) -> LatestStarts:
        """Each action's latest start within the horizon in the plain schedule (worked out
        once, when a wait is first considered)."""
        return LatestStarts(self.base, self._horizon())

    def _late_waits(self, waits: dict[Action, Item], result: SimResult) -> set[Action]:
        """The waits that cost makespan (see postpone.late_waits)."""
        return late_waits(waits, result, self._latest, self.policy.stall_tolerance)

    def _postpone(self, waits: dict[Action, Item], copies: list[RankCopies]) -> bool:
        """Add waits where copies out pile up (see postpone.postpone)."""
        limit = self.policy.max_pending_offloads
        assert limit is not None
        return postpone(waits, copies, self._latest, limit, self.policy.stall_tolerance,
                        self._runs_before)

    def _runs_before(self, item: Item, forward: Action) -> bool:
        """Whether the item's forward comes before ``forward`` in their rank's program."""
        order = self.compute_index.index[self.compute_index.rank_of[forward[0]]]
        # A plain tuple finds the Action (a NamedTuple) it equals, without making one.
        return order[(item[0], _F, item[1])] < order[forward]  # type: ignore[index]

    def floor_reason(self, rank: int) -> str:
        largest = max(self.units[s] for s in self.schedule.stages_on_rank(rank))
        return (f"a forward holds its activation while it runs ({largest:.3g} M_a for the "
                f"largest chunk), and transfers that cannot hide are kept only if the target "
                f"demands them; lower the offload ratio or raise reload_margin tolerance")

    def finish(self, target: OffloadTarget, planned: Schedule, result: SimResult,
               skipped: dict[Item, str], notes: tuple[str, ...]) -> OffloadPlan:
        """The plan, unless it would raise a peak (then nothing is offloaded), and its report."""
        if any(after > before + 1e-9 for before, after in
               zip(self.base.peak_activation, result.peak_activation)):
            notes = notes + ("the plan would raise a peak; nothing offloaded",)
            planned, result = self.schedule, self.base
        return self.report(target, planned, result, skipped, notes)

    def report(self, target: OffloadTarget, planned: Schedule, result: SimResult,
               skipped: dict[Item, str], notes: tuple[str, ...]) -> OffloadPlan:
        offloaded = tuple(sorted(map(_ITEM, _of_kind(chain.from_iterable(planned.ranks),
                                                     _OFFLOAD))))
        if target.kind is not TargetKind.NONE and not offloaded and skipped:
            reasons = sorted({why for why in skipped.values()})
            notes = notes + ("nothing could be offloaded: " + "; ".join(reasons),)
        total = sum(map(self.units.__getitem__, map(_STAGE, _of_kind(
            chain.from_iterable(self.compute_index.compute), _F))))  # summed in program order
        moved_units = sum(self.units[s] for s, _ in offloaded)
        # Byte peaks exist exactly when every stage's activation size is known.
        bytes_moved = None if self.base.peak_bytes is None else float(
            sum(cast(float, self.costs.bytes_of(s)) for s, _ in offloaded))
        kept = set(offloaded)
        report = OffloadReport(
            target=target,
            offloaded=offloaded,
            peak_before=self.base.peak_activation,
            peak_after=result.peak_activation,
            peak_bytes_before=self.base.peak_bytes,
            peak_bytes_after=result.peak_bytes,
            offloaded_fraction=moved_units / total if total else 0.0,
            bytes_moved=bytes_moved,
            makespan_before=self.base.makespan,
            makespan_after=result.makespan,
            stall_time=result.stall_time,
            skipped=tuple(Skipped(s, m, why) for (s, m), why in sorted(skipped.items())
                          if (s, m) not in kept),
            notes=notes,
        )
        return OffloadPlan(schedule=planned, report=report, result=result)


def _of_kind(actions: Iterable[Action], kind: Kind) -> list[Action]:
    """The actions of ``kind``, in order, picked out in C (Note: [hot loops], core/actions.py)."""
    actions = list(actions)
    return list(map(actions.__getitem__, positions_of(list(map(_KIND, actions)), kind)))


def _timing(result: SimResult) -> dict[Action, TimedAction]:
    """action -> its timing (start, stall, end)."""
    return {t.action: t for rank in result.timeline for t in rank}
