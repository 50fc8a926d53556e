"""Cutting a model made of a run of blocks into a schedule's stages: ``split_blocks``.

A model that is ``first -> block_0 -> ... -> block_{n-1} -> last`` (an embedding, repeated
layers, a head) becomes one ``nn.Sequential`` per stage: contiguous blocks, balanced to within
one block (earlier stages take the extra ones), ``first`` on stage 0 and ``last`` on the last
stage. The stages hold the given modules (nothing is copied), so the model's own parameters are
the ones trained; under torch.distributed each rank asks only for its stages (``rank=``).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from pipeoffload.checks import check_instance, check_number
from pipeoffload.core.schedule import Schedule
from pipeoffload.errors import ConfigError


def balanced_ranges(num_blocks: int, num_stages: int, what: str = "blocks") -> list[range]:
    """Contiguous block ranges per stage, sizes differing by at most one (earlier stages get
    the extra blocks; the last stage also carries the head)."""
    check_number(f"the number of {what}", num_blocks, minimum=0, integer=True)
    check_number("num_stages", num_stages, minimum=1, integer=True)
    if num_stages < 1:
        raise ConfigError(f"num_stages must be >= 1, got {num_stages}")
    if num_blocks < num_stages:
        raise ConfigError(f"the model has {num_blocks} {what} but the schedule has "
                          f"{num_stages} stages; every stage needs at least one (use a "
                          "schedule with fewer stages: smaller pp or chunks)")
    base, extra = divmod(num_blocks, num_stages)
    bounds = [0]
    for stage in range(num_stages):
        bounds.append(bounds[-1] + base + (stage < extra))
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def split_blocks(blocks: nn.Sequential | nn.ModuleList | Iterable[nn.Module], schedule: Schedule,
                 rank: int | None = None, *, first: nn.Module | None = None,
                 last: nn.Module | None = None) -> dict[int, nn.Sequential]:
    """``{stage: nn.Sequential}`` for ``schedule``'s stages (all, or those on ``rank``).

    Stage s runs its blocks in order, after ``first`` on stage 0 and before ``last`` on the
    last stage; each block takes one tensor and returns one (the stage contract,
    docs/runtime.md). Pass ``Pipeline(split_blocks(...), schedule, loss_fn)``.
    """
    check_instance("split_blocks: schedule", schedule, Schedule, "a Schedule")
    blocks = list(blocks)
    if not all(isinstance(b, nn.Module) for b in blocks):
        raise ConfigError("split_blocks takes nn.Modules (an nn.Sequential, an nn.ModuleList "
                          "or a list of modules)")
    if rank is not None and not 0 <= rank < schedule.num_ranks:
        raise ConfigError(f"rank={rank}, but schedule {schedule.name!r} has ranks "
                          f"0..{schedule.num_ranks - 1}")
    if schedule.routes:
        raise ConfigError(f"schedule {schedule.name!r} sends microbatches along several routes "
                          "whose stages share weights (DualPipe's two copies); split_blocks "
                          "makes one copy: use dualpipev or another schedule")
    ranges = balanced_ranges(len(blocks), schedule.num_stages)
    wanted = range(schedule.num_stages) if rank is None else schedule.stages_on_rank(rank)
    final = schedule.num_stages - 1
    stages = {}
    for s in wanted:
        parts = [blocks[i] for i in ranges[s]]
        if s == 0 and first is not None:
            parts.insert(0, first)
        if s == final and last is not None:
            parts.append(last)
        stages[s] = nn.Sequential(*parts)
    return stages
