"""``--config FILE.toml``: a subcommand's flags from a TOML file, and its effective settings back
as TOML.

The keys a file may hold are the subcommand's own long options, read off its argparse parser
(``pp = 4``, ``checkpoint-dir = "ck"``; ``checkpoint_dir`` works too), so a flag added later is
accepted with no code here. Each key becomes ``--key=value`` placed before the command line's
own flags, so a flag given on the command line wins (argparse keeps the last); a switch
(``no-png = true``) becomes ``--no-png``, and ``false`` leaves it out. Values are checked with
the flag's own type and choices first, so an error names the file and the key.

A relative path in the file (a value the flag's type marks as a path, preflight.is_path)
resolves against the file's folder, as Cargo and torchtitan read theirs: a run's file moves
with its outputs and runs the same from any folder; command-line paths stay relative to the
current folder. The effective settings written back (``settings_toml``) hold absolute paths, so
a saved file names the same files wherever it lies. An error about such a path names the file
and the key (``expand_settings``' origins, preflight.flag_of).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import stat
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

from pipeoffload.cli.preflight import is_path
from pipeoffload.errors import ConfigError

CONFIG_FLAG = "--config"
MAX_SETTINGS_BYTES = 1 << 20  # a settings file of every option is about 2 KiB
_NOT_SETTINGS = {"help", "config", "worker-config"}


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser | None:
    for action in parser._actions:  # argparse keeps subcommands in this one (public-ish) action
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(name)
    return None


def setting_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """{key: action} of every long option a settings file may hold."""
    found = {}
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:
            continue
        for option in action.option_strings:
            if option.startswith("--") and option[2:] not in _NOT_SETTINGS:
                found[option[2:]] = action
    return found


def _config_path(argv: Sequence[str], start: int) -> str | None:
    paths = []
    for i in range(start, len(argv)):
        token = argv[i]
        if token == "--":
            break
        if token == CONFIG_FLAG and i + 1 < len(argv):
            paths.append(argv[i + 1])
        elif token.startswith(CONFIG_FLAG + "="):
            paths.append(token[len(CONFIG_FLAG) + 1:])
    if len(paths) > 1:
        raise ConfigError(f"{CONFIG_FLAG} was given {len(paths)} times; give one file")
    return paths[0] if paths else None


class Setting(NamedTuple):
    """One key of a settings file: the command-line tokens it stands for, and for a path its
    value as resolved against the file's folder (else None)."""

    dest: str
    where: str
    tokens: list[str]
    path: str | None


# {dest: (where, resolved path)} of the paths a settings file gave
Origins = dict[str, tuple[str, str]]


