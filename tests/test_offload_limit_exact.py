"""The ``limit:`` search's fast paths give exactly what the plain ones gave: the estimate's
tagged memory changes (offload/limit.py ``_tagged_changes``, which places each tagged change
next to the change it cancels instead of sorting all of them) equal a full sort of every
change, weight for weight and in the same order, so the estimate's float sums are the same.
The reference below is the sorting version the fast one replaced."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeoffload.core.actions import Kind
from pipeoffload.core.registry import build_schedule
from pipeoffload.offload import limit as limit_module
from pipeoffload.offload import plan as plan_module
from pipeoffload.offload.plan import OffloadPolicy
from pipeoffload.sim.costs import CostModel, Duplex, HostLink
from pipeoffload.sim.memory import Role, memory_changes, streamed_fraction

_SCHEDULES = [
    ("grouped-interleaved", {"chunks": 2}),
    ("grouped-interleaved", {"chunks": 3}),
    ("interleaved-1f1b", {"chunks": 2}),
    ("zb-h1", {}),
    ("zbv", {}),
    ("v-half", {}),
    ("1f1b", {}),
]


def _reference_tagged_changes(schedule, result, rank, items, sizes, costs):
    """Every change of the rank and every tagged one, sorted by (time, position, role, weight,
    tag)."""
    forward, copy_out, copy_back, last_pass = {}, {}, {}, {}
    timeline = result.timeline[rank]
    for t in timeline:
        s, kind, m = t.action
        if kind is Kind.F:
            forward[(s, m)] = t
        elif kind is Kind.OFFLOAD:
            copy_out[(s, m)] = t
        elif kind is Kind.RELOAD:
            copy_back[(s, m)] = t
        elif kind in (Kind.W, Kind.B):
            last_pass[(s, m)] = t
    order, first_backward, last_order = {}, {}, {}
    for i, (s, kind, m) in enumerate(schedule.ranks[rank]):
        if kind is Kind.F:
            order[(s, m)] = i
        elif kind is Kind.I:
            first_backward[(s, m)] = i
        elif kind is Kind.B:
            first_backward.setdefault((s, m), i)
            last_order[(s, m)] = i
        elif kind is Kind.W:
            last_order[(s, m)] = i
    always = len(items)
    changes = [(time, at, role, sizes[s] * factor, always)
               for time, at, role, s, factor in memory_changes(schedule, timeline, costs)]
    for index, item in enumerate(items):
        copy = copy_out.get(item)
        if copy is None:
            continue
        s, f, at = item[0], forward[item], order[item]
        part = streamed_fraction(f.start, f.end, copy.start,
                                 costs.transfer_time(s, Kind.OFFLOAD))
        changes.append((f.start, at, Role.START, sizes[s] * (1.0 - part), index))
        changes.append((copy.end, at, Role.COPY_OUT_END, sizes[s] * part, index))
        back = copy_back.get(item)
        if back is not None:
            changes.append((back.start, first_backward[item], Role.COPY_BACK, -sizes[s], index))
        else:
            changes.append((last_pass[item].end, last_order[item], Role.END, -sizes[s], index))
    changes.sort()
    return [c[3] for c in changes], [c[4] for c in changes]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    which=st.integers(0, len(_SCHEDULES) - 1),
    pp=st.integers(2, 5),
    per_rank=st.integers(1, 3),
    ratio=st.sampled_from([None, 0.0, 0.3, 1.0, 2.5]),
    fetch=st.booleans(),
    half_duplex=st.booleans(),
    in_bytes=st.booleans(),
    keep=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_tagged_changes_equal_a_full_sort(which, pp, per_rank, ratio, fetch, half_duplex,
                                          in_bytes, keep, seed):
    name, options = _SCHEDULES[which]
    schedule = build_schedule(name, pp, per_rank * pp * 2, **options)
    costs = CostModel(offload_ratio=ratio, p2p_time=0.1 if seed % 3 == 0 else 0.0,
                      activation_bytes=3e6 if in_bytes else None,
                      host_link=HostLink(Duplex.HALF if half_duplex else Duplex.FULL,
                                         2 if seed % 2 else 1))
    policy = OffloadPolicy(fetch_on_use=fetch)
    planner = plan_module._Planner(schedule, costs, policy,
                                   plan_module.simulate(schedule, costs), keep_stalling=True)
    sizes = ([costs.bytes_of(s) for s in range(schedule.num_stages)] if in_bytes
             else planner.units)
    # Offload a longest-lived-first prefix on each rank, of a length drawn from ``keep``.
    prefixes = [int(round(keep * len(items)) + seed) % (len(items) + 1)
                for items in planner.by_lifespan]
    chosen = [it for r, items in enumerate(planner.by_lifespan) for it in items[: prefixes[r]]]
    outcome = planner.plan(chosen)
    planned, result, _ = outcome
    for rank in range(schedule.num_ranks):
        items = planner.by_lifespan[rank]
        fast = limit_module._tagged_changes(planned, result, rank, items, sizes)
        assert fast == _reference_tagged_changes(planned, result, rank, items, sizes, costs)
