"""Actions: the atoms of a schedule, and their text form.

The text form follows torch.distributed.pipelining (``{stage}{KIND}{microbatch}``, e.g. ``2F0``,
``1SEND_F3``) so CSV files move both ways, plus our own ``OFFLOAD`` / ``RELOAD`` / ``FETCH`` /
``OFFLOAD_WAIT`` / ``RECOMPUTE`` kinds (``0OFFLOAD3``), which torch's prefix parser cannot
mistake for one of its kinds.

Note: [torch markers] torch's lowering writes UNSHARD / RESHARD (FSDP) and REDUCE_GRAD
(data-parallel gradient sync), usually without a microbatch (``0REDUCE_GRAD``); torch 2.15 adds
WAIT_REDUCE_GRAD after each REDUCE_GRAD and a WAIT_SEND_F / WAIT_SEND_B that retires each
SEND_F / SEND_B (``1WAIT_SEND_F3``). We read them as markers: kept in the schedule and written
back, placed on the stage's rank, but they cost no time in the simulator, carry no dependency, and
the runtime (which has no FSDP and waits for its own sends) skips them. Their microbatch is None
when the token has none.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import Enum
from operator import itemgetter
from typing import NamedTuple

from pipeoffload.core.errors import ParseError


class Kind(str, Enum):
    """What an action does. Values are the text tokens."""

    F = "F"  # forward
    I = "I"  # noqa: E741  backward for inputs only (zero bubble's "B")
    W = "W"  # backward for weights only
    B = "B"  # full backward (I then W in one action)
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    OFFLOAD = "OFFLOAD"  # copy this (stage, microbatch)'s saved activations to host memory
    RELOAD = "RELOAD"  # copy them back before the backward that needs them
    # From here the backward passes (I, W or B) of (stage, mb) read its saved activations from
    # host memory as they use them, tensor by tensor, and drop each copy after use: nothing of
    # it is held on the device between uses (Note: [fetch on use], sim/simulator.py).
    FETCH = "FETCH"
    OFFLOAD_WAIT = "OFFLOAD_WAIT"  # compute waits here until OFFLOAD of (stage, mb) completed
    RECOMPUTE = "RECOMPUTE"  # re-run the forward from its kept input, just before the backward
    UNSHARD = "UNSHARD"  # torch markers, see Note: [torch markers]
    RESHARD = "RESHARD"
    REDUCE_GRAD = "REDUCE_GRAD"
    WAIT_REDUCE_GRAD = "WAIT_REDUCE_GRAD"  # torch >= 2.15
    WAIT_SEND_F = "WAIT_SEND_F"  # torch >= 2.15
    WAIT_SEND_B = "WAIT_SEND_B"  # torch >= 2.15

    @property
    def is_compute(self) -> bool:
        return self in _COMPUTE

    @property
    def is_backward(self) -> bool:
        """Kinds that consume the stage's saved activations for the input gradient."""
        return self in (Kind.I, Kind.B)

    @property
    def is_transfer(self) -> bool:
        return self in (Kind.OFFLOAD, Kind.RELOAD)

    @property
    def blocks(self) -> bool:
        """Kinds that hold the rank's program until they complete (compute and waits)."""
        return self in _COMPUTE or self is Kind.OFFLOAD_WAIT

    @property
    def is_comm(self) -> bool:
        return self in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)

    @property
    def is_marker(self) -> bool:
        """torch's FSDP / data-parallel / send-wait kinds, kept but costing nothing
        (Note: [torch markers])."""
        return self in MARKER_KINDS


# Note: [hot loops] ``Kind.F`` is an enum member lookup on the class: about three times the
# cost of a module-level name on CPython 3.11. Loops that visit every action of a large
# schedule (dependencies, the simulator, the offload planner: 10^5 actions at p = 32,
# m = 256) bind the kinds they test to module names once.
_COMPUTE = frozenset({Kind.F, Kind.I, Kind.W, Kind.B, Kind.RECOMPUTE})
OFFLOAD_KINDS = frozenset({Kind.OFFLOAD, Kind.RELOAD, Kind.FETCH, Kind.OFFLOAD_WAIT})
"""The kinds the offload planner adds (and replaces when it plans again)."""
MARKER_KINDS = frozenset({Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD, Kind.WAIT_REDUCE_GRAD,
                          Kind.WAIT_SEND_F, Kind.WAIT_SEND_B})
