"""Interleaved 1F1B (Megatron-LM's virtual pipeline), v chunks per rank, loop placement.

Follows Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC 2021) as Megatron-core implements it. Rank r holds stages r, r+p, ...; it
walks a table of (chunk, microbatch) in groups of p microbatches: for each group, chunk 0 of
every microbatch in the group, then chunk 1, ...; backwards walk the same table with the chunks
reversed. Rank r runs w_r = 2(p-r-1) + (v-1)p warm-up forwards (capped at v*m), then
alternates one forward and one full backward, then drains the backwards. Bubble about 1/v of
1F1B's; rank 0 holds w_0 + 1 chunk activations at its peak.
When m is not a multiple of p we follow torch.distributed.pipelining's Interleaved1F1B: groups
of m / (m // p) microbatches (one group of m when m < p), warm-up 2(p-r-1) + (v-1) times that
group size; m that do not split into such groups are rejected (Megatron rejects every m that
is not a multiple of p; a shorter last group, as in Megatron-core's table, can deadlock).
Where we differ from Megatron: for m == p Megatron runs all forwards first; we keep the formula
above, which is valid and holds less memory. v = 1 is torch's Interleaved1F1B over one stage per
rank: 1F1B with a warm-up of 2(p-r-1) forwards instead of p-r-1 (more held, no shorter bubble;
``1f1b`` is the schedule for one stage per rank).
"""

from __future__ import annotations

from pipeoffload.core.actions import Action, B, F
from pipeoffload.core.errors import ConfigError
from pipeoffload.core.families.base import FamilySpec, PlannerHints, check_common, check_int
from pipeoffload.core.schedule import Schedule, loop_placement
from pipeoffload.core.validate import validate

NAME = "interleaved-1f1b"


def chunk_table(microbatches: int, chunks: int, group: int) -> list[tuple[int, int]]:
    """The (chunk, microbatch) order of the forwards: groups of ``group`` microbatches, each
    group through chunk 0, then chunk 1, ..."""
    table: list[tuple[int, int]] = []
    for first in range(0, microbatches, group):
        members = range(first, min(first + group, microbatches))
        table.extend((chunk, mb) for chunk in range(chunks) for mb in members)
    return table


def _rank_order(pp: int, rank: int, chunks: int, table: list[tuple[int, int]],
                warmup: int) -> list[Action]:
    """``warmup`` forwards, then one forward and one backward in turn, then the remaining
    backwards; backwards walk ``table`` with the chunks reversed."""
    fwd = [F(chunk * pp + rank, mb) for chunk, mb in table]
    bwd = [B((chunks - 1 - chunk) * pp + rank, mb) for chunk, mb in table]
    warm = min(warmup, len(table))
    order = fwd[:warm]
    for k in range(len(table) - warm):
        order += [fwd[warm + k], bwd[k]]
    return order + bwd[len(table) - warm:]


def round_group(name: str, pp: int, microbatches: int) -> int:
    """The microbatches per round of torch's interleaved schedules, ``m / max(1, m // p)``;
    ConfigError naming the nearest counts that work when ``m`` does not split into such rounds."""
    rounds = max(1, microbatches // pp)
    if microbatches % rounds:
        fits = [m for m in range(max(1, microbatches - pp), microbatches + pp + 1)
                if m % max(1, m // pp) == 0]
        below = max((m for m in fits if m < microbatches), default=None)
        above = min(m for m in fits if m > microbatches)
        raise ConfigError(
            f"{name}: microbatches={microbatches} does not split into equal groups of about "
            f"pp={pp} ({microbatches // rounds} or {microbatches // rounds + 1}); use a multiple "
            f"of pp, or the nearest counts that work ({below}, {above}), or grouped-interleaved"
        )
    return microbatches // rounds


def interleaved_1f1b(pp: int, microbatches: int, chunks: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B with ``chunks`` stages per rank."""
    check_common(NAME, pp, microbatches)
    check_int("chunks", chunks, 1, NAME)
    group = round_group(NAME, pp, microbatches)
    table = chunk_table(microbatches, chunks, group)
    ranks = [_rank_order(pp, r, chunks, table, 2 * (pp - r - 1) + (chunks - 1) * group)
             for r in range(pp)]
    return validate(Schedule(ranks, loop_placement(pp, chunks), microbatches, NAME))


def groups_of_pp(pp: int, microbatches: int) -> bool:
    """Megatron's rule, which the planner keeps to: microbatches in whole groups of pp."""
    return microbatches % pp == 0


SPEC = FamilySpec(
    name=NAME,
    description="Megatron's interleaved 1F1B: v chunks per rank (loop), ~1/v of 1F1B's bubble",
    build=interleaved_1f1b,
    options=("chunks",),
    aliases=("interleaved", "interleaved1f1b", "virtualpipeline", "megatroninterleaved"),
    planner=PlannerHints(by_default=True, microbatches=groups_of_pp),
)
