"""Start a command on several local processes the way torchrun does, for runs without torchrun.

Each child gets MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE and OMP_NUM_THREADS. Output is forwarded line by line: the reporting rank's
as is (so its stdout can be parsed, e.g. a final JSON line), every other rank's with a
``[rank r]`` prefix. When a child fails, the others get ``grace_s`` to notice and fail by
themselves (so each reports its own error), then the rest are terminated; the launcher returns
the first failure's exit code and says which rank failed and how.

SIGTERM and SIGHUP to the launcher are forwarded to every child, which finish their step, save
and exit with 128 + the signal's number (training/signals.py Note: [stopping on a signal]); the
launcher waits up to ``stop_timeout_s`` for them, kills what is left, and returns the same
status. Children get the launcher's pid (``PIPEOFFLOAD_LAUNCHER_PID``) so that they stop by
themselves if it dies without a word (SIGKILL).

Each process then joins the job with parallel/topology.py ``connect`` (torchrun's processes
too).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

from pipeoffload.errors import ConfigError
from pipeoffload.training.signals import (
    LAUNCHER_PID_ENV,
    STOP_SIGNALS,
    recording_signals,
    signal_name,
    stop_outcome,
    stop_status,
)


@dataclass(frozen=True)
class LaunchConfig:
    """How to start and supervise the processes.

    - ``reporting_rank``: whose output is forwarded without a prefix (None: prefix every rank).
    - ``grace_s``: after the first child fails, how long the others may run before they are
      terminated (long enough for them to hit their own P2P timeout and say so).
    - ``term_timeout_s``: after SIGTERM, how long before SIGKILL.
    - ``threads_per_process``: OMP_NUM_THREADS for each child (CPU cores are shared).
    - ``env``: extra environment variables for every child.
    - ``stop_timeout_s``: after SIGTERM / SIGHUP reached the children, how long they may take
      to finish their step and save before they are killed.
    """

    nprocs: int
    reporting_rank: int | None = 0
    grace_s: float = 30.0
    term_timeout_s: float = 5.0
    stop_timeout_s: float = 120.0
    threads_per_process: int = 1
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.nprocs < 1:
            raise ConfigError(f"LaunchConfig.nprocs must be >= 1, got {self.nprocs}")
        if (min(self.grace_s, self.term_timeout_s, self.stop_timeout_s) < 0
                or self.threads_per_process < 1):
            raise ConfigError("LaunchConfig: grace_s, term_timeout_s and stop_timeout_s must be "
                              ">= 0 and threads_per_process >= 1")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(code: int) -> str:
    """'exited with code 3' / 'was killed by SIGKILL' for a Popen return code."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def shell_code(code: int) -> int:
    """A Popen return code as a process exit status (signal n -> 128 + n, like a shell)."""
    return 128 - code if code < 0 else code


def _forward(stream: IO[bytes], out: IO[str], prefix: str, lock: threading.Lock) -> None:
    broken = False  # our own output is gone (a closed terminal): keep draining the child's
    for raw in iter(stream.readline, b""):
        if broken:
            continue
        line = raw.decode("utf-8", errors="replace")
        with lock:
            try:
                out.write(prefix + line if prefix else line)
                if not line.endswith("\n"):
                    out.write("\n")
                out.flush()
            except (OSError, ValueError):
                broken = True
    stream.close()


def _say(text: str, lock: threading.Lock) -> None:
    with lock:
        try:
            print(text, file=sys.stderr, flush=True)
        except (OSError, ValueError):  # no terminal any more (SIGHUP): the status still tells
            pass


