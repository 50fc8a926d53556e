"""The planner's search: the fastest configuration of a model on N GPUs that fits in memory.

It enumerates DP x TP x PP = N (TP dividing a node's GPUs and the head count), microbatch size
and count (from the global batch), the zoo's schedules with their chunks and group sizes,
recompute options and offload targets, and simulates what it cannot rule out (``evaluate``).

Note: [branch and bound]
Every candidate gets two lower bounds before anything is built: its step time
(``Evaluator.time_bound``: planner/bounds.py, Note [makespan lower bound]) and its memory
(``Evaluator.state_and_floor``: model state, reserve and one stage's activation, which a
forward holds whatever is offloaded). Over the budget in memory: infeasible, never simulated
(kept aside for the nearest plan when nothing fits). The rest wait in one queue ordered by their
time key, and the search takes the smallest key first:
1. a candidate not yet simulated is simulated, reduced where m is large (planner/reduced.py,
   Note [reduced simulation]). A plan without offload bounds its offloaded siblings (same
   layout, schedule, microbatching and recompute) from below: offload only inserts transfers
   and waits, it never removes or reorders compute, so in the simulator no compute starts
   earlier with it (tests/test_planner_bounds.py). Their key becomes that time.
2. a reduced plan that fits goes back into the queue keyed by its time / (1 + the reduced
   simulation's tolerance), which it cannot beat by more (measured, planner/reduced.py); when
   it comes out again it is simulated in full (a finalist) and takes part with its full time.
   A plan with offload is first planned at the reduced simulation's smallest count only: over
   the budget there by more than ``Extrapolation.memory_tolerance`` (how far that peak may
   exceed the full one, tested), it is taken as not fitting; else it is simulated in full at
   once (its time is its sibling's in most cases: a reduced run would only delay the full
   one). A plan without offload whose time no offloaded sibling needs (the verdict's search
   of plans without offload, planner/verdict.py) is first bounded in memory by its order
   (Note [kept activation]: exact without transfers, at the smallest count), as offloaded
   ``chunks:K`` plans are; one over the budget whose siblings may need its time is simulated
   only when the first of them gets to rule 2b.
2b. an offloaded candidate (no recomputation) is keyed by the earliest step at which it could
   fit (``Evaluator.fitting_time_bound``, planner/fit_bound.py, Note [fitting time]) before
   the offload planner runs: when that is above its key, it goes back into the queue under it.
   A plan that fits is no faster, and one that does not fit is never returned, so the key stays
   a lower bound of what the candidate could contribute.
2c. a class-plan candidate (offload ``CLASS_OFFLOAD``, planner/class_offload.py) is the last
   variant of its configuration, so at equal keys its ``all`` sibling comes off the queue
   first: if that fits at the offload-free time (the key both share by rule 1), the search
   stops by rule 3 before a class search (several offload plans) runs. One with more than
   ``SearchConfig.class_items`` (stage, microbatch) items is not simulated (a note says how
   many): the returned plan is then the best of the rest, not of them.
3. the search stops when the smallest key times (1 + ``SearchConfig.tolerance``) reaches the
   best full-simulated step time found: nothing left can beat it by more than the tolerance.
So the plan returned is one simulated in full, and no other candidate is faster than it by more
than ``tolerance``, provided the bounds hold (tested against the full simulator) and reduced
runs err by less than their tolerance (tested, and measured over a whole search by
benchmarks/planner_search.py). With ``tolerance`` 0 and ``Extrapolation(enabled=False)`` this
is the exhaustive search: the same best plan (up to ties) as simulating every candidate in
full, since what it skips provably cannot win.
Recompute options of equal stage time keep only the one with fewer bytes (lgd before none):
identical timelines, more memory; the class-plan variant stays at none (planner/class_offload.py,
Note: [class plans in the search]).
The other plans returned are the fastest others the search simulated on the way (reduced
where so marked); the search does not simulate plans only to fill the table.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from enum import Enum

from pipeoffload.errors import ConfigError
from pipeoffload.planner.candidate import Candidate
from pipeoffload.planner.class_offload import CLASS_OFFLOAD
from pipeoffload.planner.evaluate import Evaluator, Plan
from pipeoffload.planner.hardware import Hardware
from pipeoffload.planner.layer_time import RunConfig
from pipeoffload.planner.ratio import offload_ratio
from pipeoffload.planner.result import SearchResult, SearchStats
from pipeoffload.planner.space import (
    DEFAULT_SCHEDULES,
    OFFLOAD_ORDER,
    SearchConfig,
    SearchSpace,
    configurations,
)
from pipeoffload.planner.transformer import Recompute, TransformerSpec
from pipeoffload.sim.collector import cyclic_gc_paused

# The search's inputs and results live in space.py and result.py; callers import them here.
__all__ = ["DEFAULT_SCHEDULES", "OFFLOAD_ORDER", "SearchConfig", "SearchResult", "SearchSpace",
           "SearchState", "SearchStats", "Why", "configurations", "search"]


class Why(Enum):
    """Why a queued candidate has its key (Note: [branch and bound]); a search that stops
    counts each one left by it (``SearchState.left_at_stop``)."""

    BOUND = "bound"  # its step-time lower bound (rule 1's start)
    SIBLING = "sibling"  # its offload-free sibling's time (rule 1)
    REDUCED = "reduced"  # its reduced plan's time over the reduced tolerance (rule 2)
    UNFIT = "unfit"  # the earliest step at which it could fit (rule 2b)


@dataclass
class _Queue:
    """The candidates the search may still simulate, smallest time key first (Note: [branch
    and bound]). Entries: (key, not a finalist, order, why, candidate, reduced plan or None)."""

    entries: list[tuple[float, bool, int, Why, Candidate, Plan | None]] = field(
        default_factory=list)
    order: Iterator[int] = field(default_factory=itertools.count)

    def push(self, key: float, why: Why, candidate: Candidate, plan: Plan | None = None) -> None:
        # At equal keys a finalist goes first: its full time may end the search.
        heapq.heappush(self.entries, (key, plan is None, next(self.order), why, candidate, plan))

    def pop(self) -> tuple[float, Why, Candidate, Plan | None]:
        key, _, _, why, candidate, plan = heapq.heappop(self.entries)
        return key, why, candidate, plan


def _siblings(groups: list[list[Candidate]]) -> dict[Candidate, Candidate]:
    """Each variant's sibling without offload (same configuration and recompute)."""
    free_of: dict[Candidate, Candidate] = {}
    for variants in groups:
        without = {c.recompute: c for c in variants if c.offload == "none"}
        for c in variants:
            free_of[c] = without.get(c.recompute) or replace(c, offload="none")
    return free_of


