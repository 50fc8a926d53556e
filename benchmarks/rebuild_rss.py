"""RSS of a process that builds a new Pipeline per step, as a run whose shapes change must.

Run: python benchmarks/rebuild_rss.py [--rebuilds 200]

po-f at p = 2, m = 4 in local mode (every activation offloaded) and the same schedule without
offload; sequence length fixed at 128 or rising 8 -> 256; one step per Pipeline. Prints how
much RSS grew from the 20th rebuild to the last (the first ones warm the allocators up), and
the same after ``malloc_trim`` (glibc) returns the heap's free pages. A dropped Pipeline is
freed at once (no reference cycles): what growth remains comes from the C allocator keeping
its heap's high-water mark as tensors grow, with or without offload.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys

import torch
from _common import format_table, machine_summary
from torch import nn

from pipeoffload import Pipeline, build_schedule
from pipeoffload.runtime.config import OffloadConfig, RuntimeConfig


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def stages(count: int, width: int = 64) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(count)]


def grow(offload: bool, rising: bool, rebuilds: int) -> float:
    schedule = build_schedule("po-f", pp=2, microbatches=4, offload_ratio=0.5,
                              **({} if offload else {"offload": "none"}))
    modules = stages(schedule.num_stages)
    config = RuntimeConfig(offload=OffloadConfig(min_offload_elements=0))
    start = 0.0
    for index in range(rebuilds):
        seq = 8 + (248 * index) // (rebuilds - 1) if rising else 128
        pipe = Pipeline(dict(enumerate(modules)), schedule, lambda out: out.square().mean(),
                        config=config)
        pipe.step(torch.randn(8, seq, 64))
        for module in modules:
            module.zero_grad(set_to_none=True)
        del pipe
        if index == 19:
            start = rss_mib()
    return rss_mib() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rebuilds", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gc.disable()  # what a dropped Pipeline holds must go without the cyclic collector
    libc = ctypes.CDLL("libc.so.6") if sys.platform.startswith("linux") else None
    rows = []
    for offload in (True, False):
        for rising in (False, True):
            grown = grow(offload, rising, args.rebuilds)
            trimmed = float("nan")
            if libc is not None:
                before = rss_mib()
                libc.malloc_trim(0)
                trimmed = grown - (before - rss_mib())
            rows.append(["po-f" if offload else "no offload", "8 -> 256" if rising else "128",
                         f"{grown:.1f}", f"{trimmed:.1f}"])
    print(machine_summary())
    print(format_table(["schedule", "seq", "RSS growth MiB (20th -> last)",
                        "after malloc_trim"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
