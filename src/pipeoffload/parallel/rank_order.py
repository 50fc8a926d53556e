"""The order of a job's parallel dimensions in its global ranks, as data.

Note: [rank order] A job's processes form a mesh over the dimensions "pp", "dp", "cp" and
"tp"; ``RankOrder.dims`` lists them outermost first, so the last one changes fastest with
the global rank and its groups are neighbouring ranks (inside a node with torchrun's
node-major numbering). The default, ("pp", "dp", "cp", "tp"), puts tensor-parallel peers
(collectives in every layer) next to each other, then the context-parallel peers (one K/V
all-gather per layer), then the data-parallel replicas (a gradient all-reduce per step), and
the pipeline's point-to-point hops (light) outermost; with cp = 1 it is the (pp, dp, tp) layout
of parallel/topology.py. Which dimension stays inside a node is the planner's choice
(``--rank-order``), not a constant here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pipeoffload.errors import ConfigError

DIMS = ("pp", "dp", "cp", "tp")
DEFAULT_ORDER = DIMS


def parse_order(text: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """``"pp,dp,cp,tp"`` (or a tuple of the names) as a checked order; None: the default."""
    if text is None:
        return DEFAULT_ORDER
    dims = tuple(d.strip() for d in text.split(",")) if isinstance(text, str) else tuple(text)
    if sorted(dims) != sorted(DIMS):
        raise ConfigError(f"rank order {','.join(dims)!r}: name each of {', '.join(DIMS)} once, "
                          "outermost first (e.g. pp,dp,cp,tp)")
    return dims


@dataclass(frozen=True)
class RankOrder:
    """Sizes of the four dimensions and their order (Note: [rank order])."""

    sizes: Mapping[str, int]
    dims: tuple[str, ...] = DEFAULT_ORDER

    def __post_init__(self) -> None:
        parse_order(self.dims)
        bad = [d for d in DIMS if not isinstance(self.sizes.get(d, 1), int)
               or self.sizes.get(d, 1) < 1]
        if bad:
            raise ConfigError(f"rank order: {bad[0]} must be a positive int, got "
                              f"{self.sizes.get(bad[0])!r}")

    def size(self, dim: str) -> int:
        return int(self.sizes.get(dim, 1))

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh's shape in ``dims`` order (init_device_mesh)."""
        return tuple(self.size(d) for d in self.dims)

    @property
    def world_size(self) -> int:
        total = 1
        for d in DIMS:
            total *= self.size(d)
        return total

    def index(self, rank: int, dim: str) -> int:
        """Global rank ``rank``'s coordinate along ``dim``."""
        stride = 1
        for d in reversed(self.dims):
            if d == dim:
                return (rank // stride) % self.size(d)
            stride *= self.size(d)
        raise ConfigError(f"rank order: no dimension {dim!r}; choose one of {', '.join(DIMS)}")

    def rank(self, **coords: int) -> int:
        """The global rank at ``coords`` (a missing dimension: 0)."""
        unknown = set(coords) - set(DIMS)
        if unknown:
            raise ConfigError(f"rank order: no dimension {sorted(unknown)[0]!r}; choose one of "
                              f"{', '.join(DIMS)}")
        rank = 0
        for d in self.dims:
            rank = rank * self.size(d) + coords.get(d, 0)
        return rank

    def group_ranks(self, rank: int, *dims: str) -> list[int]:
        """The global ranks that share ``rank``'s coordinates except along ``dims``, in
        order of those coordinates (the group of ``dims`` that ``rank`` is in)."""
        base = {d: self.index(rank, d) for d in DIMS if d not in dims}
        combos: list[dict[str, int]] = [{}]
        for d in dims:
            combos = [{**c, d: i} for c in combos for i in range(self.size(d))]
        return [self.rank(**base, **c) for c in combos]

    def all_groups(self, *dims: str) -> list[list[int]]:
        """Every group of ``dims`` (each once, by its lowest rank)."""
        seen: dict[int, list[int]] = {}
        for r in range(self.world_size):
            ranks = self.group_ranks(r, *dims)
            seen.setdefault(min(ranks), ranks)
        return [seen[k] for k in sorted(seen)]
