"""The registry of schedule names: one constant mapping from canonical name to family.

Names are matched case-insensitively with hyphens, underscores and spaces optional, and
torch.distributed.pipelining's spellings work too (``1F1B``, ``Interleaved1F1B``,
``ZBVZeroBubble``, ``GPipe``, with or without torch's ``Schedule`` class prefix).
Offload is planned on top of a built schedule by ``pipeoffload.api.build_schedule``; this
module only builds the compute schedule.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

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
from pipeoffload.core.families.base import FamilySpec
from pipeoffload.core.schedule import Schedule

FAMILIES: MappingProxyType[str, FamilySpec] = MappingProxyType({
    spec.name: spec
    for spec in (
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
    )
})


def normalise(name: str) -> str:
    """The key names are compared by: lower case, without hyphens, underscores and spaces."""
    return "".join(ch for ch in name.strip().lower() if ch not in "-_ ")


def _keys() -> MappingProxyType[str, str]:
    keys: dict[str, str] = {}
    for canonical, spec in FAMILIES.items():
        for spelling in (canonical, *spec.aliases):
            key = normalise(spelling)
            if keys.setdefault(key, canonical) != canonical:
                raise AssertionError(f"schedule alias {spelling!r} is claimed twice")
    return MappingProxyType(keys)


_KEYS = _keys()
_TORCH_PREFIX = "schedule"


def canonical_name(name: str, also: Sequence[str] = ()) -> str:
    """The canonical name for any accepted spelling; ConfigError (with the closest match) else.

    ``also``: names a caller accepts on top of the families (e.g. the api's presets po-h and
    po-f); they are listed and suggested in the error, never returned."""
    if not isinstance(name, str):
        raise ConfigError(f"schedule name must be a string, got {name!r}")
    key = normalise(name)
    if key not in _KEYS and key.startswith(_TORCH_PREFIX):
        key = key[len(_TORCH_PREFIX):]
    if key in _KEYS:
        return _KEYS[key]
    known = {**_KEYS, **{normalise(extra): extra for extra in also}}
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.5)
    hint = f" (did you mean {known[close[0]]!r}?)" if close else ""
    raise ConfigError(f"unknown schedule {name!r}{hint}; known schedules: "
                      f"{', '.join([*FAMILIES, *also])} (`pipeoffload schedules` lists them)")


def schedule_names() -> list[tuple[str, str]]:
    """Every canonical schedule name with a one-line description."""
    return [(name, spec.description) for name, spec in FAMILIES.items()]


def build_schedule(name: str, pp: int, microbatches: int, **options: Any) -> Schedule:
    """Build the named schedule for ``pp`` ranks and ``microbatches`` microbatches.

    ``options`` use the CLI's names with underscores (``chunks=``, ``group_size=``); an option
    the schedule does not have raises ConfigError instead of being ignored.
    """
    spec = FAMILIES[canonical_name(name)]
    options = dict(options)
    if spec.fixed_chunks is not None and "chunks" in options:
        chunks = options.pop("chunks")
        if chunks != spec.fixed_chunks:
            others = [n for n, s in FAMILIES.items() if "chunks" in s.options]
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