def expand(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``argv`` with the settings of its ``--config FILE`` inserted right after the subcommand
    (so the command line's flags override them); unchanged without ``--config``."""
    return expand_settings(parser, argv)[0]


def expand_settings(parser: argparse.ArgumentParser,
                    argv: Sequence[str]) -> tuple[list[str], Origins]:
    """``expand``, and where each path the file gave came from (``--config FILE: key``)."""
    argv = list(argv)
    command = next((i for i, token in enumerate(argv) if not token.startswith("-")), None)
    if command is None:
        return argv, {}
    sub = _subparser(parser, argv[command])
    if sub is None or CONFIG_FLAG not in sub._option_string_actions:
        return argv, {}
    path = _config_path(argv, command + 1)
    if path is None:
        return argv, {}
    settings = file_settings(sub, path)
    tokens = [token for setting in settings for token in setting.tokens]
    origins = {s.dest: (s.where, s.path) for s in settings if s.path is not None}
    return argv[:command + 1] + tokens + argv[command + 1:], origins


def kept_origins(args: argparse.Namespace, origins: Origins) -> dict[str, str]:
    """{dest: ``--config FILE: key``} of the file's paths the command line did not override."""
    return {dest: where for dest, (where, path) in origins.items()
            if getattr(args, dest, None) == path}


def config_tokens(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The command-line tokens ``path``'s settings stand for (checked, see the module doc)."""
    return [token for setting in file_settings(parser, path) for token in setting.tokens]


def file_settings(parser: argparse.ArgumentParser, path: str) -> list[Setting]:
    """``path``'s settings, checked (see the module doc), in the file's order."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ConfigError(f"{CONFIG_FLAG} {path}: reading TOML needs Python 3.11 or later "
                              "(tomllib), or `pip install tomli`") from None
    values = _parse(tomllib, path, _settings_text(path))
    _refuse_spelled_twice(path, values)
    actions = setting_actions(parser)
    folder = os.path.dirname(path)
    settings = []
    for key, value in values.items():
        name = key.replace("_", "-")
        action = actions.get(name)
        where = f"{CONFIG_FLAG} {path}: {key}"
        if isinstance(value, dict):
            raise ConfigError(f"{where}: tables ([{key}]) are not used; write each setting "
                              "as `key = value` at the top of the file")
        if action is None:
            close = difflib.get_close_matches(name, actions, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(f"{where} is not a setting of this command{hint}; the settings "
                              "are its long options without the leading --")
        tokens, resolved = _tokens(where, f"--{name}", action, value, folder)
        settings.append(Setting(action.dest, where, tokens, resolved))
    return settings


def _settings_text(path: str) -> str:
    """The text of settings file ``path``: a regular file (a FIFO would block, /dev/zero never
    end) of at most MAX_SETTINGS_BYTES, UTF-8, a leading byte-order mark dropped."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{CONFIG_FLAG} {path}: not a regular file (a pipe or device); "
                              "save the settings to a file")
        if info.st_size > MAX_SETTINGS_BYTES:
            raise ConfigError(f"{CONFIG_FLAG} {path}: {info.st_size} bytes, more than a "
                              f"settings file may be ({MAX_SETTINGS_BYTES})")
        with open(path, "rb") as f:
            data = f.read(MAX_SETTINGS_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"{CONFIG_FLAG} {path}: {error.strerror or error}") from None
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as error:
        raise ConfigError(f"{CONFIG_FLAG} {path}: not UTF-8 text (byte {error.start}: "
                          f"{error.reason})") from None


def _parse(tomllib: Any, path: str, text: str) -> dict[str, Any]:
    """``text`` parsed as TOML; each way it can fail is one ConfigError naming the file."""
    try:
        return dict(tomllib.loads(text))
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{CONFIG_FLAG} {path}: not valid TOML ({error})") from None
    except RecursionError:
        raise ConfigError(f"{CONFIG_FLAG} {path}: arrays or tables nested too deeply; a "
                          "settings file holds `key = value` lines") from None
    except ValueError as error:  # an integer of more digits than Python converts (4300)
        raise ConfigError(f"{CONFIG_FLAG} {path}: a value cannot be read ({error})") from None


def _refuse_spelled_twice(path: str, values: dict[str, Any]) -> None:
    """Refuse one setting given under two spellings (``keep-last`` and ``keep_last``): the
    later one would win silently."""
    seen: dict[str, str] = {}
    for key in values:
        name = key.replace("_", "-")
        if name in seen:
            raise ConfigError(f"{CONFIG_FLAG} {path}: {seen[name]!r} and {key!r} are the same "
                              "setting; keep one of them")
        seen[name] = key


def _tokens(where: str, option: str, action: argparse.Action, value: Any,
            folder: str) -> tuple[list[str], str | None]:
    """The tokens of one setting, and its value if it is a path, resolved against ``folder``
    (the settings file's)."""
    takes_value = action.nargs != 0
    if isinstance(value, bool):
        if not takes_value or action.nargs == "?":  # a switch, or --resume with no value
            return ([option] if value else []), None
        raise ConfigError(f"{where} = {str(value).lower()}: expected a value, not true/false")
    if not takes_value:
        raise ConfigError(f"{where} = {value!r}: a switch, write true or false")
    if isinstance(value, (dict, list)) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{where}: expected one value (a number or a string), got "
                          f"{type(value).__name__}")
    text = repr(value) if isinstance(value, float) else str(value)
    try:
        checked = action.type(text) if callable(action.type) else text
    except (argparse.ArgumentTypeError, ValueError, TypeError) as error:
        raise ConfigError(f"{where} = {value!r}: {error}") from None
    if action.choices is not None and checked not in action.choices:
        raise ConfigError(f"{where} = {value!r}: choose one of "
                          f"{', '.join(map(str, action.choices))}")
    if not is_path(checked):
        return [f"{option}={text}"], None
    resolved = text if os.path.isabs(text) else os.path.join(folder, text)
    return [f"{option}={resolved}"], resolved


def toml_value(value: Any) -> str:
    """``value`` (bool, int, float or str) as a TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    # A JSON string is a TOML basic string, except that TOML wants DEL escaped too.
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")


def effective_settings(parser: argparse.ArgumentParser,
                       args: argparse.Namespace) -> list[tuple[str, Any, bool]]:
    """(key, value, differs from the default) for every setting of ``args``, as the TOML key a
    ``--config`` file takes; unset optional values (None) are left out."""
    rows = []
    seen = set()
    for key, action in setting_actions(parser).items():
        dest = action.dest
        if dest in seen:
            continue
        value = getattr(args, dest, None)
        siblings = [(k, a) for k, a in setting_actions(parser).items() if a.dest == dest]
        switch = next(((k, a) for k, a in siblings if a.nargs == 0 and value == a.const
                       and value is not parser.get_default(dest)), None)
        if switch is not None:  # e.g. --no-png (png None), or --inline (True)
            rows.append((switch[0], True, True))
        elif value is not None:
            valued = next((k for k, a in siblings if a.nargs != 0), None)
            if valued is not None:
                rows.append((valued, value, value != parser.get_default(dest)))
            elif isinstance(value, bool):
                rows.append((key, value, value != parser.get_default(dest)))
        seen.add(dest)
    return rows


def settings_toml(parser: argparse.ArgumentParser, args: argparse.Namespace,
                  header: str = "") -> str:
    """Every effective setting as a TOML file that ``--config`` reads back, paths absolute
    (the current folder's files, read back from any folder)."""
    lines = [f"# {line}" for line in header.splitlines()]
    lines += [f"{key} = {toml_value(os.path.abspath(value) if is_path(value) else value)}"
              for key, value, _ in effective_settings(parser, args)]
    return "\n".join(lines) + "\n"


def changed_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """The settings that differ from the defaults, as command-line flags."""
    parts = []
    for key, value, changed in effective_settings(parser, args):
        if not changed:
            continue
        if value is True and setting_actions(parser)[key].nargs == 0:
            parts.append(f"--{key}")
        else:
            parts.append(f"--{key} {value}")
    return " ".join(parts)