class SearchState:
    """One search as it runs (Note: [branch and bound]): the queue, what each candidate
    became, the siblings' times that bound their offloaded variants, and the best full-simulated
    feasible step time, which the stopping rule compares keys with.

    ``run`` takes candidates off the queue until the rule stops it; ``settle_nearest`` prices
    the nearest plans when nothing fits; ``ranked`` and ``stats`` say what was found."""

    def __init__(self, evaluator: Evaluator, config: SearchConfig, groups: list[list[Candidate]],
                 progress: Callable[[str], None] | None, started: float) -> None:
        self.evaluator, self.config, self.progress = evaluator, config, progress
        self.budget = evaluator.budget_bytes
        self.reduced_error = 1 + config.extrapolation.tolerance
        self.stats = SearchStats(configurations=sum(len(g) for g in groups))
        self.queue = _Queue()
        self.too_big: list[tuple[float, Candidate]] = []  # pruned by memory: nearest plans
        self.free_of = _siblings(groups)
        # Offload-free siblings this search does not itself try (a space without "none"):
        # priced on demand for their time, which bounds their variants (rule 1).
        self.outside = {free for free in self.free_of.values()} - set(self.free_of)
        # Plans without offload whose time bounds an offloaded sibling's (rule 1 of the Note).
        self.floors_siblings = {self.free_of[c] for c in self.free_of if c.offload != "none"}
        self.feasible: dict[Candidate, Plan] = {}  # full or reduced, the latest of each
        self.infeasible: list[Plan] = []
        self.sibling_floor: dict[Candidate, float] = {}  # offload-free variant's time, from below
        self.unpriced: set[Candidate] = set()  # offload-free, over the budget, not simulated
        self.unbuildable: set[tuple[str, int, int, int, int | None]] = set()
        self.best = math.inf  # the best full-simulated feasible step time
        self.classes_too_big = 0  # class plans not searched: over SearchConfig.class_items
        self.last_report = started
        self._seed(groups)

    def _seed(self, groups: list[list[Candidate]]) -> None:
        """Queue every variant by its time bound, or set it aside by its memory floor."""
        for variants in groups:
            for candidate in variants:
                floor = self.evaluator.state_and_floor(candidate)
                if floor > self.budget:
                    self.stats.pruned_by_memory += 1
                    self.too_big.append((floor, candidate))
                else:
                    self.queue.push(self.evaluator.time_bound(candidate), Why.BOUND, candidate)

    def run(self) -> None:
        """Take candidates off the queue, smallest key first, until nothing left can beat the
        best by more than the tolerance (rule 3)."""
        while self.queue.entries:
            key, why, candidate, plan = self.queue.pop()
            if key * (1 + self.config.tolerance) >= self.best:
                self.left_at_stop(why)
                for entry in self.queue.entries:
                    self.left_at_stop(entry[3])
                return
            self._report()
            if plan is not None:  # a reduced plan that fits: a finalist, simulated in full
                self.stats.finalists += 1
                plan = self.evaluator.evaluate(candidate, full=True)
            else:
                plan = self._first_look(key, candidate)
                if plan is None:
                    continue
            self._record(candidate, plan)

    def left_at_stop(self, why: Why) -> None:
        """Count a candidate the stopping rule leaves, by what its key was."""
        if why is Why.SIBLING:
            self.stats.dominated += 1
        elif why is Why.UNFIT:
            self.stats.pruned_by_copies += 1
        else:
            self.stats.pruned_by_time += 1

    def _report(self) -> None:
        now = time.monotonic()
        if self.progress is not None and now - self.last_report >= 1.0:
            self.last_report = now
            shown = f", best {self.best:.3f} s" if self.best < math.inf else ""
            self.progress(f"plan: {len(self.queue.entries)} candidates left, "
                          f"{self.evaluator.simulations} simulations{shown}")

    def _floor(self, plan: Plan) -> float:
        """A lower bound of the full step time of ``plan``'s candidate."""
        return plan.step_time / self.reduced_error if plan.extrapolated else plan.step_time

    def _first_look(self, key: float, candidate: Candidate) -> Plan | None:
        """A candidate not simulated yet: its plan, or None when it is pruned, cannot be built,
        or went back into the queue under a larger key."""
        free = self.free_of[candidate]
        if free in self.outside and free not in self.sibling_floor:
            self._price_outside(free)
        if self.sibling_floor.get(free, 0.0) > key:
            self.queue.push(self.sibling_floor[free], Why.SIBLING, candidate)
            return None
        if candidate.schedule_shape in self.unbuildable:
            self.stats.not_buildable += 1
            return None
        try:
            plan = self._price(key, candidate, free)
        except ConfigError:
            self.unbuildable.add(candidate.schedule_shape)
            self.stats.not_buildable += 1
            return None
        if plan is not None and candidate.offload == "none":
            self.sibling_floor[free] = self._floor(plan)
        return plan

    def _price_outside(self, free: Candidate) -> None:
        """The time of an offload-free sibling outside this search's space (its plan is
        cached by the evaluator, often from an earlier search), for rule 1; nothing when its
        shape cannot be built (nor can its variants')."""
        try:
            self.sibling_floor[free] = self._floor(self.evaluator.evaluate(free))
        except ConfigError:
            return

    def _price(self, key: float, candidate: Candidate, free: Candidate) -> Plan | None:
        """Rules 1, 2 and 2b of the Note before simulating ``candidate``; raises ConfigError
        when its family cannot build its shape."""
        offloaded = candidate.offload != "none"
        bound = self.evaluator.memory_bound(candidate)
        if bound > self.budget:
            self.stats.pruned_by_memory += 1
            if not offloaded:
                self.too_big.append((bound, candidate))
                if candidate in self.floors_siblings:  # priced if a sibling needs its time
                    self.unpriced.add(candidate)
            return None
        if offloaded:
            fit = self.evaluator.fitting_time_bound(candidate)
            if fit > key:  # fitting takes longer than the key says (rule 2b)
                self.queue.push(fit, Why.UNFIT, candidate)
                return None
        if free in self.unpriced and self._sibling_outruns(key, candidate, free):
            return None
        if candidate.offload == CLASS_OFFLOAD and (
                candidate.pp * candidate.chunks * candidate.microbatches
                > self.config.class_items):
            self.classes_too_big += 1
            return None
        memory = self.evaluator.first_count_memory(candidate) if offloaded else None
        if memory is not None and memory > self.budget * (
                1 + self.config.extrapolation.memory_tolerance):
            self.stats.pruned_by_memory += 1
            self.too_big.append((memory, candidate))
            return None
        self.stats.finalists += memory is not None
        return self.evaluator.evaluate(candidate, full=offloaded)

    def _sibling_outruns(self, key: float, candidate: Candidate, free: Candidate) -> bool:
        """Price the offload-free sibling over the budget now that a variant needs its time;
        whether that time sent ``candidate`` back into the queue."""
        self.unpriced.discard(free)
        free_plan = self.evaluator.evaluate(free)
        self.infeasible.append(free_plan)
        self.sibling_floor[free] = self._floor(free_plan)
        if self.sibling_floor[free] > key:
            self.queue.push(self.sibling_floor[free], Why.SIBLING, candidate)
            return True
        return False

    def _record(self, candidate: Candidate, plan: Plan) -> None:
        """Keep a simulated plan; a reduced one that fits goes back into the queue (rule 2)."""
        if not plan.feasible:
            self.infeasible.append(plan)
            self.feasible.pop(candidate, None)
            return
        self.feasible[candidate] = plan
        if plan.extrapolated:
            self.queue.push(plan.step_time / self.reduced_error, Why.REDUCED, candidate, plan)
        else:
            self.best = min(self.best, plan.step_time)

    def settle_nearest(self) -> None:
        """When no plan simulated in full fits: drop the reduced ones and simulate the
        ``nearest_tries`` smallest of those set aside by memory, for the nearest plan."""
        if any(not plan.extrapolated for plan in self.feasible.values()):
            return
        self.feasible.clear()
        tried = {plan.candidate for plan in self.infeasible}
        self.too_big.sort(key=lambda item: item[0])
        for _, candidate in self.too_big[: self.config.nearest_tries]:
            if candidate in tried:
                continue
            try:
                self.infeasible.append(self.evaluator.evaluate(candidate))
            except ConfigError:
                continue

    def ranked(self) -> tuple[Plan, ...]:
        """Feasible plans by step time, else the rest by memory; ``top_k`` of them."""
        ranked_feasible = sorted(self.feasible.values(),
                                 key=lambda p: (p.step_time, p.memory.total))
        self.infeasible.sort(key=lambda p: (p.memory.total, p.step_time))
        top_k = self.config.top_k
        return tuple(ranked_feasible[:top_k] or self.infeasible[:top_k])



