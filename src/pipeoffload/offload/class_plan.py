"""Offload below the chunk: choose, per tensor class, keep / offload / recompute, and plan the
transfers (the ``budget:X`` and ``classes:...`` offload targets).

A plan's choice is a ``ClassChoice`` per (stage, microbatch) (core/classes.py); the transfers
are placed by the chunk planner (``add_offload`` with ``all``), which reads each item's moved
share for its copy times and drops the items whose copies cannot hide. The search:

1. Recompute sets: the classes of least recompute time per byte first (a set costs the sum of
   its members' times, Note: [class accounting]): ``max_recompute + 1`` candidates, from none,
   and larger ones while a budget is not met.
2. For each, offload sets over the remaining classes: every distinct moved share a subset
   reaches (for the simulator two subsets of one share are the same plan), of which
   ``share_probes`` spread over the range are planned, then the shares between the best and
   its neighbours.
3. Per microbatch: the items the best plan could not hide (skipped by the chunk planner) get
   the next smaller share that was planned, and the plan is made again; kept if better.
4. Per item: on the rank whose peak is the plan's, each item resident at that peak gets the
   next larger moved share, else the next smaller one, one plan each, kept if better, until
   no such change helps or ``item_plans`` plans were made.

The objective: with a budget (M_a units per rank, or bytes), the fastest plan whose every rank
peaks within it (ties: the lower peak); without one, the lowest peak among plans within
``slack`` of the plain schedule's makespan. The search is bounded, not exact: it plans the
candidates it lists, each a whole plan simulated, and nothing proves that a choice outside them
(another share per microbatch, another recompute set) is not better; each reported number is
the simulated plan's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

from pipeoffload.checks import check_number, check_optional
from pipeoffload.core.actions import OFFLOAD_KINDS
from pipeoffload.core.classes import ClassChoice, TensorClass
from pipeoffload.core.schedule import Schedule
from pipeoffload.errors import ConfigError
from pipeoffload.offload.plan import OffloadPlan, OffloadPolicy, add_offload
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.simulator import SimResult, simulate

Item = tuple[int, int]


@dataclass(frozen=True)
class ClassSearch:
    """What the class search looks for, and how widely.

    ``budget``: each rank's peak activation must stay within it (M_a units, or bytes when
    ``in_bytes``); None: the lowest peak within ``slack`` of the plain makespan.
    ``max_recompute``: the most recompute sets tried beyond none (with a budget not met by
    them, larger ones follow until it is); ``share_probes``: the moved
    shares planned per recompute set before refining around the best."""

    budget: float | None = None
    in_bytes: bool = False
    slack: float = 0.02
    max_recompute: int = 3
    share_probes: int = 6
    per_microbatch: bool = True
    recompute: bool = True
    """False: offload only (no class dropped and recomputed)."""
    item_plans: int = 24
    """Plans the per-item refinement may make (step 4 of the module docstring)."""
    rank_budgets: tuple[float, ...] = ()
    """Per rank instead of ``budget`` (same units): each rank's peak within its own (the
    planner's room for activations, which the model state on each rank sets)."""
    recompute_cap: int | None = None
    """The most recompute sets tried beyond none even with a budget not met (None: all)."""

    def __post_init__(self) -> None:
        check_optional("ClassSearch.budget", self.budget, minimum=0)
        check_number("ClassSearch.slack", self.slack, minimum=0)
        check_number("ClassSearch.max_recompute", self.max_recompute, minimum=0, integer=True)
        check_number("ClassSearch.share_probes", self.share_probes, minimum=1, integer=True)
        check_optional("ClassSearch.recompute_cap", self.recompute_cap, minimum=0, integer=True)
        object.__setattr__(self, "rank_budgets", tuple(self.rank_budgets))
        if self.rank_budgets and self.budget is not None:
            raise ConfigError("ClassSearch: give budget or rank_budgets, not both")

    @property
    def budgeted(self) -> bool:
        """Whether the goal is a budget (else the lowest peak within the slack)."""
        return self.budget is not None or bool(self.rank_budgets)


@dataclass(frozen=True)
class ClassPlan:
    """The plan chosen, its simulation, and what the search tried: (offloaded, recomputed
    class names, per-item or not, makespan, peak) per candidate."""

    plan: OffloadPlan
    result: SimResult
    choice: ClassChoice
    met: bool
    tried: tuple[tuple[tuple[str, ...], tuple[str, ...], bool, float, float], ...] = field(
        repr=False, default=())

    @property
    def peak(self) -> float:
        return peak_of(self.result, False)


def peak_of(result: SimResult, in_bytes: bool) -> float:
    """The largest per-rank peak of a simulation, in M_a units or bytes."""
    peaks = result.peak_bytes if in_bytes else result.peak_activation
    if peaks is None:
        raise ConfigError("a byte budget needs activation sizes: give the cost model "
                          "activation_bytes (CLI: --activation-bytes)")
    return max(peaks)


def uniform(schedule: Schedule, choice: ClassChoice) -> dict[Item, ClassChoice]:
    """``choice`` for every (stage, microbatch) of ``schedule``."""
    return {(s, m): choice for s in range(schedule.num_stages)
            for m in range(schedule.microbatches)}


