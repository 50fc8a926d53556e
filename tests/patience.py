"""How long a test waits for work that should finish: a hang guard, never a speed test.

The suite must pass on a loaded machine (issue 25: two busy loops on two cores stretch every
wall-clock duration several times over). A limit near a healthy run's quiet duration, on a
subprocess, a process join, a peer's message (p2p timeout) or a rendezvous, fails there for no
fault; so every such limit in the tests is this one value, far above any healthy duration, and
only turns a hang into a failure. Tests that need a peer to time out on purpose keep their short
p2p timeouts, and are written so that a slow machine cannot make them time out somewhere else.
PIPEOFFLOAD_TEST_PATIENCE_S sets it (seconds).
"""

from __future__ import annotations

import os

PATIENCE_S = float(os.environ.get("PIPEOFFLOAD_TEST_PATIENCE_S", "1800"))
PATIENCE = str(int(PATIENCE_S))  # as a command-line value (--p2p-timeout)