def search(spec: TransformerSpec, hw: Hardware, config: SearchConfig,
           space: SearchSpace | None = None,
           progress: Callable[[str], None] | None = None,
           evaluator: Evaluator | None = None) -> SearchResult:
    """Search ``space`` (default ``SearchSpace()``) (Note: [branch and bound]); ``progress``
    gets a status line about once a second. ``evaluator``: an earlier search's
    (``SearchResult.evaluator``) for the same model, hardware, config and registry (``top_k``
    and the rest of the space may differ): what it priced is reused."""
    with cyclic_gc_paused():
        return _search(spec, hw, config, space or SearchSpace(), progress, evaluator)


def _evaluator(spec: TransformerSpec, hw: Hardware, config: SearchConfig, space: SearchSpace,
               evaluator: Evaluator | None) -> Evaluator:
    """A new evaluator for this search, or ``evaluator`` when it prices the same things."""
    budget = config.budget_bytes if config.budget_bytes is not None else hw.hbm_bytes
    host_budget = (config.host_budget_bytes if config.host_budget_bytes is not None
                   else hw.host_bytes_per_node)
    if evaluator is None:
        return Evaluator(spec, hw, config.memory, budget, config.extrapolation,
                         framework=config.framework, host_budget_bytes=host_budget,
                         registry=space.registry)
    if (evaluator.spec, evaluator.hw, evaluator.memory, evaluator.budget_bytes,
            evaluator.extrapolation, evaluator.host_budget_bytes, evaluator.framework) != (
                spec, hw, config.memory, budget, config.extrapolation, host_budget,
                config.framework) or evaluator.registry is not space.registry:
        raise ValueError("search: the evaluator passed in prices another model, hardware, "
                         "config or registry")
    return evaluator


