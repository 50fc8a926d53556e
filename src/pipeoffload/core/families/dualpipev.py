"""DualPipeV: DualPipe folded into V placement (2 stages per rank, one copy of the weights).

From DeepSeek's DualPipe repository (``DualPipeV``; "cut-in-half" DualPipe, after Sea AI Lab's
observation) and torch 2.13's ``ScheduleDualPipeV``: rank r holds stage r and stage 2p-1-r
(ZB-V's placement) and runs the shared DualPipe program (dual_program.py) with n = p, h = r,
phase 0 = stage r and phase 1 = stage 2p-1-r, both fed microbatches 0..m-1.
Where we differ from torch: none in the order of compute; torch writes each overlapped pair as
one ``OVERLAP_F_B`` action, we write its two passes in order (Note: [overlapped pair],
sim/simulator.py) and name the forwards that open a pair (``overlapped_forwards``; the torch
adapter runs those pairs as ``OVERLAP_F_B``), and we need no SEND/RECV in the generated schedule
(the runtime adds them).
"""

from __future__ import annotations

from pipeoffload.core.actions import Action
from pipeoffload.core.errors import ConfigError
from pipeoffload.core.families.base import FamilySpec, check_common
from pipeoffload.core.families.dual_program import dual_program, overlapped_forwards
from pipeoffload.core.schedule import Placement, Schedule, v_placement
from pipeoffload.core.validate import validate

DUALPIPEV = "dualpipev"


def _check(pp: int, microbatches: int) -> None:
    check_common(DUALPIPEV, pp, microbatches)
    if microbatches < 2 * pp:
        raise ConfigError(f"{DUALPIPEV}: needs microbatches >= 2 * pp = {2 * pp} (as DeepSeek's "
                          f"and torch's DualPipeV: one per stage), got {microbatches}; "
                          f"use more microbatches or fewer ranks")


def dualpipev(pp: int, microbatches: int) -> Schedule:
    """DualPipeV on ``pp`` ranks (2 stages each); needs microbatches >= 2 * pp."""
    _check(pp, microbatches)
    stream = tuple(range(microbatches))
    ranks = [dual_program(pp, r, (r, 2 * pp - 1 - r), (stream, stream)) for r in range(pp)]
    return validate(Schedule(ranks, v_placement(pp), microbatches, DUALPIPEV))


def dualpipev_overlapped(pp: int, microbatches: int) -> frozenset[Action]:
    """The forwards of ``dualpipev(pp, microbatches)`` that open an overlapped pair with the
    full backward after them on their rank (DeepSeek's F&B, torch's ``OVERLAP_F_B``)."""
    _check(pp, microbatches)
    stream = tuple(range(microbatches))
    return frozenset().union(*(overlapped_forwards(pp, r, (r, 2 * pp - 1 - r), (stream, stream))
                               for r in range(pp)))


SPEC = FamilySpec(
    name=DUALPIPEV,
    description="DualPipeV (DeepSeek): V placement, overlapped F/B pairs, peak about 2p + 1 "
                "chunks, needs m >= 2p",
    build=dualpipev,
    fixed_chunks=2,
    placement=Placement.V,
    split_backward=True,
    w_deferred=True,
)
