"""How early a plan with offload can end if it is to fit in memory: a lower bound of its makespan
from its order, costs and the room activations have on each rank, before the offload planner
runs (planner/search.py keys such candidates by it).

Note: [fitting time]
Offload frees a rank's memory only as fast as its host link copies. Take rank r and the end e_k
of its k-th forward F_k. The rank runs its compute one action at a time in program order
(sim/simulator.py), so at e_k exactly the compute before F_k and F_k itself have run, and the
activations live then (design.md's accounting: F start to W or B end) are fixed by the order:
the set A_k, L_k bytes. Under Note: [memory accounting] and [streaming offload] (sim/memory.py)
an activation of A_k counts, at e_k, at least its size less the bytes its copy out has moved
by e_k (a copy moves size / ``transfer_time`` bytes per second from its start; for a copy still
running the counted share is what it had not moved when the forward ended; an activation copied
back counts whole, one not offloaded whole). The changes up to e_k (in the simulator's order at
ties, up to F_k's own) are a prefix of its sorted changes, so the peak is at least that level,
and a plan whose activations fit in room_r (the budget less rank r's state and reserve) has
moved, by e_k, at least need_k = L_k - room_r bytes of copies of A_k.
Copies on one host-link queue run one at a time, and none starts before the earliest forward
of a rank on that link (c_r, from a_s of Note: [makespan lower bound]); a copy moves at most
rate_r bytes per second (the fastest of the rank's stages). Points k_1 < ... < k_n whose live
sets are pairwise disjoint need copies of different activations, all moved by e_{k_n}:
    rate_r (e_{k_n} - c_r) >= need_{k_1} + ... + need_{k_n}.
The rank still has to run its compute after F_{k_n}: R_k = its total F, I, W and B time less
what it had run by F_k (transfers, waits and recomputation only add), so makespan >= e_k + R_k,
and a plan that fits has
    makespan >= c_r + R_{k_n} + (need_{k_1} + ... + need_{k_n}) / rate_r
for every such chain. A single point bounds a burst (a warm-up's forwards back to back); a
chain, a steady state whose copies cannot keep up. Ranks that share a queue (``HostLink.
ranks_per_link``) copy different activations on it, so one chain per rank, ending where each
rank has at least R left, needs its summed bytes moved (at the fastest of their rates) by the
latest end: makespan >= c + R + (sum of the chains) / rate. Live sets of points j < k are disjoint
exactly when the oldest activation live at k was made after F_j (a live activation is one
interval of the order), so the best chain ending at each k is a prefix maximum away (one pass).
Offload planning inserts transfers and waits into the order; it does not reorder, add or remove
F, I, W or B (offload/plan.py), so the order's sets are the plan's. It holds for any offload
target without recomputation (``all``, ``chunks:K``, ...), fetched or reloaded, and for plans
without offload (rate 0: a point over the room never fits); not for recompute-and-offload,
whose recomputed forwards are not resident. tests/test_planner_bounds.py checks it against
offload plans of random shapes, costs, policies and rooms, and against full evaluations.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import NamedTuple

from pipeoffload.core.actions import Kind
from pipeoffload.core.schedule import Schedule
from pipeoffload.planner.bounds import forward_starts, stage_durations
from pipeoffload.sim.costs import CostModel

_KINDS = (Kind.F, Kind.I, Kind.W, Kind.B)
_SLOT = {kind: i for i, kind in enumerate(_KINDS)}


class RankPoints(NamedTuple):
    """One rank's order as Note: [fitting time] reads it, cost-free: per forward (a point),
    in order, its live activations and what the rank had run by its end."""

    stages: tuple[int, ...]  # the rank's stages
    vectors: tuple[tuple[int, ...], ...]  # distinct live counts per stage (in ``stages`` order)
    live: tuple[int, ...]  # per point, its index into ``vectors``
    oldest: tuple[int, ...]  # per point, the point that made its oldest live activation
    done: tuple[tuple[int, ...], ...]  # per point, F, I, W, B counts per stage, flat
    totals: tuple[int, ...]  # the same counts for the whole order


def fit_points(schedule: Schedule) -> list[RankPoints]:
    """Per rank, the points of Note: [fitting time] (one pass over the order)."""
    out = []
    for actions in schedule.ranks:
        stages = tuple(sorted({a[0] for a in actions}))
        slot = {stage: i for i, stage in enumerate(stages)}
        count = [0] * len(stages)
        done = [0] * (4 * len(stages))
        vector_id: dict[tuple[int, ...], int] = {}
        made: dict[tuple[int, int], int] = {}  # live activation -> the point that made it
        alive: list[bool] = []  # per point, whether the activation it made is still live
        first = 0  # the earliest point whose activation is live
        live: list[int] = []
        oldest: list[int] = []
        done_at: list[tuple[int, ...]] = []
        for stage, kind, mb in actions:
            at = _SLOT.get(kind)
            if at is None:
                continue
            i = slot[stage]
            done[4 * i + at] += 1
            if at == 0:
                count[i] += 1
                made[(stage, mb)] = len(live)
                alive.append(True)
                while not alive[first]:
                    first += 1
                live.append(vector_id.setdefault(tuple(count), len(vector_id)))
                oldest.append(first)
                done_at.append(tuple(done))
            elif at != 1:  # W or B frees the activation
                count[i] -= 1
                point = made.pop((stage, mb), None)
                if point is not None:
                    alive[point] = False
        out.append(RankPoints(stages, tuple(vector_id), tuple(live), tuple(oldest),
                              tuple(done_at), tuple(done)))
    return out


def fitting_makespan_bound(points: Sequence[RankPoints], costs: CostModel,
                           stage_to_rank: tuple[int, ...], rooms: Sequence[float]) -> float:
    """A lower bound of the makespan of any offload plan (no recomputation) of the schedule
    ``points`` were read from (``fit_points``) whose activations stay within ``rooms[r]`` bytes
    on every rank r (Note: [fitting time]); math.inf when one cannot fit however long it runs,
    0.0 when nothing binds."""
    if costs.overlap_f_b is not None:
        raise ValueError("fitting_makespan_bound: overlapped F&B pairs shorten durations; "
                         "the bound assumes costs.overlap_f_b is None")
    per_kind = stage_durations(costs, len(stage_to_rank))  # F, I, W, B: the points' order
    starts = forward_starts(costs, stage_to_rank, per_kind[0])
    per_link = costs.host_link.ranks_per_link
    link_start: dict[int, float] = {}
    for stage, rank in enumerate(stage_to_rank):
        link = rank // per_link
        link_start[link] = min(link_start.get(link, math.inf), starts[stage])
    chains: dict[int, list[list[tuple[float, float]]]] = {}  # per link, its ranks' chains
    rates: dict[int, float] = {}
    for rank, order in enumerate(points):
        sizes = [costs.bytes_of(stage) or 0.0 for stage in order.stages]
        needs = [sum(map(operator.mul, vector, sizes)) - rooms[rank] for vector in order.vectors]
        if max(needs, default=0.0) <= 0:
            continue
        rate = 0.0
        for stage, size in zip(order.stages, sizes):
            if size > 0:
                took = costs.transfer_time(stage, Kind.OFFLOAD)
                rate = max(rate, size / took if took > 0 else math.inf)
        if rate == math.inf:
            continue  # its copies take no time: its memory binds nothing
        if rate == 0:
            return math.inf
        link = rank // per_link
        rates[link] = max(rates.get(link, 0.0), rate)
        chains.setdefault(link, []).append(_chains(order, needs, per_kind))
    bound = 0.0
    for link, ranks in chains.items():
        # Ranks sharing a queue copy different activations: their chains add up, and all
        # are done by the latest end, which leaves at least the smallest of their R.
        floors = sorted({left for chain in ranks for left, _ in chain}, reverse=True)
        at = [0] * len(ranks)
        for floor in floors:
            moved = 0.0
            for r, chain in enumerate(ranks):
                while at[r] < len(chain) and chain[at[r]][0] >= floor:
                    at[r] += 1
                moved += chain[at[r] - 1][1] if at[r] else 0.0
            bound = max(bound, link_start[link] + floor + moved / rates[link])
    return bound * (1 - 1e-9)  # its sums run in another order than the simulator's


def _chains(order: RankPoints, needs: list[float], per_kind: tuple[list[float], ...]
            ) -> list[tuple[float, float]]:
    """One rank's points with bytes to copy, in order: (R_k, the largest need over chains
    ending at or before k) (Note: [fitting time])."""
    durations = [kind_times[stage] for stage in order.stages for kind_times in per_kind]
    total = sum(map(operator.mul, order.totals, durations))
    best_before = [0.0]  # best_before[j]: the best chain over points before j (or none)
    out = []
    for k, (vector, first) in enumerate(zip(order.live, order.oldest)):
        need = needs[vector]
        if need <= 0:  # no better chain ends here: an earlier point ends it, sooner
            best_before.append(best_before[-1])
            continue
        best_before.append(max(best_before[-1], need + best_before[first]))
        left = total - sum(map(operator.mul, order.done[k], durations))
        out.append((left, best_before[-1]))
    return out
