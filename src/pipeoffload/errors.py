"""The exception hierarchy. Every user-facing error says what was wrong, where, and what to do."""

from __future__ import annotations

import errno
import os
import re
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][\w.]*)\}")


class PipeoffloadError(Exception):
    """Base of every error this library raises on purpose."""


class ConfigError(PipeoffloadError, ValueError):
    """An option or argument is invalid for what was asked (names the option and the fix)."""


class FieldError(ConfigError):
    """A configuration's field (or fields) holding a value that is wrong, named apart from the
    text so that each front end calls them its own way.

    ``template`` writes each field as ``{field}`` (a dotted path into a nested config:
    ``{data.seq_len}``) and each of ``values`` as ``{name}``, filled in as given. ``str()``
    names the fields ``Owner.field``; the command line renders them as its flags
    (``render``). ``fields`` lists them in order of appearance.
    """

    def __init__(self, owner: str, template: str, values: Mapping[str, object] | None = None
                 ) -> None:
        self.owner = owner
        self.template = template
        self.values = {name: str(value) for name, value in (values or {}).items()}
        self.fields = tuple(dict.fromkeys(name for name in _PLACEHOLDER.findall(template)
                                          if name not in self.values))
        super().__init__(self.render({}))

    def render(self, names: Mapping[str, str]) -> str:
        """The message with each field called ``names[field]`` (``Owner.field`` if absent)."""
        def fill(match: re.Match[str]) -> str:
            key = match.group(1)
            if key in self.values:
                return self.values[key]
            return names.get(key, f"{self.owner}.{key}")

        return _PLACEHOLDER.sub(fill, self.template)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.owner, self.template, self.values)


class ParseError(PipeoffloadError, ValueError):
    """Schedule text or CSV could not be read (names the token, row and column)."""


class ScheduleError(PipeoffloadError, ValueError):
    """A schedule is invalid: missing, duplicated or misplaced actions, or a deadlock.

    ``rank`` / ``position`` / ``action`` locate the problem when there is one place to point at.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        position: int | None = None,
        action: object | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.position = position
        self.action = action


class PipelineRuntimeError(PipeoffloadError, RuntimeError):
    """Executing a schedule failed (names the rank and the action)."""


class IntegrationError(PipeoffloadError, RuntimeError):
    """An integration cannot run here: an untested version of the library it adapts, a missing
    optional extra, or a model it does not know (names what it found and what to do)."""


@contextmanager
def writing(path: str | os.PathLike[str]) -> Iterator[None]:
    """Name ``path`` in an OSError raised inside that names no file: a full disk (ENOSPC) or
    the file-size limit (EFBIG) fails a write with an error that says nothing of where."""
    try:
        yield
    except OSError as error:
        if error.filename is None:
            error.filename = os.fspath(path)
        raise


READER_WAIT_S = 60.0
"""How long an output that is a FIFO waits for its reader to open it (the default of the
commands' ``--fifo-wait``): a FIFO nobody reads would block the command for ever."""


@contextmanager
def writing_output(path: str | os.PathLike[str], flag: str, wait_s: float,
                   say: Callable[[str], None]) -> Iterator[None]:
    """``writing(path)``, where ``path`` (the value of ``flag``) may be a FIFO: then wait up to
    ``wait_s`` for a reader (``say`` tells the user once that it waits) and raise ConfigError
    naming the FIFO if none comes. The FIFO stays open for writing until the block ends, so
    the reader sees one stream (no end of file between the wait and the block's own open,
    which no longer blocks); inside, the write blocks as any write to a pipe does."""
    held = _reader_waited(path, flag, wait_s, say) if _is_fifo(path) else None
    try:
        with writing(path):
            yield
    finally:
        if held is not None:
            os.close(held)


def _is_fifo(path: str | os.PathLike[str]) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def _reader_waited(path: str | os.PathLike[str], flag: str, wait_s: float,
                   say: Callable[[str], None]) -> int:
    """A write descriptor of FIFO ``path`` once a reader has it open (a non-blocking open
    fails with ENXIO until then), polled for at most ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    waiting = False
    while True:
        try:
            return os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as error:
            if error.errno != errno.ENXIO:
                raise
        left = deadline - time.monotonic()
        if left <= 0:
            raise ConfigError(f"{flag} {os.fspath(path)}: no reader opened this FIFO within "
                              f"{wait_s:g} s (--fifo-wait); start its reader first, or name "
                              "a regular file")
        if not waiting:
            say(f"waiting up to {wait_s:g} s for a reader on FIFO {os.fspath(path)}")
            waiting = True
        time.sleep(min(0.05, left))
