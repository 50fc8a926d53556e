"""Lower bounds of a pipeline's makespan from its per-stage costs alone, before any schedule is
built or simulated: what the search prunes with (planner/search.py).

Note: [makespan lower bound]
The simulator runs each rank's actions one at a time, and an action starts no earlier than the
end of each action it depends on (plus ``p2p_time`` when that one ran on another rank); offload,
recomputation and host-link queues only add waits and work. So for ANY order of a rank's
actions the makespan is at least the longest of these chains, with F_s, X_s, W_s the simulator's
durations of stage s (X is the backward pass that produces the input gradient: I where the
schedule splits the backward, else B = I + W) and h(a, b) the p2p hops between stages a..b:
- a_s = sum_{s' < s} F_s' + h(0, s): no forward of stage s starts earlier (its microbatch has
  to pass every stage in front of it);
- x_s = sum_s' F_s' + h(0, S-1) + sum_{s' > s} X_s' + h(s, S-1): no backward of s starts
  earlier (it needs the loss, then the gradient back through every later stage);
- t_s = sum_{s' < s} X_s' + h(0, s) (+ W_0 where the backward is split): after a backward of
  stage s ends, its microbatch's gradient still has to reach stage 0.
Rank r holds stages R; it works m times its stages' F + I + W in all, m (F + X) of it before
its last backward ends, and m (I + W) of it after its first backward starts. Hence
  makespan >= min_R a + m sum_R (F + I + W)
  makespan >= min_R a + m sum_R (F + X) + min_R t
  makespan >= min_R x + m sum_R (I + W)
  makespan >= min_R x + m sum_R X + min_R t
and the bound is the largest of these over all ranks. It holds for every schedule family with
one route through stages 0..S-1 (not DualPipe's two) and a cost model without overlapped F&B
pairs, which shorten durations (Note: [overlapped pair], sim/simulator.py).
tests/test_planner_bounds.py checks it against full simulations of random shapes and costs.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence

from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.schedule import Schedule
from pipeoffload.sim.costs import CostModel

_F, _W, _B = Kind.F, Kind.W, Kind.B  # Note: [hot loops], core/actions.py


def makespan_lower_bound(costs: CostModel, stage_to_rank: tuple[int, ...], microbatches: int,
                         split_backward: bool, recomputed_chunk: bool = False) -> float:
    """A lower bound of the simulated makespan of any schedule of ``microbatches`` microbatches
    over these stages and costs (Note: [makespan lower bound]). ``split_backward``: the schedule
    runs I and W (a lower bound also when it runs B, just a looser one).
    ``recomputed_chunk``: each rank also re-runs the forward of one of its stages for every
    microbatch (recompute ``chunks:1``), before that stage's backward: m times the cheapest of
    its forwards is added to the work before its last backward."""
    if costs.overlap_f_b is not None:
        raise ValueError("makespan_lower_bound: overlapped F&B pairs shorten durations; "
                         "the bound assumes costs.overlap_f_b is None")
    stages = len(stage_to_rank)
    f, i, w, b = stage_durations(costs, stages)
    x = i if split_backward else b
    hop = _hops(costs, stage_to_rank)
    forward_start = forward_starts(costs, stage_to_rank, f)
    backward_start = [0.0] * stages
    backward_start[-1] = forward_start[-1] + f[-1]
    for s in range(stages - 2, -1, -1):
        backward_start[s] = backward_start[s + 1] + x[s + 1] + hop[s + 1]
    tail = [0.0] * stages
    tail[0] = w[0] if split_backward else 0.0
    for s in range(1, stages):
        tail[s] = tail[s - 1] + x[s - 1] + hop[s]
    held: dict[int, list[int]] = {}
    for s, rank in enumerate(stage_to_rank):
        held.setdefault(rank, []).append(s)
    m = microbatches
    bound = 0.0
    for mine in held.values():
        first = min(forward_start[s] for s in mine)
        first_back = min(backward_start[s] for s in mine)
        last = min(tail[s] for s in mine)
        again = m * min(f[s] for s in mine) if recomputed_chunk else 0.0
        bound = max(bound,
                    first + m * sum(f[s] + i[s] + w[s] for s in mine) + again,
                    first + m * sum(f[s] + x[s] for s in mine) + again + last,
                    first_back + m * sum(i[s] + w[s] for s in mine),
                    first_back + m * sum(x[s] for s in mine) + last)
    return bound


def _hops(costs: CostModel, stage_to_rank: tuple[int, ...]) -> list[float]:
    """hop[s]: the p2p time between stages s-1 and s (0 on one rank)."""
    return [costs.p2p_time if s and stage_to_rank[s] != stage_to_rank[s - 1] else 0.0
            for s in range(len(stage_to_rank))]


def stage_durations(costs: CostModel, stages: int
                    ) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per stage, the F, I, W and B durations of ``costs.compute_time``, the same products
    without an Action per call."""
    scales = [costs.scale(s) for s in range(stages)] if costs.stage_time_scale else \
        [1.0] * stages
    b = costs.i_time + costs.w_time
    return ([costs.f_time * k for k in scales], [costs.i_time * k for k in scales],
            [costs.w_time * k for k in scales], [b * k for k in scales])


