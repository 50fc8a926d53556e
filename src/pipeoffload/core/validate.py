"""The validator: can this schedule run, and does it do all the work exactly once?

Checks, in order: indices in range; each action on the rank that holds its stage; each
(stage, microbatch) has one F and one backward (B, or I then W), at most one OFFLOAD and
either a RELOAD or a FETCH for it, at most one RECOMPUTE and never with an offload; finally
that no rank waits forever (found by running the schedule without a clock). torch's markers
(UNSHARD / RESHARD / REDUCE_GRAD, Note: [torch markers]) are checked for index and placement only.
"""

from __future__ import annotations

import itertools
from collections import Counter

from pipeoffload.core.actions import MARKER_KINDS, Action, Kind
from pipeoffload.core.deps import Dependencies
from pipeoffload.core.errors import ScheduleError
from pipeoffload.core.schedule import Schedule


def validate(schedule: Schedule) -> Schedule:
    """Raise ScheduleError with rank, position and action if ``schedule`` cannot run; else
    return it unchanged (so it chains: ``validate(build(...))``)."""
    if not _indices_and_placement_hold(schedule):
        _check_indices_and_placement(schedule)
    work = schedule.without(*MARKER_KINDS) if schedule.has_kind(*MARKER_KINDS) else schedule
    if not _counts_hold(work):
        _check_counts(work)
    _check_progress(work)
    return schedule


# Note: [fast checks] Validating a schedule at p = 32, m = 256 (10^5 actions) took about as long
# as planning offload into it. Each check below first asks its question of whole sets (what
# C code does quickly); only when the answer is no does the per-action check run, to name the
# first offending rank, position and action exactly as before.


def _indices_and_placement_hold(schedule: Schedule) -> bool:
    """Whether ``_check_indices_and_placement`` would pass (see [fast checks])."""
    if schedule.routes:
        return False  # DualPipe's routes: the per-action check is the only one
    microbatches = set(range(schedule.microbatches))
    microbatches.add(None)  # torch's markers may have none
    for rank, actions in enumerate(schedule.ranks):
        if not ({a[0] for a in actions} <= set(schedule.stages_on_rank(rank))
                and {a[2] for a in actions} <= microbatches):
            return False
    return True


def _counts_hold(schedule: Schedule) -> bool:
    """Whether ``_check_counts`` would pass, given indices in range (see [fast checks])."""
    present = set(itertools.chain.from_iterable(schedule.ranks))
    if len(present) != sum(len(actions) for actions in schedule.ranks):
        return False  # an action twice
    pairs: dict[Kind, set[tuple[int, int]]] = {kind: set() for kind in Kind}
    for stage, kind, mb in present:
        pairs[kind].add((stage, mb))
    expected = {(stage, mb) for mb in range(schedule.microbatches)
                for stage in schedule.route_of(mb)}
    f, i, w, b = pairs[Kind.F], pairs[Kind.I], pairs[Kind.W], pairs[Kind.B]
    offload, back = pairs[Kind.OFFLOAD], pairs[Kind.RELOAD] | pairs[Kind.FETCH]
    return (f == expected and not b & (i | w) and b | (i & w) == expected
            and not pairs[Kind.RELOAD] & pairs[Kind.FETCH] and offload == back
            and pairs[Kind.OFFLOAD_WAIT] <= offload and not pairs[Kind.RECOMPUTE] & offload)


def _fail(schedule: Schedule, message: str, rank: int, position: int, action: Action) -> None:
    grid = schedule.format_grid(mark=(rank, position))
    raise ScheduleError(
        f"rank {rank}, position {position}, action {action}: {message}\n{grid}",
        rank=rank,
        position=position,
        action=action,
    )


def _check_indices_and_placement(schedule: Schedule) -> None:
    for rank, position, action in schedule.actions:
        if not 0 <= action.stage < schedule.num_stages:
            _fail(schedule, f"stage {action.stage} does not exist "
                  f"(the schedule has stages 0..{schedule.num_stages - 1})", rank, position, action)
        if action.microbatch is not None and not 0 <= action.microbatch < schedule.microbatches:
            _fail(schedule, f"microbatch {action.microbatch} does not exist "
                  f"(the schedule has microbatches 0..{schedule.microbatches - 1})",
                  rank, position, action)
        route = schedule.route_of(action.microbatch)
        if action.stage not in route:
            _fail(schedule, f"microbatch {action.microbatch} runs through stages "
                  f"{route[0]}..{route[-1]} only (Note: [routes], core/schedule.py)",
                  rank, position, action)
        owner = schedule.rank_of(action.stage)
        if owner != rank:
            _fail(schedule, f"stage {action.stage} lives on rank {owner}, not on rank {rank}",
                  rank, position, action)


