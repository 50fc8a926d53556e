"""The registry of schedule names: families by canonical name, and PipeOffload's presets.

Names are matched case-insensitively with hyphens, underscores and spaces optional, and
torch.distributed.pipelining's spellings work too (``1F1B``, ``Interleaved1F1B``,
``ZBVZeroBubble``, ``GPipe``, with or without torch's ``Schedule`` class prefix).
Offload is planned on top of a built schedule by ``pipeoffload.api.build_schedule``; this
module only builds the compute schedule.

A ``Registry`` is an immutable set of families; ``REGISTRY`` holds the library's, and the
module's functions use it. A new family is one module exporting a ``FamilySpec`` and one line
in ``REGISTRY``'s list: every layer that needs to know something about it (placement, split
backward, chunks, how the planner searches it) reads its spec.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from types import MappingProxyType
from typing import Any

from pipeoffload.checks import check_instance
from pipeoffload.core.collector import cyclic_gc_paused
from pipeoffload.core.errors import ConfigError
from pipeoffload.core.families import (
    dualpipe,
    dualpipev,
    gpipe,
    grouped,
    interleaved,
    interleaved_zb,
    looped_bfs,
    one_f_one_b,
    torch_zbv,
    v_shape,
    zero_bubble,
)
from pipeoffload.core.families.base import FamilySpec, PresetSpec
from pipeoffload.core.schedule import Schedule

_TORCH_PREFIX = "schedule"


def normalise(name: str) -> str:
    """The key names are compared by: lower case, without hyphens, underscores and spaces."""
    check_instance("schedule name", name, str, "a str (schedule_names() lists them)")
    return "".join(ch for ch in name.strip().lower() if ch not in "-_ ")


class Registry:
    """Schedule families by canonical name, with every accepted spelling.

    ``families`` in the order given (the order ``schedule_names`` lists them and the planner
    searches its defaults in)."""

    __slots__ = ("_families", "_keys")

    def __init__(self, families: Iterable[FamilySpec]) -> None:
        by_name: dict[str, FamilySpec] = {}
        keys: dict[str, str] = {}
        for spec in families:
            if by_name.setdefault(spec.name, spec) is not spec:
                raise ConfigError(f"schedule family {spec.name!r} is registered twice")
            for spelling in (spec.name, *spec.aliases):
                if keys.setdefault(normalise(spelling), spec.name) != spec.name:
                    raise ConfigError(f"schedule alias {spelling!r} is claimed twice")
        self._families = MappingProxyType(by_name)
        self._keys = MappingProxyType(keys)

    @property
    def families(self) -> MappingProxyType[str, FamilySpec]:
        """Every family by canonical name."""
        return self._families

    def canonical_name(self, name: str, also: Sequence[str] = ()) -> str:
        """The canonical name for any accepted spelling; ConfigError (with the closest match)
        else. ``also``: names a caller accepts on top of the families (e.g. the presets po-h
        and po-f); they are listed and suggested in the error, never returned."""
        if not isinstance(name, str):
            raise ConfigError(f"schedule name must be a string, got {name!r}")
        key = normalise(name)
        if key not in self._keys and key.startswith(_TORCH_PREFIX):
            key = key[len(_TORCH_PREFIX):]
        if key in self._keys:
            return self._keys[key]
        known = {**self._keys, **{normalise(extra): extra for extra in also}}
        close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.5)
        hint = f" (did you mean {known[close[0]]!r}?)" if close else ""
        raise ConfigError(f"unknown schedule {name!r}{hint}; known schedules: "
                          f"{', '.join([*self._families, *also])} (`pipeoffload schedules` "
                          f"lists them)")

    def family(self, name: str) -> FamilySpec:
        """The family called ``name`` (any accepted spelling); ConfigError else."""
        spec = self._families.get(name)
        return spec if spec is not None else self._families[self.canonical_name(name)]

    def schedule_names(self) -> list[tuple[str, str]]:
        """Every canonical schedule name with a one-line description."""
        return [(name, spec.description) for name, spec in self._families.items()]

    def build_schedule(self, name: str, pp: int, microbatches: int, **options: Any) -> Schedule:
        """Build the named schedule for ``pp`` ranks and ``microbatches`` microbatches.

        ``options`` use the CLI's names with underscores (``chunks=``, ``group_size=``); an
        option the schedule does not have raises ConfigError instead of being ignored.
        """
        spec = self.family(name)
        options = dict(options)
        if spec.fixed_chunks is not None and "chunks" in options:
            chunks = options.pop("chunks")
            if chunks != spec.fixed_chunks:
                others = [n for n, s in self._families.items() if "chunks" in s.options]
                raise ConfigError(
                    f"{spec.name} runs exactly {spec.fixed_chunks} stage(s) per rank, got "
                    f"chunks={chunks!r}; drop chunks, or pick a schedule with a chunks option "
                    f"({', '.join(others)})"
                )
        unknown = sorted(set(options) - set(spec.options))
        if unknown:
            accepted = ", ".join(spec.options) if spec.options else "none"
            raise ConfigError(
                f"{spec.name} has no option {', '.join(unknown)} (it would have no effect); "
                f"its options: {accepted}"
            )
        with cyclic_gc_paused():  # 10^5 actions, no cycles (core/collector.py)
            return spec.build(pp, microbatches, **options)


REGISTRY = Registry((
    gpipe.SPEC,
    one_f_one_b.SPEC,
    interleaved.SPEC,
    zero_bubble.SPEC_H1,
    zero_bubble.SPEC_H2,
    v_shape.SPEC_ZBV,
    v_shape.SPEC_V_HALF,
    v_shape.SPEC_V_MIN,
    grouped.SPEC,
    dualpipe.SPEC,
    dualpipev.SPEC,
    interleaved_zb.SPEC,
    looped_bfs.SPEC,
    torch_zbv.SPEC,
))
FAMILIES: MappingProxyType[str, FamilySpec] = REGISTRY.families

#: PipeOffload's presets by name: a family at fixed options with an offload target.
PRESETS: MappingProxyType[str, PresetSpec] = MappingProxyType({
    preset.name: preset for preset in (grouped.PO_H, grouped.PO_F)
})


def preset(name: str) -> PresetSpec | None:
    """The preset ``name`` spells (compared as schedule names are), or None."""
    key = normalise(name)
    return next((p for p in PRESETS.values() if normalise(p.name) == key), None)


def canonical_name(name: str, also: Sequence[str] = ()) -> str:
    """``REGISTRY.canonical_name``."""
    return REGISTRY.canonical_name(name, also)


def schedule_names() -> list[tuple[str, str]]:
    """Every canonical schedule name of ``REGISTRY`` with a one-line description."""
    return REGISTRY.schedule_names()


def build_schedule(name: str, pp: int, microbatches: int, **options: Any) -> Schedule:
    """``REGISTRY.build_schedule``: the named schedule for ``pp`` ranks and ``microbatches``."""
    return REGISTRY.build_schedule(name, pp, microbatches, **options)
