"""Time and memory of a `limit:` offload plan at the largest size `simulate` accepts.

Run: python benchmarks/limit_plan.py [--pp 64] [--microbatches 1024] [--chunks 4] [--limit 2]
Runs `pipeoffload simulate --schedule grouped-interleaved ... --offload limit:X --allow-stall
--json` in a child process and prints one line: the command, its wall and CPU seconds (user +
system, less sensitive than wall time to other jobs on the machine) and its peak resident
memory (the child's ru_maxrss), and the plan's largest peak. The target from issue 25: under
30 s and under 2 GiB at p = 64, m = 1024, v = 4, limit:2.
"""

from __future__ import annotations

import argparse
import json
import resource
import shlex
import subprocess
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=1024)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--limit", default="2")
    args = parser.parse_args()
    command = ["pipeoffload", "simulate", "--schedule", "grouped-interleaved",
               "--pp", str(args.pp), "--microbatches", str(args.microbatches),
               "--chunks", str(args.chunks), "--offload", f"limit:{args.limit}",
               "--allow-stall", "--json"]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pipeoffload.cli", *command[1:]],
                          capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{shlex.join(command)} exited {done.returncode}:\n{done.stderr}")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = usage.ru_utime + usage.ru_stime
    rss_mib = usage.ru_maxrss / 1024  # KiB on Linux
    result = json.loads(done.stdout)
    print(f"{shlex.join(command)}\n"
          f"wall {wall:.1f} s, cpu {cpu:.1f} s, max rss {rss_mib:.0f} MiB, "
          f"peak {max(result['peak_activation']):g} M_a (limit {args.limit}), "
          f"offloaded {result['offloaded_fraction']:.1%}")


if __name__ == "__main__":
    main()
