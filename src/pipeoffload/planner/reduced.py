"""The reduced simulation: a plan's step time from a few short runs instead of all m microbatches.

Note [reduced simulation]: simulating m microbatches costs O(m), and offload planning simulates
several times, so for large m we simulate three counts m_a < m_b < m_c, one period L apart and
with m's residue modulo L (L = p for interleaved 1F1B's groups, lcm(p, g) for grouped
interleaving, p otherwise), m_a >= ``min_factor`` * p, and extrapolate:
time(m) = time(m_c) + (m - m_c) (time(m_c) - time(m_b)) / L. Past the warm-up every further
period adds the same work to the critical path; what the extrapolation cannot see is a warm-up
that lasts longer than m_a. Two symptoms of one are checked, and either sends the plan to a full
simulation instead:
- the two periods differ (time(m_c) - time(m_b) != time(m_b) - time(m_a), relative 1e-6);
- a period adds less than the busiest rank's work (L times its stages' F + I + W): no steady
  state can (an 18.4B zbv PP4 case: 2p and 3p microbatches were still filling the pipeline
  behind a heavier last stage, -3.5% and a negative bubble).
Peak memory is the largest of the runs' peaks: the zoo's schedules (GPipe aside, which the
planner does not search) reach their peak within the first periods. Compute alone repeats
exactly; the offload planner's choices need not (which transfers it keeps, and where they
stall, can cycle over several periods), so a plan whose reduced runs stall for more than
``stall_tolerance`` of their makespan is simulated in full too.

Plans with offload are simulated in full by the search (planner/search.py, rule 2): the offload
planner's choices change with m, so its short runs need not repeat a period of the full plan
(zbv, p 3, ``recompute-chunks:1+all`` offloads nothing at 7-13 microbatches and 3-12% at 16-49;
extrapolated, its step time is -0.65% off at 31 and -0.85% at 49). Their reduced times serve
only the nearest plan shown when nothing fits, and no tolerance is claimed for them.

What remains is a transient longer than the check can see, whose error has no closed-form bound.
tests/test_planner_reduced.py measures it against full simulations over random shapes and
planner-like costs and keeps it within ``tolerance``; the search re-simulates in full every
plan whose reduced step time comes within ``tolerance`` of the best full one, so the plan it
returns is always a fully simulated one (planner/search.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeoffload.checks import check_number

#: Two periods count as equal when they differ by less than this share of the makespan.
_SAME_PERIOD = 1e-6


@dataclass(frozen=True)
class Extrapolation:
    """Note [reduced simulation]: simulate fewer microbatches when m is large.

    ``min_factor``: the smallest simulated count is at least this many times p (and one
    period); ``enabled=False`` always simulates all m. ``stall_tolerance``: the share of the
    makespan that reduced runs may stall before the full count is simulated instead.
    ``tolerance``: the largest relative step-time error of a reduced simulation that passed its
    checks (measured, see the Note); the search treats a reduced time t as "between
    t / (1 + tolerance) and t (1 + tolerance)". ``memory_tolerance``: how far a plan with
    offload simulated at the smallest count alone may exceed its full peak memory (the offload
    planner's choices differ with m; measured up to 11.7% over the 42.9B search's 609 looks,
    docs/planner.md): the search takes such a plan as not fitting only when that peak is over
    the budget by more."""

    min_factor: float = 2.0
    enabled: bool = True
    stall_tolerance: float = 0.001
    tolerance: float = 0.005
    memory_tolerance: float = 0.15

    def __post_init__(self) -> None:
        check_number("Extrapolation.min_factor", self.min_factor, minimum=1)
        check_number("Extrapolation.stall_tolerance", self.stall_tolerance, minimum=0)
        check_number("Extrapolation.tolerance", self.tolerance, minimum=0, maximum=1)
        check_number("Extrapolation.memory_tolerance", self.memory_tolerance, minimum=0,
                     maximum=1)

    def counts(self, microbatches: int, pp: int, period: int) -> tuple[int, ...]:
        """The microbatch counts to simulate: (m,), or three counts one period apart with m's
        residue when together they are fewer than m."""
        m = microbatches
        low = max(math.ceil(self.min_factor * pp), period)
        first = m - ((m - low) // period) * period if m > low else m
        if not self.enabled or 3 * first + 3 * period >= m:
            return (m,)
        return (first, first + period, first + 2 * period)

    def first_count(self, microbatches: int, pp: int, period: int) -> int | None:
        """The smallest count ``counts`` would start from (m's residue, at least ``min_factor``
        p), when it is below m, even where the three counts would not be fewer than m: where
        the memory bounds read a schedule's order (``Evaluator.memory_bound``). None when
        disabled or when there is none."""
        m = microbatches
        low = max(math.ceil(self.min_factor * pp), period)
        first = m - ((m - low) // period) * period if m > low else m
        return first if self.enabled and first < m else None


def extrapolate(makespans: tuple[float, ...], counts: tuple[int, ...], microbatches: int,
                busiest_work: float) -> float | None:
    """The makespan at ``microbatches`` from runs at three ``counts`` one period apart, or None
    when they show no steady state (Note [reduced simulation]). ``busiest_work``: one
    microbatch's F + I + W on the busiest rank."""
    (a, b, c), (m_a, m_b, m_c) = makespans, counts
    period = m_c - m_b
    if m_b - m_a != period or period <= 0:
        raise ValueError(f"extrapolate: counts {counts} are not one period apart")
    first, second = b - a, c - b
    if abs(second - first) > _SAME_PERIOD * c:
        return None
    if second < period * busiest_work * (1 - _SAME_PERIOD):
        return None
    return c + (microbatches - m_c) * second / period
