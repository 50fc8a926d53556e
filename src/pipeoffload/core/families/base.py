"""What every schedule family declares (FamilySpec) and the argument checks they share.

Each family module exports one or more ``FamilySpec`` constants; the registry collects them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeoffload.core.errors import ConfigError
from pipeoffload.core.schedule import Schedule


@dataclass(frozen=True)
class FamilySpec:
    """A named schedule generator.

    ``build(pp, microbatches, **options)`` accepts exactly the keyword ``options`` listed;
    ``fixed_chunks`` is the stages-per-rank count of a family that has no ``chunks`` option
    (the registry accepts ``chunks`` equal to it and rejects any other value).
    ``aliases`` are extra spellings (compared after the registry's normalisation).
    """

    name: str
    description: str
    build: Callable[..., Schedule]
    options: tuple[str, ...] = ()
    fixed_chunks: int | None = None
    aliases: tuple[str, ...] = ()


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
