"""The validator: can this schedule run, and does it do all the work exactly once?

Checks, in order: indices in range; each action on the rank that holds its stage; each
(stage, microbatch) has one F and one backward (B, or I then W), at most one OFFLOAD and
either a RELOAD or a FETCH for it, at most one RECOMPUTE and never with an offload; finally
that no rank waits forever (found by running the schedule without a clock). torch's markers
(UNSHARD / RESHARD / REDUCE_GRAD, Note: [torch markers]) are checked for index and placement only.
"""

from __future__ import annotations

import collections
import itertools
import operator

from pipeoffload.checks import check_instance
from pipeoffload.core.actions import MARKER_KINDS, Action, Kind
from pipeoffload.core.deps import Dependencies, numbering
from pipeoffload.core.errors import ScheduleError
from pipeoffload.core.schedule import Schedule

_STAGE, _KIND, _MICROBATCH = operator.itemgetter(0), operator.itemgetter(1), operator.itemgetter(2)


def validate(schedule: Schedule) -> Schedule:
    """Raise ScheduleError with rank, position and action if ``schedule`` cannot run; else
    return it unchanged (so it chains: ``validate(build(...))``)."""
    check_instance("validate: schedule", schedule, Schedule, "a Schedule")
    plain = _placed_plainly(schedule)
    if not plain:
        _check_indices_and_placement(schedule)
    work = schedule.without(*MARKER_KINDS)  # itself when it has none
    if not (plain and _counted_plainly(work)):
        _check_counts(work)
    _check_progress(work)
    return schedule


def _placed_plainly(schedule: Schedule) -> bool:
    """Whether every action's microbatch is an integer in range and its stage on its rank, shown
    by a few C-level passes per rank (no routes to follow); False sends the caller to the
    per-action check, which also says what is wrong."""
    if schedule.routes:
        return False
    count = schedule.microbatches
    for rank, actions in enumerate(schedule.ranks):
        if not actions:
            continue
        if not frozenset(schedule.stages_on_rank(rank)).issuperset(map(_STAGE, actions)):
            return False
        if not all(map(isinstance, map(_MICROBATCH, actions), itertools.repeat(int))):
            return False  # a marker without a microbatch, or a microbatch that is no integer
        if min(map(_MICROBATCH, actions)) < 0 or max(map(_MICROBATCH, actions)) >= count:
            return False
    return True


def _counted_plainly(schedule: Schedule) -> bool:
    """Whether no action repeats and each kind present appears once per (stage, microbatch),
    those kinds making a valid pair: then every pair has exactly them (each kind's actions are
    that many distinct pairs, all in range: ``_placed_plainly``). Family builds are like this;
    anything else goes to ``_check_counts``, which finds and explains the problem."""
    actions = list(itertools.chain.from_iterable(schedule.ranks))
    per_kind = collections.Counter(map(_KIND, actions))
    pairs = schedule.num_stages * schedule.microbatches
    return (all(n == pairs for n in per_kind.values()) and len(set(actions)) == len(actions)
            and _pair_problem(0, 0, frozenset(per_kind)) is None)


def _fail(schedule: Schedule, message: str, rank: int, position: int, action: Action) -> None:
    grid = schedule.format_grid(mark=(rank, position))
    raise ScheduleError(
        f"rank {rank}, position {position}, action {action}: {message}\n{grid}",
        rank=rank,
        position=position,
        action=action,
    )


