"""Signal dispositions for tests that signal a run: as a terminal gives them, or as nohup does.

A test runner started in the background of a script (`pytest &`) has SIGINT ignored, one under
nohup SIGHUP (POSIX), and what it starts inherits that across exec. A test that sends a run
those signals sets them first: its command starts through ``started_with(...)``, an in-process
test runs inside ``signals_at(...)``.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_SETTER = ("import os, signal, sys\n"
           "action = getattr(signal, sys.argv[1])\n"
           "for name in sys.argv[2].split(','):\n"
           "    signal.signal(getattr(signal, name), action)\n"
           "os.execvp(sys.argv[3], sys.argv[3:])")

TERMINAL_SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)  # what a run is sent


def started_with(action: signal.Handlers, *signals: int) -> tuple[str, ...]:
    """An argv prefix that sets ``signals`` to ``action`` (SIG_DFL or SIG_IGN), then execs the
    rest of the command line."""
    names = ",".join(signal.Signals(s).name for s in signals)
    return (sys.executable, "-c", _SETTER, action.name, names)


AS_FROM_A_TERMINAL = started_with(signal.SIG_DFL, *TERMINAL_SIGNALS)
# nohup from a terminal: SIGHUP ignored, SIGINT and SIGTERM at their defaults.
UNDER_NOHUP = (*started_with(signal.SIG_DFL, signal.SIGINT, signal.SIGTERM),
               *started_with(signal.SIG_IGN, signal.SIGHUP))


@contextmanager
def signals_at(action: signal.Handlers, *signals: int) -> Iterator[None]:
    """Set ``signals`` to ``action`` in this process while the block runs."""
    previous = {s: signal.signal(s, action) for s in signals}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