def _search(spec: TransformerSpec, hw: Hardware, config: SearchConfig, space: SearchSpace,
            progress: Callable[[str], None] | None, evaluator: Evaluator | None
            ) -> SearchResult:
    started = time.monotonic()
    evaluator = _evaluator(spec, hw, config, space, evaluator)
    simulations_before = evaluator.simulations
    groups = configurations(spec, hw, config, space)
    state = SearchState(evaluator, config, groups, progress, started)
    state.run()
    state.settle_nearest()
    notes: list[str] = []
    if not groups:
        notes.append(f"no layout of {config.gpus} GPUs fits this model and batch: "
                     f"DP must divide the global batch ({config.global_batch}), TP the heads "
                     f"({spec.heads}) and {hw.gpus_per_node} (GPUs per node), PP x chunks <= "
                     f"layers ({spec.num_layers})")
    if state.classes_too_big:
        notes.append(f"tensor-class offload not searched for {state.classes_too_big} "
                     f"configurations of more than {config.class_items} (stage, microbatch) "
                     "items (SearchConfig.class_items)")
    k = offload_ratio(spec, hw, RunConfig(1, 1, space.recompute[0] if len(space.recompute) == 1
                                          else Recompute.LGD))
    return SearchResult(
        k=k,
        budget_bytes=evaluator.budget_bytes,
        candidates=state.ranked(),
        stats=dataclasses.replace(state.stats,
                                  simulated=evaluator.simulations - simulations_before,
                                  seconds=time.monotonic() - started),
        notes=tuple(notes),
        spec=spec,
        sharded_optimizer=config.memory.optimizer.sharded,
        fsdp=config.memory.optimizer.fsdp,
        evaluator=evaluator,
    )
