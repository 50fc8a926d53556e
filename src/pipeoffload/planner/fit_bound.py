"""How early a plan with offload can end if it is to fit in memory: a lower bound of its makespan
from its order, costs and the room activations have on each rank, before the offload planner
runs (planner/search.py keys such candidates by it).

Note: [fitting time]
Offload frees a rank's memory only as fast as its host link copies, and a fast step leaves
little time to copy. Take rank r and the end e_k of its k-th forward F_k. The rank runs its
compute one action at a time in program order (sim/simulator.py), so at e_k exactly the
compute before F_k and F_k itself have run, and the activations live then (design.md's
accounting: F start to W or B end) are those the order's resident-count vector right after F_k
counts; L_k bytes. Under Note: [memory accounting] and [streaming offload] (sim/memory.py) an
activation whose forward has ended counts at least its size minus the bytes its copy out has
moved (a copy moves size / transfer time per second from its start; an activation copied back
counts whole): for a copy still running the counted share is what the copy had not moved when
the forward ended, and nothing counts below zero. Copies on one host-link queue run one at a
time and none starts before the earliest forward of a rank on that link (a_s, Note: [makespan
lower bound]), so by e_k rank r's copies have moved at most rate_r (e_k - c_r) bytes, rate_r
the fastest any stage of the rank copies (bytes / ``transfer_time``) and c_r that earliest
start. The peak activation is at least the level at e_k (the changes before it, in the
simulator's order at ties, are a prefix of its sorted changes), so a plan fits only if
    L_k - rate_r (e_k - c_r) <= room_r     (room_r: the budget less rank r's state and reserve).
The rank still has to run its compute after F_k: R_k = the rank's total F, I, W and B time less
what it had run by F_k (transfers, waits and recomputation only add), so makespan >= e_k + R_k.
Together: a plan that fits has
    makespan >= R_k + c_r + (L_k - room_r) / rate_r    for every (r, k) with L_k > room_r,
and the bound is the largest of these (0 if none). Offload planning inserts transfers and waits
into the order; it does not reorder, add or remove F, I, W or B (offload/plan.py), so the
order's counts are the plan's. Any k may be used, so each rank's distinct resident vectors are
read at their first appearance (``bounds.resident_counts``): later ones have run more and give
smaller R_k. It holds for any offload target without recomputation (``all``, ``chunks:K``, ...)
and for no-offload plans (rate 0: a vector over the room never fits); not for
recompute-and-offload, whose recomputed forwards are not resident. tests/test_planner_bounds.py
checks it against full offload plans of random shapes, costs and budgets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipeoffload.core.actions import Action, Kind
from pipeoffload.planner.bounds import ResidentCounts, forward_starts
from pipeoffload.sim.costs import CostModel

_KINDS = (Kind.F, Kind.I, Kind.W, Kind.B)


def fitting_makespan_bound(counts: ResidentCounts, costs: CostModel,
                           stage_to_rank: tuple[int, ...], rooms: Sequence[float]) -> float:
    """A lower bound of the makespan of any offload plan (no recomputation) of the schedule
    ``counts`` was read from (``bounds.resident_counts``) whose activations stay within
    ``rooms[r]`` bytes on every rank r (Note: [fitting time]); math.inf when one cannot fit
    however long it runs, 0.0 when nothing binds."""
    if costs.overlap_f_b is not None:
        raise ValueError("fitting_makespan_bound: overlapped F&B pairs shorten durations; "
                         "the bound assumes costs.overlap_f_b is None")
    starts = forward_starts(costs, stage_to_rank)
    per_link = costs.host_link.ranks_per_link
    link_start: dict[int, float] = {}
    for stage, rank in enumerate(stage_to_rank):
        link = rank // per_link
        link_start[link] = min(link_start.get(link, math.inf), starts[stage])
    bound = 0.0
    for rank, (stages, vectors, totals) in enumerate(counts):
        sizes = [costs.bytes_of(stage) or 0.0 for stage in stages]
        durations = [costs.compute_time(Action(stage, kind, 0))
                     for stage in stages for kind in _KINDS]
        rate = 0.0
        for stage, size in zip(stages, sizes):
            if size > 0:
                took = costs.transfer_time(stage, Kind.OFFLOAD)
                rate = max(rate, size / took if took > 0 else math.inf)
        if rate == math.inf:
            continue  # copies take no time: memory binds nothing
        total = sum(n * d for n, d in zip(totals, durations))
        copies_from = link_start[rank // per_link]
        for vector, done in vectors.items():
            over = sum(n * size for n, size in zip(vector, sizes)) - rooms[rank]
            if over <= 0:
                continue
            if rate == 0:
                return math.inf
            left = total - sum(n * d for n, d in zip(done, durations))
            bound = max(bound, left + copies_from + over / rate)
    return bound * (1 - 1e-9)  # its sums run in another order than the simulator's
