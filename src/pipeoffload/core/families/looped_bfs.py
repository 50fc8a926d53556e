"""Looped breadth-first pipeline (torch.distributed.pipelining's ``ScheduleLoopedBFS``).

From Lamy-Poirier, "Breadth-First Pipeline Parallelism" (MLSys 2023, arXiv 2211.05953), as torch
ships it: v chunks per rank in loop placement (stage s on rank s % p); rank r runs every
microbatch through its chunk 0, then through chunk 1, ... (breadth first: a chunk takes all the
microbatches before the next chunk starts), then the full backwards chunk by chunk from the last,
microbatches in reverse order within a chunk. Every rank holds all v*m chunk activations at its
peak, like GPipe; the paper pairs it with sharded data parallelism, whose gather of a chunk's
weights then serves all microbatches at once. v = 1 is GPipe with the backwards reversed.
Where we differ: nothing in the order, which is torch's.
"""

from __future__ import annotations

from pipeoffload.core.actions import B, F
from pipeoffload.core.families.base import FamilySpec, check_common, check_int
from pipeoffload.core.schedule import Schedule, loop_placement
from pipeoffload.core.validate import validate

NAME = "looped-bfs"


def looped_bfs(pp: int, microbatches: int, chunks: int = 2) -> Schedule:
    """Breadth-first looped order with ``chunks`` stages per rank."""
    check_common(NAME, pp, microbatches)
    check_int("chunks", chunks, 1, NAME)
    ranks = []
    for r in range(pp):
        stages = [c * pp + r for c in range(chunks)]
        forwards = [F(s, mb) for s in stages for mb in range(microbatches)]
        backwards = [B(s, mb) for s in reversed(stages) for mb in reversed(range(microbatches))]
        ranks.append(forwards + backwards)
    return validate(Schedule(ranks, loop_placement(pp, chunks), microbatches, NAME))


SPEC = FamilySpec(
    name=NAME,
    description="breadth first (torch's LoopedBFS): each chunk runs all microbatches, then "
                "backwards in reverse; peak v*m chunks",
    build=looped_bfs,
    options=("chunks",),
    aliases=("loopedbfs", "breadthfirst", "bfs"),
)