def recompute_sets(classes: Sequence[TensorClass], most: int) -> list[tuple[TensorClass, ...]]:
    """None, then the k recomputable classes of least time per byte, k = 1..``most`` (a set
    costs the sum of its classes' times: Note: [class accounting])."""
    able = sorted((c for c in classes if c.recompute_time is not None and c.share > 0),
                  key=lambda c: ((c.recompute_time or 0.0) / c.share, -c.share))
    return [tuple(able[:k]) for k in range(min(most, len(able)) + 1)]


def offload_sets(classes: Sequence[TensorClass]) -> list[tuple[TensorClass, ...]]:
    """One subset per distinct moved share (largest members first), by share ascending."""
    by_share: dict[float, tuple[TensorClass, ...]] = {}
    live = [c for c in classes if c.share > 0]
    for mask in range(1, 1 << len(live)):
        subset = tuple(c for i, c in enumerate(live) if mask >> i & 1)
        by_share.setdefault(round(sum(c.share for c in subset), 9), subset)
    return [by_share[share] for share in sorted(by_share)]


class _Search:
    """One search: the schedule without transfers, its costs and what counts as better."""

    def __init__(self, schedule: Schedule, costs: CostModel, search: ClassSearch,
                 policy: OffloadPolicy | None,
                 per_stage: Mapping[int, Sequence[TensorClass]] | None = None) -> None:
        self.bare, self.costs, self.search, self.policy = schedule, costs, search, policy
        self.per_stage = ({s: {c.name: c for c in classes} for s, classes in per_stage.items()}
                          if per_stage is not None else None)
        self.limit = simulate(schedule.with_classes({}), costs).makespan * (1 + search.slack)
        self.best: tuple[tuple[float, float, float], OffloadPlan, ClassChoice] | None = None
        self.tried: list[tuple[tuple[str, ...], tuple[str, ...], bool, float, float]] = []

    def met(self) -> bool:
        """Whether the best plan so far meets the goal."""
        return self.best is not None and self.best[0][0] == 0.0

    def score(self, result: SimResult) -> tuple[float, float, float]:
        """Lower is better: (0 if the goal is met else 1 + miss, then the measure minimised,
        then the other one)."""
        peak = peak_of(result, self.search.in_bytes)
        peak = round(peak, 9 - len(str(int(peak))))  # float noise is no gain
        if self.search.rank_budgets:
            peaks = result.peak_bytes if self.search.in_bytes else result.peak_activation
            assert peaks is not None  # peak_of raised otherwise
            miss = max(p - b - 1e-9 * max(b, 1.0)
                       for p, b in zip(peaks, self.search.rank_budgets))
            return (0.0 if miss <= 0 else 1.0 + miss, result.makespan, peak)
        if self.search.budget is not None:
            miss = peak - self.search.budget
            return (0.0 if miss <= 1e-9 else 1.0 + miss, result.makespan, peak)
        miss = result.makespan - self.limit
        return (0.0 if miss <= 1e-9 * self.limit else 1.0 + miss, peak, result.makespan)

    def spread(self, choices: dict[Item, ClassChoice]) -> dict[Item, ClassChoice]:
        """``choices`` by class name, each item's classes its own stage's (per-stage sizes)."""
        if self.per_stage is None:
            return choices
        table = self.per_stage
        return {(s, m): ClassChoice(
            tuple(table[s][c.name] for c in choice.offloaded if c.name in table.get(s, {})),
            tuple(table[s][c.name] for c in choice.recomputed if c.name in table.get(s, {})))
            for (s, m), choice in choices.items()}

    def plan(self, choices: dict[Item, ClassChoice], shown: ClassChoice,
             mixed: bool = False) -> tuple[tuple[float, float, float], OffloadPlan]:
        schedule = self.bare.with_classes(self.spread(choices))
        plan = add_offload(schedule, self.costs, "all", self.policy)
        score = self.score(plan.result)
        names = shown.names
        self.tried.append((names[0], names[1], mixed, plan.result.makespan,
                           peak_of(plan.result, self.search.in_bytes)))
        if self.best is None or score < self.best[0]:
            self.best = (score, plan, shown)
        return score, plan


