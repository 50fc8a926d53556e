"""The exception hierarchy. Every user-facing error says what was wrong, where, and what to do."""

from __future__ import annotations


class PipeoffloadError(Exception):
    """Base of every error this library raises on purpose."""


class ConfigError(PipeoffloadError, ValueError):
    """An option or argument is invalid for what was asked (names the option and the fix)."""


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
