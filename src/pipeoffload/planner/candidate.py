"""What the planner chooses for one configuration: a ``Candidate``.

A candidate names its schedule by the registry's canonical name; what the planner needs to know
about that schedule (placement, split backward, chunks) it reads from the family's
``FamilySpec`` (core/families/base.py), never from the name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeoffload.core.families.base import FamilySpec, PresetSpec
from pipeoffload.core.registry import PRESETS, REGISTRY
from pipeoffload.planner.costing import DEFAULT_FRAMEWORK, Framework, Layout
from pipeoffload.planner.transformer import Recompute


@dataclass(frozen=True)
class Candidate:
    """Everything the planner chooses. ``schedule`` is a canonical registry name and
    ``chunks`` its stages per rank; ``group_size`` is set for a family with that option only;
    ``offload`` is an offload target spec; ``cp`` the context-parallel degree
    (planner/context.py)."""

    schedule: str
    dp: int
    tp: int
    pp: int
    chunks: int
    micro_batch: int
    microbatches: int
    recompute: Recompute = Recompute.LGD
    offload: str = "none"
    group_size: int | None = None
    cp: int = 1

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def layout(self) -> Layout:
        """The layout under the planner's default framework (``layout_under``)."""
        return self.layout_under(DEFAULT_FRAMEWORK)

    def layout_under(self, framework: Framework, family: FamilySpec | None = None) -> Layout:
        """DP x TP x PP, chunks and the per-GPU run of this candidate under ``framework``;
        ``family``: its schedule's declaration (default: the library registry's)."""
        family = family if family is not None else REGISTRY.family(self.schedule)
        run = framework.run(self.micro_batch, self.tp, self.recompute,
                            w_deferred=family.w_deferred, cp=self.cp)
        return Layout(self.dp, self.tp, self.pp, self.chunks, run)

    @property
    def preset(self) -> PresetSpec | None:
        """The PipeOffload preset (po-h / po-f) this candidate is, if any."""
        for preset in PRESETS.values():
            if (preset.family == self.schedule and preset.offload == self.offload
                    and preset.options(self.pp) == {"chunks": self.chunks,
                                                    "group_size": self.group_size}):
                return preset
        return None

    @property
    def display_name(self) -> str:
        """The preset's name where the candidate is one, else the schedule's."""
        preset = self.preset
        return preset.name if preset is not None else self.schedule

    def options(self) -> dict[str, int]:
        """The registry options of this schedule (the registry takes ``chunks`` from a
        family of fixed chunks too, when it is their count)."""
        options = {"chunks": self.chunks}
        if self.group_size is not None:
            options["group_size"] = self.group_size
        return options

    @property
    def schedule_shape(self) -> tuple[str, int, int, int, int | None]:
        """What the schedule family builds from: a shape that cannot be built fails for every
        variant of it."""
        return (self.schedule, self.pp, self.microbatches, self.chunks, self.group_size)

    def period(self) -> int:
        """Microbatches after which the schedule's pattern repeats (Note [reduced simulation])."""
        if self.group_size is not None:
            return math.lcm(self.pp, self.group_size)
        return self.pp
