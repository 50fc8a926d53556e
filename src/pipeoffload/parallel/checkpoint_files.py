"""What a checkpoint folder may hold and how its files are read, identified and retired.

- Step folders are found by parsing their names (``step_<N>``, N of 8 or more digits: the
  width grows past step 10^8 - 1), never by matching a fixed width.
- Only plain files directly inside the step folder are read: a name the manifest lists must be
  a bare file name (no separator, no ``..``, no leading dot, not absolute), the file must be a
  regular file (not a symlink, FIFO or device: opened with O_NOFOLLOW | O_NONBLOCK, then
  fstat-ed) of the size the manifest records, all checked before a byte is read.
- Every stage and rank file carries the run's identity and step (``FileIdentity``), checked
  against the manifest when it is loaded: a file copied in from another run or another step
  is refused even when the manifest was re-hashed to match it.
- After a save completes, stale ``.<name>.<random>.tmp`` files of killed saves are removed, and
  ``keep_last`` retires old checkpoints (their manifest first, so an interrupted removal leaves
  an incomplete folder, never a damaged "complete" one); the newest complete one is never
  removed. Only files a save wrote are removed, never through a symlink: other files in a
  step folder stay (and keep the folder), and a step folder that is a symlink is skipped.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeoffload.errors import PipeoffloadError

MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20  # a manifest of 4096 ranks is under 1 MiB
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_TMP = re.compile(r"^\..+\.tmp$")  # checkpoint.write_atomic's temporary names
# checkpoint.stage_file's and rank_file's names
_SAVED = re.compile(r"^(stage_\d{3,}(_tp\d+)?|rank_\d{5,})\.pt$")


class CheckpointError(PipeoffloadError):
    """A checkpoint is missing, incomplete, corrupt or was written for another configuration."""


@dataclass(frozen=True)
class StepFolder:
    step: int
    path: Path

    @property
    def complete(self) -> bool:
        return (self.path / MANIFEST).is_file()


def step_of(name: str) -> int | None:
    """The step a ``step_<N>`` folder name stands for (None for any other name)."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def step_folders(root: str | Path) -> list[StepFolder]:
    """Every ``step_<N>`` folder under ``root``, oldest first (empty if ``root`` is not a
    folder)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [StepFolder(step, child) for child in root.iterdir()
             if (step := step_of(child.name)) is not None and child.is_dir()]
    return sorted(found, key=lambda f: (f.step, f.path.name))


def check_root(root: str | Path) -> None:
    """Raise CheckpointError unless checkpoints can be made under ``root``: an existing folder,
    or a path whose nearest existing ancestor is a folder (a dangling symlink is neither)."""
    path = Path(root)
    if path.is_symlink() and not path.exists():
        raise CheckpointError(f"--checkpoint-dir {root} is a symlink to {os.readlink(path)}, "
                              "which does not exist; create the target folder or pass another "
                              "path")
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"--checkpoint-dir {root} is a file; name a folder")
        return
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        if ancestor.is_symlink():
            raise CheckpointError(f"--checkpoint-dir {root}: {ancestor} is a symlink to "
                                  f"{os.readlink(ancestor)}, which does not exist")
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise CheckpointError(f"--checkpoint-dir {root}: {ancestor} is not a folder")


def check_name(folder: Path, name: object) -> str:
    """``name`` if it is a bare file name inside the step folder, else CheckpointError."""
    if not isinstance(name, str) or not _PLAIN_NAME.match(name) or name in (".", ".."):
        raise CheckpointError(
            f"{folder / MANIFEST} lists {name!r}, which is not a file name inside the "
            "checkpoint folder (absolute paths, '..', separators and hidden names are refused "
            "unread); the manifest is corrupt or was edited, resume from another checkpoint")
    return name


def read_plain_file(folder: Path, name: str, *, size_bytes: int | None = None,
                    max_bytes: int | None = None) -> bytes:
    """The bytes of ``folder/name`` if it is a regular file (not a symlink, FIFO or device) of
    ``size_bytes`` (or at most ``max_bytes``); checked on the open descriptor before reading."""
    check_name(folder, name)
    path = folder / name
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise CheckpointError(f"checkpoint file {path} is a symlink; only plain files "
                                  "inside the step folder are read") from None
        raise CheckpointError(f"checkpoint file {path} cannot be read "
                              f"({error.strerror or error}); the checkpoint is incomplete or "
                              "damaged, resume from another one") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"checkpoint file {path} is not a plain file (a folder, FIFO "
                                  "or device); refused unread")
        if size_bytes is not None and info.st_size != size_bytes:
            raise CheckpointError(
                f"checkpoint file {path} is corrupt: {info.st_size} bytes, but the manifest "
                f"recorded {size_bytes}; refused unread, resume from another checkpoint")
        if max_bytes is not None and info.st_size > max_bytes:
            raise CheckpointError(f"{path} is {info.st_size} bytes, more than a checkpoint's "
                                  f"{name} can be ({max_bytes}); refused unread")
        os.set_blocking(f.fileno(), True)
        data = f.read(info.st_size + 1)
    if len(data) != info.st_size:
        raise CheckpointError(f"checkpoint file {path} changed while it was read; resume again")
    return data


@dataclass(frozen=True)
class FileIdentity:
    """What every stage and rank file records about where it belongs: the run (an id drawn at
    the run's fresh start and kept across resumes), the step, and its own name."""

    run: str
    step: int
    name: str

    def as_dict(self) -> dict[str, Any]:
        return {"run": self.run, "step": self.step, "file": self.name}


def check_identity(path: Path, saved: object, expected: FileIdentity) -> None:
    """Refuse a loaded file whose recorded identity is not ``expected`` (a file copied in from
    another run or step, or renamed)."""
    found = saved.get("identity") if isinstance(saved, dict) else None
    if found != expected.as_dict():
        raise CheckpointError(
            f"checkpoint file {path} belongs to another checkpoint (it records {found!r}; this "
            f"checkpoint is run {expected.run!r}, step {expected.step}): a file was copied in "
            "from another run or step; resume from a checkpoint whose files were all written "
            "together")


def tidy(root: str | Path, keep_last: int | None, extra_names: Collection[str] = ()
         ) -> list[Path]:
    """After a complete save (every rank's files written): remove stale temporary files in
    every step folder, and with ``keep_last`` retire the complete checkpoints older than the
    newest ``keep_last`` and incomplete folders older than the newest complete one. Only what a
    save writes is removed (``retire``; ``extra_names``: the extra files a save adds); a step
    folder that is a symlink is never entered. Returns the folders retired."""
    folders = [f for f in step_folders(root) if not f.path.is_symlink()]
    for folder in folders:
        for child in folder.path.iterdir():
            if _TMP.match(child.name) and _plain(child):
                child.unlink(missing_ok=True)
    if keep_last is None:
        return []
    if keep_last < 1:
        raise CheckpointError(f"--keep-last must be >= 1, got {keep_last}")
    complete = [f for f in folders if f.complete]
    if not complete:
        return []
    newest = complete[-1]
    old = complete[:-keep_last] + [f for f in folders if not f.complete and f.step < newest.step]
    for folder in sorted(old, key=lambda f: f.step):
        retire(folder.path, extra_names)
    return [f.path for f in old]


def _plain(path: Path) -> bool:
    """A regular file that is not a symlink."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def retire(folder: Path, extra_names: Collection[str] = ()) -> None:
    """Remove a step folder's checkpoint: its manifest first (so an interrupted removal leaves
    an incomplete folder, never a damaged complete one), then the files the manifest lists
    (or, without one, the names a save writes: stage, rank, ``extra_names`` and temporary
    files), each only if it is a plain file, then the folder if nothing else is left in it."""
    names = _written_names(folder) | set(extra_names)
    (folder / MANIFEST).unlink(missing_ok=True)
    for child in folder.iterdir():
        if (child.name in names or _TMP.match(child.name)
                or _SAVED.match(child.name)) and _plain(child):
            child.unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:  # files the run did not write stay, and so does their folder
        pass


def _written_names(folder: Path) -> set[str]:
    """The file names ``folder``'s manifest lists (none if it has no readable one)."""
    try:
        body = json.loads(read_plain_file(folder, MANIFEST, max_bytes=MAX_MANIFEST_BYTES))
        listed = body["files"]
    except (CheckpointError, ValueError, KeyError, TypeError):
        return set()
    return {name for name in listed if isinstance(name, str) and _PLAIN_NAME.match(name)}


def resolve_resume(resume: str | None, root: str | Path | None) -> str | None:
    """``--resume auto``: "latest" when ``root`` holds a complete checkpoint, else None (start
    from scratch); any other value as it is."""
    if resume != "auto":
        return resume
    if root is None:
        raise CheckpointError("--resume auto needs --checkpoint-dir (where to look, and where "
                              "to save)")
    return "latest" if any(f.complete for f in step_folders(root)) else None
