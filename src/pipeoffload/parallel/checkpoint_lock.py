"""One run per checkpoint folder: an advisory lock that global rank 0 holds for the whole run.

Two runs sharing a ``--checkpoint-dir`` would remove each other's temporary files when tidying
up, and two ``--resume auto`` runs would both write the same step folders. The lock is
``fcntl.flock`` on ``<root>/.pipeoffload.lock``, which names its holder (pid and host) for the
refusal. The kernel drops a flock when its process dies, however it dies, so a lock file left by
a killed run is stale by construction: the next run takes it over (the file's old contents only
name who held it last). flock is advisory: it keeps pipeoffload runs apart, not other programs.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path

from pipeoffload.parallel.checkpoint_files import CheckpointError

LOCK_FILE = ".pipeoffload.lock"


class FolderLock:
    """The held lock of one checkpoint folder; ``release`` (or the process's end) drops it."""

    def __init__(self, root: Path, fd: int) -> None:
        self.root = root
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, root: str | Path, wait_s: float = 1.0) -> FolderLock:
        """Lock ``root`` (made if missing) for this process, or raise CheckpointError naming
        the run that holds it. Tries for up to ``wait_s`` (another run's up-front check holds
        a shared lock for an instant)."""
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        path = root / LOCK_FILE
        fd = _open(path, os.O_RDWR | os.O_CREAT)
        deadline = time.monotonic() + wait_s
        try:
            while not _try_lock(fd, path, fcntl.LOCK_EX):
                if time.monotonic() >= deadline:
                    holder = _read_holder(fd)
                    raise CheckpointError(
                        f"--checkpoint-dir {root} is in use by another run ("
                        f"{holder or 'holder unknown'}, lock file {path}); wait for it to end, "
                        "or give this run another folder")
                time.sleep(0.05)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        return cls(root, fd)

    def release(self) -> None:
        """Drop the lock (the file stays: removing it could race a run taking it)."""
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None


def _open(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                       0o644)
    except OSError as error:
        raise CheckpointError(f"--checkpoint-dir {path.parent}: cannot open its lock file "
                              f"{path} ({error.strerror or error})") from None


def _try_lock(fd: int, path: Path, kind: int) -> bool:
    """Take ``kind`` (LOCK_EX or LOCK_SH) without waiting; False if another holds it."""
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
            return False
        raise CheckpointError(f"--checkpoint-dir {path.parent}: cannot lock {path} "
                              f"({error.strerror or error})") from None
    return True


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
    except OSError:
        return ""
    return text.splitlines()[0] if text else ""


def check_unlocked(root: str | Path) -> None:
    """Raise CheckpointError if a run holds ``root``'s lock (the up-front check). It takes a
    shared lock for an instant, so the checks of a job's ranks, run at once, never refuse one
    another; a folder without a lock file is not locked."""
    path = Path(root) / LOCK_FILE
    if not path.exists():
        return
    fd = _open(path, os.O_RDONLY)
    try:
        if not _try_lock(fd, path, fcntl.LOCK_SH):
            holder = _read_holder(fd)
            raise CheckpointError(
                f"--checkpoint-dir {root} is in use by another run ({holder or 'holder unknown'}"
                f", lock file {path}); wait for it to end, or give this run another folder")
    finally:
        os.close(fd)
