"""Pausing Python's cyclic garbage collector around work that allocates many small objects.

A simulation or an offload plan at p = 32, m = 256 makes ~10^6 tuples and no reference cycles,
and so do numbering a schedule (core/deps.py) and building one (core/registry.py),
while the live timelines (10^5 objects) make every full collection long: the collector would
rescan them again and again (a third of the planner's time, measured in docs/offload.md).
Reference counting still frees everything as usual.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Disable the cyclic collector inside the block, restoring its previous state after."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