def plan_classes(schedule: Schedule, costs: CostModel,
                 classes: Sequence[TensorClass] | Mapping[int, Sequence[TensorClass]],
                 search: ClassSearch | None = None, policy: OffloadPolicy | None = None
                 ) -> ClassPlan:
    """The best class plan the search finds for ``schedule`` (its transfers are replaced;
    see the module docstring). ``classes``: one chunk's classes, shares adding up to 1, or
    per stage (stages of one model differ: the embedding, the head); the search enumerates
    the first stage's and applies each choice by class name."""
    search = search or ClassSearch()
    per_stage = classes if isinstance(classes, Mapping) else None
    reference: Sequence[TensorClass] = (per_stage[min(per_stage)] if per_stage is not None
                                        else cast(Sequence[TensorClass], classes))
    run = _Search(schedule.without(*OFFLOAD_KINDS), costs, search, policy, per_stage)
    run.plan({}, ClassChoice())  # the chunk planner's own plan: whole chunks
    most = len(reference) if search.recompute_cap is None else search.recompute_cap
    every = recompute_sets(reference, most if search.recompute else 0)
    for k, recomputed in enumerate(every):
        if k > search.max_recompute and (not search.budgeted or run.met()):
            break  # more recompute only for a budget not yet met
        rest = [c for c in reference if c not in recomputed]
        sets: list[tuple[TensorClass, ...]] = [()] + offload_sets(rest)
        _shares(run, sets, recomputed)
    assert run.best is not None
    if search.per_microbatch:
        _per_microbatch(run, reference)
        _refine_items(run, reference)
    score, plan, choice = run.best
    return ClassPlan(plan, plan.result, choice, score[0] == 0.0, tuple(run.tried))


def _shares(run: _Search, sets: list[tuple[TensorClass, ...]],
            recomputed: tuple[TensorClass, ...]) -> None:
    """Plan ``share_probes`` of the offload sets spread over their range (the largest among
    them), then those between the best of them and its neighbours."""
    probes = run.search.share_probes
    picks = sorted({round(i * (len(sets) - 1) / max(probes - 1, 1)) for i in range(probes)})
    scores: dict[int, tuple[float, float, float]] = {}

    def probe(i: int) -> None:
        if i not in scores:
            choice = ClassChoice(sets[i], recomputed)
            scores[i] = run.plan(uniform(run.bare, choice), choice)[0]

    for i in picks:
        probe(i)
    best = min(scores, key=scores.__getitem__)
    for lo, hi in ((best - 1, best), (best, best + 1)):
        low = max((p for p in scores if p <= lo), default=None)
        high = min((p for p in scores if p >= hi), default=None)
        if low is None or high is None:
            continue
        for i in range(low + 1, high):
            if high - low <= 4 or (i - low) % max((high - low) // 3, 1) == 0:
                probe(i)


def _per_microbatch(run: _Search, classes: Sequence[TensorClass]) -> None:
    """Give the items the best plan could not hide the next smaller moved share (Note in the
    module docstring, step 3), twice at most."""
    for _ in range(2):
        assert run.best is not None
        _, plan, choice = run.best
        skipped = {(s.stage, s.microbatch) for s in plan.report.skipped}
        if not skipped or not choice.offloaded:
            return
        rest = [c for c in classes if c not in choice.recomputed]
        sets = [s for s in offload_sets(rest) if sum(c.share for c in s) < choice.moved - 1e-9]
        if not sets:
            return
        smaller = ClassChoice(sets[len(sets) * 2 // 3], choice.recomputed)
        choices = uniform(run.bare, choice)
        choices.update({item: smaller for item in skipped})
        before = run.best[0]
        run.plan(choices, choice, mixed=True)
        if run.best[0] == before:
            return


def _resident_at_peak(result: SimResult) -> list[Item]:
    """The items resident on the peak rank when it peaks, by forward start."""
    peaks = result.peak_activation
    rank = max(range(len(peaks)), key=peaks.__getitem__)
    curve = result.memory[rank]
    when = max(curve, key=lambda point: point[1])[0]
    start, end = result.rank_times(rank)
    began: dict[Item, float] = {}
    ended: dict[Item, float] = {}
    for (s, kind, m), t0, t1 in zip(result.schedule.ranks[rank], start, end):
        if kind.value == "F":
            began[(s, m)] = t0
        elif kind.value in ("W", "B"):
            ended[(s, m)] = t1
    return sorted((item for item, t0 in began.items() if t0 <= when <= ended.get(item, when)),
                  key=began.__getitem__)


def _refine_items(run: _Search, classes: Sequence[TensorClass]) -> None:
    """Step 4 of the module docstring: move each item resident at the peak one share up or
    down the ladder of its choice's offload sets, keeping what improves the score."""
    assert run.best is not None
    shown = run.best[2]
    if not shown.offloaded:
        return
    rest = [c for c in classes if c not in shown.recomputed]
    ladder = offload_sets(rest)
    index = {frozenset(c.name for c in subset): i for i, subset in enumerate(ladder)}
    current = uniform(run.bare, shown)
    for item, choice in run.best[1].schedule.classes:  # the best plan's own, if mixed
        names = frozenset(choice.names[0])
        if names in index:
            current[item] = ClassChoice(ladder[index[names]], shown.recomputed)
    plans, improved = run.search.item_plans, True
    while plans > 0 and improved:
        improved = False
        for item in _resident_at_peak(run.best[1].result):
            at = index.get(frozenset(current[item].names[0]))
            for step in (1, -1):
                if at is None or not 0 <= at + step < len(ladder) or plans <= 0:
                    continue
                trial = dict(current)
                trial[item] = ClassChoice(ladder[at + step], shown.recomputed)
                before, plans = run.best[0], plans - 1
                run.plan(trial, shown, mixed=True)
                if run.best[0] < before:
                    current, improved = trial, True
                    break
            if improved:
                break
