"""What to offload: the target a user asks for, parsed from ``none``, ``all``, ``chunks:K``,
``fraction:X``, ``limit:X`` (M_a units) or ``limit:XGiB`` / ``limit:XMB`` (bytes), ``given``
(keep the transfers the schedule already has, e.g. a planned schedule loaded from CSV), or
``recompute-chunks:K+all`` (recompute some chunks, offload the rest)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from pipeoffload.errors import ConfigError


class TargetKind(str, Enum):
    NONE = "none"
    ALL = "all"  # every activation whose transfers hide behind compute
    CHUNKS = "chunks"  # the K longest-lived stages (chunks) of every rank
    FRACTION = "fraction"  # this fraction of each rank's activation bytes, longest-lived first
    LIMIT = "limit"  # the least offload that brings every rank's peak to this value
    GIVEN = "given"  # the schedule's own transfers, as they are
    # The K longest-lived stages (chunks) of every rank recomputed (RECOMPUTE actions,
    # offload/recompute.py), then every other activation offloaded as ALL does; written
    # ``recompute-chunks:K+all``. The report's "before" is the recomputed schedule's.
    RECOMPUTE_CHUNKS_THEN_ALL = "recompute-chunks"


_BYTE_UNITS = {"b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20,
               "gib": 2**30, "tib": 2**40}
_SPEC_HELP = ("use none, all, chunks:K, fraction:X (0..1), limit:X (M_a units), limit:XGiB, "
              "recompute-chunks:K+all or given")
_RECOMPUTE_FORM = "recompute-chunks:K+all"


@dataclass(frozen=True)
class OffloadTarget:
    """A parsed offload target. For LIMIT, ``value`` is in M_a units unless ``in_bytes``.

    ``allow_stall``: keep transfers that cannot hide behind compute (their stall is reported).
    Without it, ALL and CHUNKS skip them; FRACTION and LIMIT use them only when the hiding ones
    cannot meet the target.
    """

    kind: TargetKind
    value: float = 0.0
    in_bytes: bool = False
    allow_stall: bool = False

    def __str__(self) -> str:
        if self.kind in (TargetKind.NONE, TargetKind.ALL, TargetKind.GIVEN):
            return self.kind.value
        if self.kind is TargetKind.CHUNKS:
            return f"chunks:{int(self.value)}"
        if self.kind is TargetKind.RECOMPUTE_CHUNKS_THEN_ALL:
            return f"{self.kind.value}:{int(self.value)}+all"
        if self.in_bytes:
            return f"{self.kind.value}:{self.value:.0f}B"
        return f"{self.kind.value}:{self.value:g}"

    @property
    def demands(self) -> bool:
        """Whether the target must be met even at the cost of stalls."""
        return self.allow_stall or self.kind in (TargetKind.FRACTION, TargetKind.LIMIT)


def parse_target(spec: str | OffloadTarget | None, *, allow_stall: bool = False) -> OffloadTarget:
    """Parse an offload spec; a bad spec raises ConfigError naming it and the accepted forms."""
    if isinstance(spec, OffloadTarget):
        return spec
    if spec is None:
        return OffloadTarget(TargetKind.NONE)
    if not isinstance(spec, str):
        raise ConfigError(f"offload target must be a string such as 'all', got {spec!r}")
    text = spec.strip().lower()
    if not text:
        raise ConfigError(f"offload target {spec!r} is empty: {_SPEC_HELP}")
    if text in ("none", "all", "given"):
        return OffloadTarget(TargetKind(text), allow_stall=allow_stall)
    name, _, arg = text.partition(":")
    try:
        kind = TargetKind(name.strip())
    except ValueError:
        raise ConfigError(f"unknown offload target {spec!r}: {_SPEC_HELP}") from None
    arg = arg.strip()
    if kind in (TargetKind.NONE, TargetKind.ALL, TargetKind.GIVEN):
        raise ConfigError(f"offload target {spec!r}: {kind.value} takes no value; write "
                          f"{kind.value!r}")
    if not arg:
        raise ConfigError(f"offload target {spec!r} needs a value: {_SPEC_HELP}")
    if kind is TargetKind.CHUNKS:
        # str.isdigit() also accepts superscripts and other digits that int() refuses.
        if not re.fullmatch(r"[0-9]+", arg) or int(arg) < 1:
            raise ConfigError(f"offload target {spec!r}: K must be a whole number >= 1 "
                              "(digits 0-9)")
        return OffloadTarget(kind, float(arg), allow_stall=allow_stall)
    if kind is TargetKind.RECOMPUTE_CHUNKS_THEN_ALL:
        match = re.fullmatch(r"([0-9]+)\s*\+\s*all", arg)
        if match is None or int(match.group(1)) < 1:
            raise ConfigError(f"offload target {spec!r}: write {_RECOMPUTE_FORM}, K a whole "
                              "number >= 1 (each rank's K longest-lived chunks recomputed, "
                              "every other activation offloaded)")
        return OffloadTarget(kind, float(match.group(1)), allow_stall=allow_stall)
    match = re.fullmatch(r"([-+]?[0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-z]*)", arg)
    if match is None:
        raise ConfigError(f"offload target {spec!r}: {arg!r} is not a number; {_SPEC_HELP}")
    value, unit = float(match.group(1)), match.group(2)
    if kind is TargetKind.FRACTION:
        if unit or not 0.0 <= value <= 1.0:
            raise ConfigError(f"offload target {spec!r}: the fraction must be in 0..1")
        return OffloadTarget(kind, value, allow_stall=allow_stall)
    if unit and unit not in _BYTE_UNITS:
        raise ConfigError(f"offload target {spec!r}: unknown unit {unit!r}; "
                          f"use one of {', '.join(_BYTE_UNITS)} or none for M_a units")
    scale = _BYTE_UNITS[unit] if unit else 1.0
    if not 0.0 <= value * scale < float("inf"):
        raise ConfigError(f"offload target {spec!r}: the limit must be a finite number >= 0"
                          f"{' (in bytes it overflows)' if value * scale == float('inf') else ''}")
    return OffloadTarget(kind, value * scale, in_bytes=bool(unit), allow_stall=allow_stall)
