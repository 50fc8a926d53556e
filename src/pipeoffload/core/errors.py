"""Re-export of the error types the core raises (the hierarchy lives in pipeoffload.errors)."""

from pipeoffload.errors import ConfigError, ParseError, PipeoffloadError, ScheduleError

__all__ = ["ConfigError", "ParseError", "PipeoffloadError", "ScheduleError"]
