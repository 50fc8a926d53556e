"""The recomputation pass: mark (stage, microbatch) activations to be rebuilt instead of kept.

A recomputed (stage, microbatch) runs its F without autograd recording and keeps only its
input; a RECOMPUTE action right before its backward re-runs the forward (recording, from the
same RNG state) and the backward proceeds as usual. The simulator charges the RECOMPUTE a
forward's time and counts the activation resident only from the RECOMPUTE's start (Note
[memory accounting]); the runtime executes it (Note [recompute] in runtime/executor.py), so the
gradients equal a plain run's. Offload and recompute mix per item: run this pass first, then
``add_offload``, which leaves recomputed items alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.schedule import Schedule
from pipeoffload.errors import ConfigError
from pipeoffload.offload.select import Item, Lifespans
from pipeoffload.offload.targets import OffloadTarget, TargetKind, parse_target
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.simulator import SimResult, activation_units, simulate


@dataclass(frozen=True)
class RecomputePlan:
    schedule: Schedule
    recomputed: tuple[Item, ...]
    notes: tuple[str, ...]
    result: SimResult = field(repr=False)


def add_recompute(schedule: Schedule, costs: CostModel | None = None,
                  target: str | OffloadTarget | None = "all", *,
                  base: SimResult | None = None) -> RecomputePlan:
    """Insert RECOMPUTE(s, m) right before the backward of each (s, m) the target picks
    (``all``, ``chunks:K`` or ``fraction:X``; longest-lived first, offloaded items excluded).
    ``base``: the simulation of ``schedule`` without RECOMPUTE actions, when the caller has it."""
    costs = costs or CostModel()
    target = parse_target(target)
    if target.kind in (TargetKind.LIMIT, TargetKind.RECOMPUTE_CHUNKS_THEN_ALL):
        raise ConfigError(f"recompute target {target}: use none, all, chunks:K or fraction:X")
    bare = schedule.without(Kind.RECOMPUTE)
    if base is None or base.costs != costs or base.schedule.ranks != bare.ranks:
        base = simulate(bare, costs)
    chosen, notes = Lifespans(base).choose(target, activation_units(bare, costs), "recomputes")
    offloaded = {(a.stage, a.microbatch) for acts in bare.ranks for a in acts
                 if a.kind is Kind.OFFLOAD}
    picked = {item for item in chosen if item not in offloaded}
    ranks = []
    for actions in bare.ranks:
        out: list[Action] = []
        for action in actions:
            if action.kind.is_backward and (action.stage, action.microbatch) in picked:
                out.append(Action(action.stage, Kind.RECOMPUTE, action.microbatch))
            out.append(action)
        ranks.append(out)
    planned = bare.with_ranks(ranks)
    return RecomputePlan(planned, tuple(sorted(picked)), notes, simulate(planned, costs))
