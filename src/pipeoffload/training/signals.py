"""Stopping a run on request: a scheduler's SIGTERM, a closed terminal's SIGHUP, or the process
that started this one dying, all turned into one flag the training loop reads between steps.

Note: [stopping on a signal]
Slurm and Kubernetes preempt with SIGTERM, then SIGKILL after a grace period (Slurm's KillWait,
Kubernetes' terminationGracePeriodSeconds, 30 s by default); torchrun forwards SIGTERM, SIGHUP,
SIGINT and SIGQUIT to its workers and kills them 30 s later (``--shutdown-timeout``). So:
- The handler only sets a flag (``StopRequest``): a rank blocked in a send, receive or
  collective stays there, and the step in flight finishes on every rank.
- After each step the ranks agree (a max in the step's one all-gather, gather.gather_step):
  if any rank was asked to stop, all stop after that same step, write the checkpoint when one
  is configured (a collective, so every rank's part is the same step), and exit with
  ``stop_status`` (128 + the signal's number, as a shell reports a process a signal ended:
  143 for SIGTERM, 129 for SIGHUP).
- A worker whose parent is gone (the launcher was SIGKILLed: no handler runs there) notices
  through Linux's PR_SET_PDEATHSIG, which sends it SIGTERM the moment the parent dies, and
  through a thread that polls ``os.getppid()`` (any POSIX; it also covers the parent dying
  before the prctl call). Its stdout and stderr then lead nowhere, so they are pointed at
  /dev/null before anything more is printed, and the run stops as on SIGTERM.
- A signal ignored when the run starts stays ignored: ``nohup`` ignores SIGHUP so that a run
  outlives its terminal, and shells and Python itself (for SIGINT) keep an inherited SIG_IGN
  the same way. Workers inherit the launcher's ignored signals across exec.
PR_SET_PDEATHSIG fires when the *thread* that forked the child exits; our launcher forks from
its main thread, which outlives the children, but torchrun's agent may not, so under torchrun
only the polling is used.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
# The launcher gives its pid to the workers it starts, so they know it is their parent.
LAUNCHER_PID_ENV = "PIPEOFFLOAD_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def stop_status(signum: int) -> int:
    """The exit status of a run stopped by ``signum`` (after its step and checkpoint)."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class StopRequest:
    """Whether this process was asked to stop, and by what (set from a signal handler or the
    parent watch, read by the training loop between steps; see Note: [stopping on a signal])."""

    def __init__(self) -> None:
        self.signum = 0  # 0: keep going
        self.reason = ""
        self.parent_pid: int | None = None  # watched by watch_parent

    def __bool__(self) -> bool:
        return self.signum != 0

    def request(self, signum: int, reason: str = "") -> None:
        """Ask to stop (the first request wins; later ones change nothing)."""
        if self.parent_pid is not None and not parent_alive(self.parent_pid):
            silence_output()
            reason = reason or f"its parent (pid {self.parent_pid}) is gone"
        if not self.signum:
            self.reason = reason or f"received {signal_name(signum)}"
            self.signum = int(signum)


def parent_alive(parent_pid: int) -> bool:
    """Whether ``parent_pid`` is still this process's parent (an orphan is re-parented)."""
    return os.getppid() == parent_pid


def silence_output() -> None:
    """Point stdout and stderr at /dev/null: their reader (the launcher) is gone, and a write
    into a closed pipe would raise in the middle of a step."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            os.dup2(devnull, fd)
    finally:
        os.close(devnull)


@contextmanager
def _handling(signals: Sequence[int], handler: Callable[[int, Any], None]) -> Iterator[None]:
    """``handler`` for each of ``signals`` while the block runs, then the previous handlers.
    A signal ignored on entry (``nohup``'s SIGHUP) stays ignored (Note: [stopping on a
    signal]); outside the main thread, where Python cannot install handlers, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in signals
                if signal.getsignal(s) != signal.SIG_IGN}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


@contextmanager
def stop_on_signals(request: StopRequest | None = None,
                    signals: Sequence[int] = STOP_SIGNALS) -> Iterator[StopRequest]:
    """Turn ``signals`` (those not ignored) into ``request.request(signum)`` while the block
    runs, then restore the previous handlers. Outside the main thread Python cannot install
    handlers: the request is then only set by ``watch_parent`` or by the caller."""
    request = request if request is not None else StopRequest()
    with _handling(signals, lambda signum, frame: request.request(signum)):
        yield request


def watch_parent(request: StopRequest, parent_pid: int, *, death_signal: bool,
                 poll_s: float = 1.0) -> threading.Thread:
    """Stop when ``parent_pid``, this process's parent, is gone: with ``death_signal`` (only
    for a parent that forked us from a thread that outlives us) Linux sends SIGTERM at once;
    a daemon thread polls ``os.getppid()`` every ``poll_s`` seconds in any case."""
    request.parent_pid = parent_pid
    if death_signal and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        except (OSError, AttributeError):  # no prctl here: the polling below still works
            pass

    def poll() -> None:
        while parent_alive(parent_pid):
            time.sleep(poll_s)
        request.request(signal.SIGTERM, f"its parent (pid {parent_pid}) is gone")

    thread = threading.Thread(target=poll, name="pipeoffload-parent-watch", daemon=True)
    thread.start()
    if not parent_alive(parent_pid):  # died before prctl: no signal will come
        request.request(signal.SIGTERM, f"its parent (pid {parent_pid}) is gone")
    return thread


@contextmanager
def recording_signals(received: list[int]) -> Iterator[None]:
    """For a launcher: while the block runs, SIGTERM and SIGHUP (unless ignored) are appended to
    ``received`` (its supervising loop forwards them to the workers) instead of ending it; only
    from the main thread."""
    with _handling(STOP_SIGNALS, lambda signum, frame: received.append(signum)):
        yield


def stop_outcome(codes: Sequence[int | None],
                 received: Sequence[int]) -> tuple[int, bool] | None:
    """For a launcher whose workers exited with ``codes``: (signal, whether the launcher itself
    received it) when the run ended by a stop request (every worker exited 0 or with a stop
    status, at least one with the latter, or the launcher was signalled), else None."""
    statuses = {stop_status(s): s for s in STOP_SIGNALS}
    if not codes or any(c != 0 and c not in statuses for c in codes):
        return None
    if received:
        return received[0], True
    stops = [statuses[c] for c in codes if c in statuses]
    return (max(stops), False) if stops else None


def watch_worker_parent(request: StopRequest, env: Mapping[str, str]) -> threading.Thread:
    """In a worker process: stop when the process that started it dies, the local launcher
    (its pid in ``LAUNCHER_PID_ENV``: with the death signal) or torchrun's agent (polling only,
    see the Note)."""
    parent = os.getppid()
    return watch_parent(request, parent, death_signal=env.get(LAUNCHER_PID_ENV) == str(parent))