def _check_indices_and_placement(schedule: Schedule) -> None:
    """Each action's stage and microbatch exist, its stage is on its rank and on its
    microbatch's route. One set lookup per action; a failure is explained by ``_placement``."""
    microbatches = schedule.microbatches
    routed = bool(schedule.routes)
    route_sets = [frozenset(route) for route in schedule.routes]
    for rank, actions in enumerate(schedule.ranks):
        own = frozenset(schedule.stages_on_rank(rank))
        for position, (stage, _, mb) in enumerate(actions):
            if stage in own and (mb is None or 0 <= mb < microbatches and (
                    not routed or stage in route_sets[mb * len(route_sets) // microbatches])):
                continue
            _placement(schedule, rank, position, actions[position])


def _placement(schedule: Schedule, rank: int, position: int, action: Action) -> None:
    """Raise the error that says why ``action`` cannot be where it is."""
    if not 0 <= action.stage < schedule.num_stages:
        _fail(schedule, f"stage {action.stage} does not exist "
              f"(the schedule has stages 0..{schedule.num_stages - 1})", rank, position, action)
    if action.microbatch is not None and not 0 <= action.microbatch < schedule.microbatches:
        _fail(schedule, f"microbatch {action.microbatch} does not exist "
              f"(the schedule has microbatches 0..{schedule.microbatches - 1})",
              rank, position, action)
    if action.microbatch is not None:
        route = schedule.route_of(action.microbatch)
        if action.stage not in route:
            _fail(schedule, f"microbatch {action.microbatch} runs through stages "
                  f"{route[0]}..{route[-1]} only (Note: [routes], core/schedule.py)",
                  rank, position, action)
    owner = schedule.rank_of(action.stage)
    _fail(schedule, f"stage {action.stage} lives on rank {owner}, not on rank {rank}",
          rank, position, action)


_BIT = {kind: 1 << i for i, kind in enumerate(Kind)}


def _check_counts(schedule: Schedule) -> None:
    """Each action once; each (stage, microbatch) on a route has a forward, one backward and
    consistent transfers (``_pair_problem``). Kinds per pair are gathered as bit masks, so the
    rules run once per distinct mask. The work follows the actions present, never more than
    twice their number: pairs are visited one by one only when there are at most that many
    (``_check_dense_counts``), else missing ones are found as gaps in each stage's sorted
    microbatches (a CSV may declare 10^13 microbatches)."""
    total = sum(map(len, schedule.ranks))
    if schedule.num_stages * schedule.microbatches <= 2 * total:
        _check_dense_counts(schedule)
    else:
        _check_sparse_counts(schedule, total)


def _check_sparse_counts(schedule: Schedule, total: int) -> None:
    """``_check_counts`` by a dict of the pairs present (a CSV may declare far more)."""
    present = set(itertools.chain.from_iterable(schedule.ranks))
    if len(present) != total:
        _duplicate(schedule)
    masks: dict[tuple[int, int], int] = {}
    bit = _BIT
    for stage, kind, mb in present:
        if mb is not None:
            key = (stage, mb)
            masks[key] = masks.get(key, 0) | bit[kind]
    by_stage: dict[int, list[int]] = {}
    for stage, mb in masks:
        by_stage.setdefault(stage, []).append(mb)
    verdict: dict[int, bool] = {}
    for stage in range(schedule.num_stages):
        expected = _microbatches_of(schedule, stage)
        have = sorted(by_stage.get(stage, ()))
        missing = next((want for want, got in zip(expected, have) if want != got),
                       expected[len(have)] if len(have) < len(expected) else None)
        for mb in have:
            if missing is not None and mb > missing:
                break
            mask = masks[(stage, mb)]
            ok = verdict.get(mask)
            if ok is None:
                ok = verdict[mask] = _pair_problem(stage, mb, _kinds(mask)) is None
            if not ok:
                _explain_pair(schedule, stage, mb, _kinds(mask))
        if missing is not None:
            _explain_pair(schedule, stage, missing, frozenset())


def _check_dense_counts(schedule: Schedule) -> None:
    """``_check_counts`` where there are at least half as many actions as (stage, microbatch)
    pairs (every schedule that can pass has two per pair): masks in one list indexed by
    ``microbatch * stages + stage``, a kind seen twice in a pair is a repeated action, and
    pairs are checked stage by stage in microbatch order, as ``_check_counts`` reports them.
    Indices were checked in range before (``_check_indices_and_placement``)."""
    stages = schedule.num_stages
    masks = [0] * (stages * schedule.microbatches)
    bit = _BIT
    for stage, kind, mb in itertools.chain.from_iterable(schedule.ranks):
        k = mb * stages + stage
        if masks[k] & bit[kind]:
            _duplicate(schedule)
        masks[k] |= bit[kind]
    verdict: dict[int, bool] = {}
    for stage in range(stages):
        for mb in _microbatches_of(schedule, stage):
            mask = masks[mb * stages + stage]
            ok = verdict.get(mask)
            if ok is None:
                ok = verdict[mask] = _pair_problem(stage, mb, _kinds(mask)) is None
            if not ok:
                _explain_pair(schedule, stage, mb, _kinds(mask))


def _microbatches_of(schedule: Schedule, stage: int) -> range:
    """The microbatches whose route runs through ``stage`` (Note: [routes]): microbatch m
    takes route m * R // M, so each route's microbatches are one run."""
    count = schedule.microbatches
    routes = schedule.routes
    if not routes:
        return range(count)
    index = next(i for i, route in enumerate(routes) if stage in route)
    return range(-(-index * count // len(routes)), -(-(index + 1) * count // len(routes)))


def _kinds(mask: int) -> frozenset[Kind]:
    return frozenset(kind for kind, bit in _BIT.items() if mask & bit)


def _duplicate(schedule: Schedule) -> None:
    seen: set[Action] = set()
    for rank, position, action in schedule.actions:
        if action in seen:
            _fail(schedule, "appears twice (each action runs exactly once)", rank, position,
                  action)
        seen.add(action)


def _explain_pair(schedule: Schedule, stage: int, mb: int, has: frozenset[Kind]) -> None:
    """Raise the error ``_pair_problem`` finds, pointing at the action it names (or at the
    forward, else at the start of the rank that should run it)."""
    problem = _pair_problem(stage, mb, has)
    assert problem is not None
    message, kind = problem
    target = Action(stage, kind, mb)
    rank, position = next(((r, p) for r, p, a in schedule.actions if a == target),
                          (schedule.rank_of(stage), 0))
    _fail(schedule, message.format(rank=rank), rank, position, target)


def _pair_problem(stage: int, mb: int, has: frozenset[Kind]) -> tuple[str, Kind] | None:
    """What is wrong with the kinds one (stage, microbatch) has, and which of its actions to
    point at ({rank} in the message is filled in by the caller); None if nothing is."""
    F, I, W, B = Kind.F, Kind.I, Kind.W, Kind.B  # noqa: N806, E741
    offload, reload, fetch = Kind.OFFLOAD in has, Kind.RELOAD in has, Kind.FETCH in has
    if F not in has:
        return f"missing forward {Action(stage, F, mb)} on rank {{rank}}", F
    if B in has and (I in has or W in has):
        return (f"stage {stage} microbatch {mb} has both B and I/W; use B alone or I then W",
                F)
    if B not in has and not (I in has and W in has):
        missing = "W" if I in has else "I" if W in has else "B (or I and W)"
        return f"missing backward {missing} for stage {stage} microbatch {mb}", F
    if reload and fetch:
        return ("an offloaded (stage, microbatch) comes back by RELOAD or by FETCH, not both",
                Kind.FETCH)
    if offload != (reload or fetch):
        if offload:
            kind, missing_kind = Kind.OFFLOAD, "RELOAD or FETCH"
        else:
            kind, missing_kind = (Kind.RELOAD if reload else Kind.FETCH), "OFFLOAD"
        return f"{Action(stage, kind, mb)} has no matching {missing_kind}", kind
    if Kind.OFFLOAD_WAIT in has and not offload:
        wait = Action(stage, Kind.OFFLOAD_WAIT, mb)
        return f"{wait} waits for an OFFLOAD that no rank runs", Kind.OFFLOAD_WAIT
    if Kind.RECOMPUTE in has and offload:
        return ("a (stage, microbatch) is either offloaded or recomputed, not both",
                Kind.RECOMPUTE)
    return None


def _check_progress(schedule: Schedule) -> None:
    """Run every rank's list without a clock; report the first rank that can never continue."""
    numbered = numbering(schedule)
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
