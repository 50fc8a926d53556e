"""The cyclic-collector pause lives in core/collector.py (numbering and building use it too);
re-exported here for the simulator's callers."""

from pipeoffload.core.collector import cyclic_gc_paused

__all__ = ["cyclic_gc_paused"]
