"""GPipe: every forward, then every full backward.

Follows Huang et al., "GPipe" (NeurIPS 2019): each rank runs F of microbatches 0..m-1, then B
of 0..m-1 (the order torch.distributed.pipelining's ScheduleGPipe uses). Bubble
(p-1)/(m+p-1) with T_B = 2 T_F; every rank holds all m microbatches at its peak.
We differ only in using one full backward B per (stage, microbatch), with no I / W split.
"""

from __future__ import annotations

from pipeoffload.core.actions import B, F
from pipeoffload.core.families.base import FamilySpec, check_common
from pipeoffload.core.schedule import Schedule, loop_placement
from pipeoffload.core.validate import validate

NAME = "gpipe"


def gpipe(pp: int, microbatches: int) -> Schedule:
    """GPipe on ``pp`` ranks, one stage each."""
    check_common(NAME, pp, microbatches)
    ranks = [[F(r, j) for j in range(microbatches)] + [B(r, j) for j in range(microbatches)]
             for r in range(pp)]
    return validate(Schedule(ranks, loop_placement(pp, 1), microbatches, NAME))


SPEC = FamilySpec(
    name=NAME,
    description="all forwards, then all backwards; 1 stage per rank; peak m microbatches",
    build=gpipe,
    fixed_chunks=1,
)