"""torch's kinds read as markers that cost no time (Note: [torch markers])."""
_WHOLE_STAGE = MARKER_KINDS - {Kind.WAIT_SEND_F, Kind.WAIT_SEND_B}  # may omit the microbatch


class Action(NamedTuple):
    """One step of one rank: ``kind`` applied to ``microbatch`` on ``stage``."""

    stage: int
    kind: Kind
    microbatch: int  # None only for a marker written without one (Note: [torch markers])

    def __str__(self) -> str:
        microbatch = "" if self.microbatch is None else self.microbatch
        return f"{self.stage}{self.kind.value}{microbatch}"

    def __repr__(self) -> str:
        return f"Action({self})"


_ITEM = itemgetter(0, 2)  # an action's (stage, microbatch)


def positions_of(values: Sequence[object], wanted: object) -> list[int]:
    """The positions where ``values`` holds ``wanted`` (by identity: kinds and the simulator's
    steps are enum members)."""
    return [i for i, value in enumerate(values) if value is wanted]


def items_of(actions: Sequence[Action], kinds: Sequence[Kind], kind: Kind
             ) -> set[tuple[int, int]]:
    """The (stage, microbatch) of each of ``actions`` of ``kind`` (``kinds``: their kinds)."""
    return set(map(_ITEM, map(actions.__getitem__, positions_of(kinds, kind))))


# Longest kinds first so that "SEND_F" is never read as "S..." and "RECV_B" never as "RECV".
_KIND_ALTERNATIVES = "|".join(sorted((k.value for k in Kind), key=len, reverse=True))
_ACTION_RE = re.compile(rf"(\d+)({_KIND_ALTERNATIVES})(\d*)")
# Kinds torch may write that we read only inside an overlapped pair's cell (parse_cell).
_UNSUPPORTED_TORCH_KINDS = ("OVERLAP_F_B",)
_OVERLAP_SUFFIX = ")OVERLAP_F_B"


def parse_action(token: str, where: str = "") -> Action:
    """Parse one whole token such as ``3I12``; anything else raises ParseError naming it."""
    text = token.strip()
    match = _ACTION_RE.fullmatch(text)
    if match is not None and not match.group(3) and Kind(match.group(2)) not in _WHOLE_STAGE:
        match = None  # only markers that act on the whole stage may omit the microbatch
    if match is None:
        hint = "expected {stage}{KIND}{microbatch}, e.g. 0F3, 1I0, 2OFFLOAD5, 0REDUCE_GRAD"
        if any(kind in text for kind in _UNSUPPORTED_TORCH_KINDS):
            hint = ("torch's overlapped pair is read as a whole cell, "
                    "(0F3;7B2)OVERLAP_F_B, or write its F and B")
        raise ParseError(f"{where}invalid action {token!r}: {hint}")
    stage, kind, microbatch = match.groups()
    # A torch marker may be written without a microbatch (Note: [torch markers]); Action types
    # microbatch as int for every action a schedule runs.
    return Action(int(stage), Kind(kind),
                  int(microbatch) if microbatch else None)  # type: ignore[arg-type]


def parse_cell(cell: str, where: str = "") -> list[Action]:
    """The actions of one CSV cell: one action, or torch's overlapped pair
    ``(0F3;7B2)OVERLAP_F_B`` read as its passes in order (Note: [overlapped pair],
    sim/simulator.py)."""
    text = cell.strip()
    if text.startswith("(") and text.endswith(_OVERLAP_SUFFIX):
        inner = text[1:-len(_OVERLAP_SUFFIX)]
        return [parse_action(part, where) for part in inner.split(";") if part.strip()]
    return [parse_action(text, where)]


def F(stage: int, microbatch: int) -> Action:  # noqa: N802 - mirrors the text form
    return Action(stage, Kind.F, microbatch)


def I(stage: int, microbatch: int) -> Action:  # noqa: N802, E743
    return Action(stage, Kind.I, microbatch)


def W(stage: int, microbatch: int) -> Action:  # noqa: N802
    return Action(stage, Kind.W, microbatch)


def B(stage: int, microbatch: int) -> Action:  # noqa: N802
    return Action(stage, Kind.B, microbatch)
