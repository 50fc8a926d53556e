"""Tensor classes: a chunk's saved activation split into named parts, and what a schedule does
with each part of one (stage, microbatch).

A chunk's activation (one microbatch through one stage) is the sum of its classes: the layer
input, the attention norm's output, Q / K / V, the attention output with its softmax
statistics, ... (planner/tensor_classes.py sizes them for a transformer). A schedule may say,
per (stage, microbatch), which classes its OFFLOAD / RELOAD (or FETCH) moves and which are
dropped after the forward and recomputed before the backward (``ClassChoice``); an item
without a choice moves whole, as before classes existed, so every plan made without classes
is unchanged.

Note: [class accounting] (design.md's memory accounting, per class) for an item whose choice
moves a share ``moved`` and recomputes a share ``dropped`` of its activation:
- ``1 - moved - dropped`` is resident from its F's start to its last backward pass's end;
- ``moved`` is resident as a whole chunk's activation is under offload (streamed out while the
  F runs, freed when its OFFLOAD ends, held again from its RELOAD's start, or read on use by
  FETCH); without an OFFLOAD it is simply kept;
- ``dropped`` is freed as the F ends (counted as the forward's working memory, not as
  activation) and is resident again from the start of its first backward pass, which re-runs
  the forward work that made it: that pass takes ``recompute_time`` of its stage's F time
  longer (the steps that make the classes it recomputes). The runtime does just that: it
  replays those steps at the start of the first backward pass and frees their results after
  the last (runtime/class_recompute.py, Note: [class recompute]).
OFFLOAD / RELOAD / FETCH of the item take ``moved`` of a whole chunk's copy time.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeoffload.core.errors import ScheduleError

_EPS = 1e-9


@dataclass(frozen=True)
class TensorClass:
    """One named part of a chunk's saved activation.

    ``share``: its bytes over the chunk's (0..1). ``recompute_time``: the forward time that
    recomputes it from the class before it in the forward (the work between the two), as a
    share of the chunk's F time; None when it cannot be recomputed (the layer input: the rest
    is recomputed from it). Recomputing several classes runs each one's step once, in forward
    order (a recomputed predecessor is there by then): it costs the sum of their times, as
    Megatron's selective recompute of modules does."""

    name: str
    share: float
    recompute_time: float | None = None

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ScheduleError(f"a tensor class needs a name, got {self.name!r}")
        if not 0.0 <= self.share <= 1.0 + _EPS:
            raise ScheduleError(f"tensor class {self.name!r}: share must be in 0..1, "
                                f"got {self.share!r}")
        if self.recompute_time is not None and self.recompute_time < 0:
            raise ScheduleError(f"tensor class {self.name!r}: recompute_time must be >= 0, "
                                f"got {self.recompute_time!r}")


@dataclass(frozen=True)
class ClassChoice:
    """What one (stage, microbatch) does with its classes: ``offloaded`` move with its
    OFFLOAD / RELOAD (or FETCH), ``recomputed`` are dropped after its F and recomputed before
    its backward, the rest stay (Note: [class accounting])."""

    offloaded: tuple[TensorClass, ...] = ()
    recomputed: tuple[TensorClass, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "offloaded", tuple(self.offloaded))
        object.__setattr__(self, "recomputed", tuple(self.recomputed))
        names = [c.name for c in (*self.offloaded, *self.recomputed)]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ScheduleError(f"tensor class {twice[0]!r} is chosen twice; a class is kept, "
                                "offloaded or recomputed, one of them")
        for tensor_class in self.recomputed:
            if tensor_class.recompute_time is None:
                raise ScheduleError(f"tensor class {tensor_class.name!r} cannot be recomputed "
                                    "(it is what the others are recomputed from)")
        if self.moved + self.dropped > 1.0 + _EPS:
            raise ScheduleError(f"the chosen classes {names} add up to more than the chunk "
                                f"({self.moved + self.dropped:g})")

    @property
    def moved(self) -> float:
        """The share of the item's activation its transfers move."""
        return sum(c.share for c in self.offloaded)

    @property
    def dropped(self) -> float:
        """The share dropped after the forward and recomputed before the backward."""
        return sum(c.share for c in self.recomputed)

    @property
    def recompute_time(self) -> float:
        """The extra forward time of the first backward pass, as a share of the F time: each
        recomputed class's step."""
        return sum(c.recompute_time or 0.0 for c in self.recomputed)

    @property
    def names(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(offloaded names, recomputed names): what the runtime reads."""
        return tuple(c.name for c in self.offloaded), tuple(c.name for c in self.recomputed)


Shares = dict[tuple[int, int], tuple[float, float]]
"""(stage, microbatch) -> (moved, dropped) of the items with a choice: what the simulator's
memory accounting reads (Note: [class accounting])."""
