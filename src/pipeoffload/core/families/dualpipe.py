"""DualPipe: DeepSeek-V3's bidirectional schedule (two copies of the weights, 2p stages).

From DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv 2412.19437), section 3.2.1, and
github.com/deepseek-ai/DualPipe. The model is cut into p parts; rank r holds part r for the
microbatches that enter at rank 0 and part p-1-r for those that enter at rank p-1, so every part
lives on two ranks. In our representation (Note: [routes], core/schedule.py) that is 2p stages
in V placement with two routes: stages 0..p-1 (part j = stage j, on rank j) carry the first half
of the microbatches, stages p..2p-1 (part j = stage p+j, on rank p-1-j) the second half. Stage j
and stage p+j are the same model part: the user ties their weights (local mode) or sums their
gradients across the two ranks (distributed), as DeepSeek does.
Each rank runs the shared DualPipe program (dual_program.py) with n = p/2 and h = min(r, p-1-r):
phase 0 is the direction that enters on its own half of the pipeline.
Checked by reading ``DualPipe.step`` in deepseek-ai/DualPipe: the same eight steps and counts
(its step 4 runs half_num_chunks - num_ranks + half_rank + 1 times, our c - 2n + h + 1), the
same phases per half of the ranks, and its m >= 2p, even m and even p.
Where we differ: the overlapped pairs are two actions in order (Note: [overlapped pair]).
"""

from __future__ import annotations

from pipeoffload.core.errors import ConfigError
from pipeoffload.core.families.base import FamilySpec, check_common
from pipeoffload.core.families.dual_program import dual_program
from pipeoffload.core.families.dualpipev import DUALPIPEV
from pipeoffload.core.schedule import Placement, Schedule, v_placement
from pipeoffload.core.validate import validate

DUALPIPE = "dualpipe"


def twin_stage(pp: int, stage: int) -> int:
    """The other stage of DualPipe's 2p that stands for the same model part as ``stage``."""
    return stage + pp if stage < pp else stage - pp


def dualpipe(pp: int, microbatches: int) -> Schedule:
    """DualPipe on ``pp`` ranks (even; 2 stages each); needs an even microbatches >= 2 * pp."""
    check_common(DUALPIPE, pp, microbatches, min_pp=2)
    if pp % 2 or microbatches % 2 or microbatches < 2 * pp:
        raise ConfigError(f"{DUALPIPE}: needs an even pp and an even microbatches >= 2 * pp "
                          f"(half enter at each end), got pp={pp}, microbatches={microbatches}; "
                          f"for odd pp use dualpipev")
    half = microbatches // 2
    down, up = tuple(range(half)), tuple(range(half, microbatches))
    ranks = []
    for r in range(pp):
        own, other = (r, down), (2 * pp - 1 - r, up)
        phases = (own, other) if r < pp // 2 else (other, own)
        ranks.append(dual_program(pp // 2, min(r, pp - 1 - r), (phases[0][0], phases[1][0]),
                                  (phases[0][1], phases[1][1])))
    routes = (tuple(range(pp)), tuple(range(pp, 2 * pp)))
    return validate(Schedule(ranks, v_placement(pp), microbatches, DUALPIPE, routes=routes))


SPEC = FamilySpec(
    name=DUALPIPE,
    description="DualPipe (DeepSeek-V3): microbatches from both ends, 2 weight copies per rank, "
                "overlapped F/B pairs; even pp, m >= 2p",
    build=dualpipe,
    fixed_chunks=2,
    placement=Placement.V,
    split_backward=True,
    w_deferred=True,
    weight_copies=2,
    one_copy_variant=DUALPIPEV,
)