def launch(argv: Sequence[str], config: LaunchConfig) -> int:
    """Run ``argv`` on ``config.nprocs`` local processes; return 0 if all succeeded, else the
    first failure's exit status (after a message naming the rank on stderr)."""
    port = free_port()
    lock = threading.Lock()
    procs: list[subprocess.Popen[bytes]] = []
    threads: list[threading.Thread] = []
    received: list[int] = []  # stop signals the launcher got, in order
    with recording_signals(received):
        for rank in range(config.nprocs):  # all of them even if a stop comes: none would
            procs.append(_start(argv, rank, port, config, lock, threads))  # join the rest
        try:
            first_failure, stopped = _supervise(procs, config, received)
        except KeyboardInterrupt:
            _terminate(procs, config.term_timeout_s)
            raise
    for thread in threads:
        thread.join(timeout=5)
    stop = stop_outcome([p.returncode for p in procs], received)
    if stop is not None:
        signum, by_launcher = stop
        whom = "the launcher" if by_launcher else "the workers"
        _say(f"launch: stopped by {signal_name(signum)} (sent to {whom}): every rank finished "
             f"its step and exited with status {stop_status(signum)}", lock)
        return stop_status(signum)
    if first_failure is None:
        return 0
    rank, code = first_failure
    others = [f"rank {r} {describe_exit(p.returncode)}" for r, p in enumerate(procs)
              if r != rank and r not in stopped and p.returncode not in (0, None)]
    if stopped:
        others.append(f"the launcher stopped rank(s) {', '.join(map(str, stopped))} "
                      f"{config.grace_s:g} s later")
    after = f" after {signal_name(received[0])}" if received else ""
    _say(f"launch: rank {rank} (pid {procs[rank].pid}) {describe_exit(code)}{after}"
         + (f"; then {', '.join(others)}" if others else ""), lock)
    return shell_code(code) or 1


def _start(argv: Sequence[str], rank: int, port: int, config: LaunchConfig,
           lock: threading.Lock, threads: list[threading.Thread]) -> subprocess.Popen[bytes]:
    """Start rank ``rank`` and the threads that forward its output."""
    env = dict(os.environ)
    env.update(config.env)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
               WORLD_SIZE=str(config.nprocs), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(config.nprocs),
               OMP_NUM_THREADS=str(config.threads_per_process), PYTHONUNBUFFERED="1")
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    proc = subprocess.Popen(list(argv), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    prefix = "" if rank == config.reporting_rank else f"[rank {rank}] "
    for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
        thread = threading.Thread(target=_forward, args=(stream, out, prefix, lock),
                                  daemon=True)
        thread.start()
        threads.append(thread)
    return proc


def _supervise(procs: list[subprocess.Popen[bytes]], config: LaunchConfig,
               received: Sequence[int] = ()) -> tuple[tuple[int, int] | None, list[int]]:
    """Wait for every child; on the first failure, give the rest ``grace_s``, then stop them.
    A stop signal in ``received`` is forwarded to every child, which then get
    ``stop_timeout_s`` (as they do when one exits with a stop status).

    Returns the (rank, return code) to blame, None if all succeeded: a child killed by a
    signal if any (its peers fail because it vanished, and may notice that before this loop
    sees it die), else the first to exit non-zero; and the ranks the launcher stopped.
    """
    stop_codes = {stop_status(s) for s in STOP_SIGNALS}
    stopped: list[int] = []
    failures: list[tuple[int, int]] = []
    deadline: float | None = None
    forwarded = 0
    while True:
        for signum in received[forwarded:]:
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signum)
            forwarded += 1
        codes = [p.poll() for p in procs]
        for rank, code in enumerate(codes):
            if code not in (0, None) and all(r != rank for r, _ in failures):
                failures.append((rank, code))
        if deadline is None and (received or any(c in stop_codes for c in codes)):
            deadline = time.monotonic() + config.stop_timeout_s
        elif deadline is None and any(c not in stop_codes for _, c in failures):
            deadline = time.monotonic() + config.grace_s
        done = all(c is not None for c in codes)
        if not done and deadline is not None and time.monotonic() >= deadline:
            stopped = [r for r, c in enumerate(codes) if c is None]
            _terminate(procs, config.term_timeout_s)
            done = True
        if done:
            if not failures or all(c in stop_codes for _, c in failures) and not stopped:
                return None, stopped
            return next(((r, c) for r, c in failures if c < 0), failures[0]), stopped
        time.sleep(0.05)


def _terminate(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    end = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