def forward_starts(costs: CostModel, stage_to_rank: tuple[int, ...],
                   f: Sequence[float] | None = None) -> list[float]:
    """Per stage, a_s of Note: [makespan lower bound]: no forward of stage s starts earlier.
    ``f``: the forward durations (``stage_durations``), when the caller has them."""
    if f is None:
        f = stage_durations(costs, len(stage_to_rank))[0]
    hop = _hops(costs, stage_to_rank)
    start = [0.0] * len(stage_to_rank)
    for s in range(1, len(stage_to_rank)):
        start[s] = start[s - 1] + f[s - 1] + hop[s]
    return start


def kept_activation_floor(schedule: Schedule, stage_bytes: Sequence[float],
                          offloaded_stages: int) -> list[float]:
    """Per rank, a lower bound of the peak activation bytes when at most ``offloaded_stages``
    of its stages (chunks) are offloaded (offload target ``chunks:K``) and the rest stay.

    Note: [kept activation] A rank runs its compute one action at a time in program order, and
    an activation that is not offloaded is resident from its F's start to its W's (or B's) end
    (design.md's accounting), so the resident bytes of the kept stages at each F are fixed by
    the order alone, whatever the costs. The bound takes, per rank, the choice of stages to
    offload that leaves the lowest such peak; offloaded activations, copies back and what a
    forward holds while it streams out only add to it.
    """
    floors = []
    for actions in schedule.ranks:
        if offloaded_stages == 0:  # nothing to choose: the running total's peak
            floors.append(_total_peak(actions, stage_bytes))
            continue
        stages = sorted({a[0] for a in actions})
        if offloaded_stages >= len(stages):
            floors.append(0.0)
            continue
        level = dict.fromkeys(stages, 0.0)
        total = 0.0
        peak_without = {combo: 0.0 for combo in itertools.combinations(stages,
                                                                       offloaded_stages)}
        for stage, kind, _ in actions:
            if kind is Kind.F:
                level[stage] += stage_bytes[stage]
                total += stage_bytes[stage]
                for combo, top in peak_without.items():
                    kept = total - sum(level[s] for s in combo)
                    if kept > top:
                        peak_without[combo] = kept
            elif kind is Kind.W or kind is Kind.B:
                level[stage] -= stage_bytes[stage]
                total -= stage_bytes[stage]
        floors.append(min(peak_without.values()))
    return floors


def _total_peak(actions: Sequence[Action], stage_bytes: Sequence[float]) -> float:
    """The most activation bytes resident right after a forward of ``actions`` (or 0), summed
    in program order as ``kept_activation_floor`` sums them (a - b is a + (-b) in IEEE 754,
    so ``accumulate`` gives the same totals bit for bit, and a total after a W or B never
    exceeds the one before it)."""
    changes = [stage_bytes[stage] if kind is _F else -stage_bytes[stage]
               for stage, kind, _ in actions if kind is _F or kind is _W or kind is _B]
    return max(0.0, max(itertools.accumulate(changes), default=0.0))


#: Per rank: its stages in order, and the vectors of resident microbatches per stage (in that
#: order) right after one of its forwards that no other such vector covers (Note: [kept
#: activation]).
ResidentCounts = list[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]]


def resident_counts(schedule: Schedule) -> ResidentCounts:
    """What ``kept_activation_floor`` reads of the order, once per schedule: a steady state
    repeats its vectors, so a few stand for ~10^4 forwards, and of those only the ones no other
    covers (at least as many of every stage) can hold the most bytes: each further set of
    stage bytes costs a few dot products (``kept_floor``)."""
    out = []
    for actions in schedule.ranks:
        stages = tuple(sorted({a[0] for a in actions}))
        slot = {stage: i for i, stage in enumerate(stages)}
        count = [0] * len(stages)
        seen: set[tuple[int, ...]] = set()
        for stage, kind, _ in actions:
            if kind is Kind.F:
                count[slot[stage]] += 1
                seen.add(tuple(count))
            elif kind is Kind.W or kind is Kind.B:
                count[slot[stage]] -= 1
        out.append((stages, _uncovered(seen)))
    return out


def _uncovered(vectors: set[tuple[int, ...]]) -> tuple[tuple[int, ...], ...]:
    """The vectors that no other one covers. For bytes b >= 0 a covered vector's dot product
    is at most its cover's, rounding included (IEEE 754's products and sums are monotone), so
    the largest product over these is the largest over all, bit for bit."""
    kept: list[tuple[int, ...]] = []
    for vector in sorted(vectors, key=sum, reverse=True):  # a cover comes before what it covers
        if not any(all(map(operator.le, vector, other)) for other in kept):
            kept.append(vector)
    return tuple(kept)


def kept_floor(counts: ResidentCounts, stage_bytes: Sequence[float],
               offloaded_stages: int) -> list[float]:
    """``kept_activation_floor`` from ``resident_counts``: the same bound, its sums taken in
    another order (equal up to rounding); ``stage_bytes`` are sizes (>= 0)."""
    floors = []
    for stages, vectors in counts:
        if offloaded_stages >= len(stages):
            floors.append(0.0)
            continue
        sizes = [stage_bytes[stage] for stage in stages]
        floors.append(min(
            # An offloaded stage counts 0.0: adding 0.0 leaves a float sum as it was.
            max((sum(map(operator.mul, vector, kept)) for vector in vectors), default=0.0)
            for kept in ([0.0 if i in combo else size for i, size in enumerate(sizes)]
                         for combo in itertools.combinations(range(len(stages)),
                                                             offloaded_stages))))
    return floors