def _check_counts(schedule: Schedule) -> None:
    seen: Counter[Action] = Counter()
    where: dict[Action, tuple[int, int]] = {}
    for rank, position, action in schedule.actions:
        seen[action] += 1
        if seen[action] == 2:
            _fail(schedule, "appears twice (each action runs exactly once)", rank, position, action)
        where.setdefault(action, (rank, position))

    for stage in range(schedule.num_stages):
        for mb in range(schedule.microbatches):
            if stage not in schedule.route_of(mb):
                continue
            has = {kind: Action(stage, kind, mb) in seen for kind in Kind}
            anchor = Action(stage, Kind.F, mb)
            # Point at the F if it exists, else at the start of the rank that should run it.
            rank, position = where.get(anchor, (schedule.rank_of(stage), 0))
            if not has[Kind.F]:
                _fail(schedule, f"missing forward {anchor} on rank {rank}", rank, position, anchor)
            if has[Kind.B] and (has[Kind.I] or has[Kind.W]):
                _fail(schedule, f"stage {stage} microbatch {mb} has both B and I/W; "
                      "use B alone or I then W", rank, position, anchor)
            if not has[Kind.B] and not (has[Kind.I] and has[Kind.W]):
                missing = "W" if has[Kind.I] else "I" if has[Kind.W] else "B (or I and W)"
                _fail(schedule, f"missing backward {missing} for stage {stage} microbatch {mb}",
                      rank, position, anchor)
            if has[Kind.RELOAD] and has[Kind.FETCH]:
                act = Action(stage, Kind.FETCH, mb)
                r, p = where[act]
                _fail(schedule, "an offloaded (stage, microbatch) comes back by RELOAD or by "
                      "FETCH, not both", r, p, act)
            if has[Kind.OFFLOAD] != (has[Kind.RELOAD] or has[Kind.FETCH]):
                if has[Kind.OFFLOAD]:
                    act, missing_kind = Action(stage, Kind.OFFLOAD, mb), "RELOAD or FETCH"
                else:
                    back = Kind.RELOAD if has[Kind.RELOAD] else Kind.FETCH
                    act, missing_kind = Action(stage, back, mb), "OFFLOAD"
                r, p = where[act]
                _fail(schedule, f"{act} has no matching {missing_kind}", r, p, act)
            if has[Kind.OFFLOAD_WAIT] and not has[Kind.OFFLOAD]:
                act = Action(stage, Kind.OFFLOAD_WAIT, mb)
                r, p = where[act]
                _fail(schedule, f"{act} waits for an OFFLOAD that no rank runs", r, p, act)
            if has[Kind.RECOMPUTE] and has[Kind.OFFLOAD]:
                act = Action(stage, Kind.RECOMPUTE, mb)
                r, p = where[act]
                _fail(schedule, "a (stage, microbatch) is either offloaded or recomputed, not both",
                      r, p, act)


def _check_progress(schedule: Schedule) -> None:
    """Run every rank's list without a clock; report the first rank that can never continue."""
    numbered = schedule.numbered
    order, pointer = numbered.walk
    if len(order) == len(numbered.actions):
        return
    deps = Dependencies(schedule)
    done = {numbered.actions[i] for i in order}
    stuck = [r for r in range(schedule.num_ranks) if pointer[r] < len(schedule.ranks[r])]
    present = {a for acts in schedule.ranks for a in acts}
    lines = []
    for rank in stuck:
        action = schedule.ranks[rank][pointer[rank]]
        blocker = next(d for d in deps.of(action) if d not in done)
        why = (f"waits for {blocker}, which no rank runs" if blocker not in present
               else f"waits for {blocker} on rank {schedule.rank_of(blocker.stage)}")
        lines.append(f"rank {rank} position {pointer[rank]} {action} {why}")
    rank = stuck[0]
    action = schedule.ranks[rank][pointer[rank]]
    _fail(schedule, "deadlock: no rank can continue:\n  " + "\n  ".join(lines),
          rank, pointer[rank], action)
