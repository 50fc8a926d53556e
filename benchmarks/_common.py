"""Helpers shared by the benchmark scripts: the machine line, spreads and plain-text tables.

Benchmarks print; nothing here times or asserts anything.
"""

from __future__ import annotations

import math
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Sequence


def machine_summary() -> str:
    """One line naming what the numbers were measured on (CPU count, torch, Python, OS)."""
    import torch

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cuda = (torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")
    return (f"machine: {os.cpu_count()} CPUs ({usable} usable), {platform.machine()}, "
            f"torch {torch.__version__}, Python {platform.python_version()}, "
            f"{platform.system()} {platform.release()}, {cuda}")


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max) of ``values``."""
    if not values:
        raise ValueError("spread() of no values; run at least one repetition")
    return statistics.median(values), min(values), max(values)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (readable as plain text too); floats keep the caller's formatting."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def mib(nbytes: float) -> str:
    """Bytes as MiB with two decimals."""
    return f"{nbytes / 2**20:.2f}"


def free_port() -> int:
    """A TCP port that is free now, for a local torch.distributed rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def best_time(fn: Callable[[], object], repeat: int) -> float:
    """Fastest of ``repeat`` wall-clock runs of ``fn``, in seconds."""
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def union(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same points as ``intervals``."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def intersection(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Total length covered by both ``a`` and ``b`` (each sorted and disjoint, see union)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total
