"""What every schedule family declares (FamilySpec), PipeOffload's presets on top of a family
(PresetSpec), and the argument checks families share.

Each family module exports one or more ``FamilySpec`` constants; the registry collects them.
Everything another layer asks about a family (where its stages sit, whether its backward is
split, how many stages a rank runs, how the planner searches it) is declared here once and read
from the spec, never inferred from the family's name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from pipeoffload.core.errors import ConfigError
from pipeoffload.core.schedule import Placement, Schedule, loop_placement, v_placement


def any_count(pp: int, microbatches: int) -> bool:
    """The microbatch rule of a family the planner tries at every count it builds."""
    return True


@dataclass(frozen=True)
class PlannerHints:
    """How the planner (planner/search.py) searches a family; the defaults suit a new family.

    - ``by_default``: searched when the user names no schedules (``SearchSpace()``).
    - ``at_one_rank``: priced at pp = 1, where no schedule pipelines anything: the planner
      prices plain data-parallel training once, with the family that runs it holding one
      microbatch (1F1B) rather than with every family.
    - ``microbatches``: ``(pp, microbatches) -> bool``, the counts the planner tries, where they
      are fewer than the family builds (Megatron's interleaving takes multiples of pp).
    """

    by_default: bool = False
    at_one_rank: bool = False
    microbatches: Callable[[int, int], bool] = any_count


@dataclass(frozen=True)
class FamilySpec:
    """A named schedule generator and what it is, for the layers that use it without building.

    - ``build(pp, microbatches, **options)`` accepts exactly the keyword ``options`` listed.
    - ``fixed_chunks``: the stages per rank of a family without a ``chunks`` option (the
      registry accepts ``chunks`` equal to it and rejects any other value); a family has either
      a ``chunks`` option or ``fixed_chunks``.
    - ``aliases``: extra spellings (compared after the registry's normalisation).
    - ``placement``: where stage s sits, LOOP (rank s % p) or V (rank r holds r and 2p-1-r);
      every schedule the family builds has it (tests/test_registry.py checks).
    - ``split_backward``: the backward runs as I (input gradient) and W (weight gradient)
      actions (where the schedule chooses: DualPipe keeps some whole); else always as one B.
    - ``w_deferred``: W runs apart from its I, later (zero bubble and its kin), so what a
      framework overlaps with W (TP's reduce-scatter, planner/layer_time.py) is exposed in I.
    - ``weight_copies``: copies of the model's weights across the pipeline (Note: [routes],
      core/schedule.py): 2 for a bidirectional schedule whose two routes run every model part
      on two ranks. ``one_copy_variant`` names the family that runs the same program with one
      copy, where there is one.
    - ``planner``: how the planner searches the family (PlannerHints).
    """

    name: str
    description: str
    build: Callable[..., Schedule]
    options: tuple[str, ...] = ()
    fixed_chunks: int | None = None
    aliases: tuple[str, ...] = ()
    placement: Placement = Placement.LOOP
    split_backward: bool = False
    w_deferred: bool = False
    weight_copies: int = 1
    one_copy_variant: str | None = None
    planner: PlannerHints = PlannerHints()

    def __post_init__(self) -> None:
        if (self.fixed_chunks is None) == ("chunks" not in self.options):
            raise ConfigError(f"family {self.name!r}: declare either a chunks option or "
                              f"fixed_chunks, not both or neither")
        if self.placement is Placement.EXPLICIT:
            raise ConfigError(f"family {self.name!r}: declare LOOP or V placement; the planner "
                              "places stages before it builds a schedule")
        if self.placement is Placement.V and self.fixed_chunks != 2:
            raise ConfigError(f"family {self.name!r}: V placement runs 2 stages per rank; "
                              f"declare fixed_chunks=2")
        if self.w_deferred and not self.split_backward:
            raise ConfigError(f"family {self.name!r}: only a split backward can defer W")
        if self.weight_copies < 1:
            raise ConfigError(f"family {self.name!r}: weight_copies must be >= 1")

    def stage_to_rank(self, pp: int, chunks: int) -> tuple[int, ...]:
        """Where each stage of the family's schedules sits, for ``pp`` ranks of ``chunks``
        stages each, without building one."""
        if self.placement is Placement.V:
            return v_placement(pp)
        return loop_placement(pp, chunks)


class GroupSize(str, Enum):
    """A grouped family's group size as a function of pp: the ends of its range."""

    MIN = "min"  # ceil(pp / 2): the smallest group, the least memory
    MAX = "max"  # pp: Megatron's interleaving

    def of(self, pp: int) -> int:
        """The group size at ``pp`` ranks."""
        return math.ceil(pp / 2) if self is GroupSize.MIN else pp


@dataclass(frozen=True)
class PresetSpec:
    """A name for a grouped family at fixed chunks and group size with an offload target
    (PipeOffload's po-h and po-f, docs/method.md section 4). ``offload`` is an offload target
    spec (offload/targets.py), the default when the caller gives none."""

    name: str
    description: str
    family: str
    offload: str
    chunks: int = 2
    group_size: GroupSize = GroupSize.MIN

    def options(self, pp: int) -> dict[str, int]:
        """The family's options this preset stands for at ``pp`` ranks."""
        return {"chunks": self.chunks, "group_size": self.group_size.of(pp)}


def check_int(name: str, value: object, minimum: int, schedule: str, fix: str = "") -> int:
    """``value`` as an int >= ``minimum``, else ConfigError naming the option and the fix."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{schedule}: {name} must be an integer, got {value!r}")
    if value < minimum:
        hint = fix or f"use {name} >= {minimum}"
        raise ConfigError(f"{schedule}: {name} must be >= {minimum}, got {value}; {hint}")
    return value


def check_common(schedule: str, pp: object, microbatches: object, min_pp: int = 1) -> None:
    """The checks every family starts with: pp and microbatches are positive integers."""
    check_int("pp", pp, min_pp, schedule,
              f"{schedule} needs at least {min_pp} pipeline rank(s)")
    check_int("microbatches", microbatches, 1, schedule, "a step needs at least one microbatch")
