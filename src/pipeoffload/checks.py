"""Field checks shared by the config dataclasses' ``__post_init__`` (pure Python, any layer).

Each check raises ConfigError naming the field (``where``, e.g. ``CostModel.f_time``), the rule
and the value it got, so a bad value is refused where it enters instead of surfacing later as
a ZeroDivisionError, an IndexError or a silently wrong answer (nan compares false with every
bound, so a plain ``value < 0`` test lets it through: these checks reject it first).
"""

from __future__ import annotations

import json
import math
from typing import Any

from pipeoffload.errors import ConfigError


def check_number(where: str, value: object, *, minimum: float | None = None,
                 above: float | None = None, maximum: float | None = None,
                 integer: bool = False) -> None:
    """``value`` is a finite real number (a whole one if ``integer``) with
    ``minimum <= value``, ``above < value`` and ``value <= maximum`` for the bounds given."""
    kind = "a whole number" if integer else "a finite number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            integer and not float(value).is_integer()):
        raise ConfigError(f"{where} must be {kind}, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{where} must be {kind}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{where} must be >= {minimum:g}, got {value!r}")
    if above is not None and value <= above:
        raise ConfigError(f"{where} must be > {above:g}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{where} must be <= {maximum:g}, got {value!r}")


def check_optional(where: str, value: object, *, minimum: float | None = None,
                   above: float | None = None, maximum: float | None = None,
                   integer: bool = False) -> None:
    """``check_number`` unless ``value`` is None."""
    if value is not None:
        check_number(where, value, minimum=minimum, above=above, maximum=maximum,
                     integer=integer)


def check_instance(where: str, value: object, kind: type | tuple[type, ...], what: str, *,
                   optional: bool = False) -> None:
    """Raise TypeError naming ``where`` unless ``value`` is a ``kind`` (``what`` says which in
    words), or None when ``optional``: a wrong kind of thing is refused where it enters the API
    instead of failing later as an AttributeError deep inside."""
    if optional and value is None:
        return
    if not isinstance(value, kind):
        raise TypeError(f"{where} must be {what}{' or None' if optional else ''}, got "
                        f"{type(value).__name__} {value!r:.60}")


def parse_json(text: str, source: str) -> Any:
    """``json.loads`` whose failures are ConfigErrors naming ``source`` (file:line:column),
    including nesting too deep for the parser (a RecursionError)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{source}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg})"
                          ) from None
    except RecursionError:
        raise ConfigError(f"{source}: JSON nested too deeply to read; a config file is a flat "
                          "object of fields") from None
