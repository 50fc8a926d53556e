"""Up-front checks of command-line input, and the one place that turns failures into `error:`
lines: every number and path a subcommand takes is checked before any work starts.

- Numbers: argparse ``type=`` factories (``count``, ``number``, ``counts``) that refuse 0,
  negatives, nan, inf and absurd sizes with a message naming the rule; argparse prefixes the
  flag (``argument --pp: ...``). ``check_args`` also refuses a non-finite float in any flag, so
  a flag added later with a bare ``type=float`` cannot let nan through.
- Paths: ``output_file`` / ``output_dir`` / ``input_file`` / ``input_path`` mark a flag's value
  (a ``str`` subclass that remembers its role); ``check_args`` then checks every marked value
  in the namespace on the file system: output folders exist and take a new file, outputs are
  not folders, inputs exist and can be read. Checks that touch the disk run only after parsing,
  so a default path that a ``--no-...`` flag turns off is never checked.
- ``run_command`` calls a subcommand's handler and turns PipeoffloadError, OSError,
  UnicodeDecodeError and KeyboardInterrupt into one ``pipeoffload CMD: error: ...`` line and a
  non-zero exit status; no traceback reaches the user.
"""

from __future__ import annotations

import argparse
import codecs
import importlib.util
import io
import math
import os
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeoffload import errors
from pipeoffload.errors import ConfigError, PipeoffloadError, writing

INPUT_ERROR = 2  # bad input, refused before any work (argparse uses 2 as well)
FAILED = 1  # the work itself failed (a file could not be written, a run failed)
INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT

# Far above any real use, low enough that a typo (an extra zero or three) is refused instead of
# building millions of actions.
MAX_RANKS = 4096
MAX_MICROBATCHES = 1 << 16
MAX_CHUNKS = 64
# Stages x microbatches a schedule may have: p = 64, v = 4, m = 1024, whose `limit:` offload
# plan takes half a minute and about 1.6 GB (benchmarks/limit_plan.py); beyond it a plan takes
# minutes and gigabytes.
MAX_STAGE_MICROBATCHES = 1 << 18
# Local processes `train` starts per CPU core (each imports torch, ~0.3 GB); more is a job for
# torchrun across machines.
LOCAL_PROCESSES_PER_CPU = 8
# The namespace attribute main sets: {dest: "--config FILE: key"} for each path a --config file
# gave (and the command line did not override), so errors about it name the file and key.
SETTING_ORIGINS = "setting_origins"


def count(minimum: int = 1, maximum: int | None = None) -> Callable[[str], int]:
    """argparse type: a whole number in [minimum, maximum]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
            raise argparse.ArgumentTypeError(f"must be a whole number {bound}, got {text!r}")
        return value
    parse.__name__ = "count"
    return parse


def number(minimum: float | None = None, above: float | None = None,
           maximum: float | None = None) -> Callable[[str], float]:
    """argparse type: a finite number with ``minimum <= x``, ``above < x``, ``x <= maximum``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        rules = []
        if minimum is not None:
            rules.append(f">= {minimum:g}")
        if above is not None:
            rules.append(f"> {above:g}")
        if maximum is not None:
            rules.append(f"<= {maximum:g}")
        if not math.isfinite(value) or (minimum is not None and value < minimum) or (
                above is not None and value <= above) or (
                maximum is not None and value > maximum):
            rule = " and ".join(rules)
            raise argparse.ArgumentTypeError(
                f"must be a finite number{' ' + rule if rule else ''}, got {text!r}")
        return value
    parse.__name__ = "number"
    return parse


def counts(minimum: int = 1, maximum: int | None = None) -> Callable[[str], tuple[int, ...]]:
    """argparse type: a comma-separated list of whole numbers, each in [minimum, maximum]."""
    one = count(minimum, maximum)

    def parse(text: str) -> tuple[int, ...]:
        values = tuple(one(part.strip()) for part in text.split(",") if part.strip())
        if not values:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return values
    parse.__name__ = "counts"
    return parse


class CheckedPath(str):
    """A path from the command line; the subclass says what it is for (``check_path``)."""


class OutputFile(CheckedPath):
    """A file to write: its folder must take new files, and it must not be a folder. ``off``:
    the flag that writes none, if the command has one (a refusal names it)."""

    off: str | None = None


class DefaultOutputFile(OutputFile):
    """An output file no flag asked for (train's default picture): where it would land in the
    checkpoint folder, the data or on another output, it is skipped with a note, not refused."""


class OutputDir(CheckedPath):
    """A folder to write into (made if missing): it or its nearest parent must be writable."""


class InputFile(CheckedPath):
    """A UTF-8 text file to read."""


class InputPath(CheckedPath):
    """A file or folder to read."""


class ResumePath(InputPath):
    """The checkpoint to resume: it may be, or lie inside, an output folder (the run's own
    --checkpoint-dir)."""


class StoredOutputFile(OutputFile):
    """An output file a long run appends to as it goes (``--metrics``): a regular file or a
    new one, never a FIFO or device, which would block the run while nothing reads it."""


class ModelPath(str):
    """``--model``'s value when it names no preset: a path, which the model loader checks (its
    error says what it accepts), not ``check_path``."""


def is_path(value: object) -> bool:
    """Whether a flag's parsed value is a file-system path (what a ``--config`` file's
    relative values resolve against the file's folder for)."""
    return isinstance(value, (CheckedPath, ModelPath))


def output_file(*suffixes: str, stored: bool = False,
                off: str | None = None) -> Callable[[str], OutputFile]:
    """argparse type: a file to write; with ``suffixes``, its name must end in one of them;
    ``stored``: a StoredOutputFile (a regular file, not a pipe or device); ``off``: the flag
    that writes none. A DefaultOutputFile default stays one."""
    def parse(text: str) -> OutputFile:
        made = _output_file(text, suffixes, stored)
        made.off = off
        return made
    parse.__name__ = "output_file"
    return parse


def _output_file(text: str, suffixes: tuple[str, ...], stored: bool) -> OutputFile:
    if isinstance(text, DefaultOutputFile):
        return text
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a file name, got ''")
    if suffixes and Path(text).suffix.lower() not in suffixes:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the file name must end in {' or '.join(suffixes)} (it sets the "
            "format)")
    return StoredOutputFile(text) if stored else OutputFile(text)


def _path_type(kind: type[CheckedPath]) -> Callable[[str], CheckedPath]:
    def parse(text: str) -> CheckedPath:
        if not text.strip():
            raise argparse.ArgumentTypeError("expected a path, got ''")
        return kind(text)
    parse.__name__ = kind.__name__
    return parse


output_dir = _path_type(OutputDir)
input_file = _path_type(InputFile)
input_path = _path_type(InputPath)


def data_source(text: str) -> str:
    """argparse type of --data: ``hf:NAME[:SPLIT]`` (a dataset in the local cache), or a path."""
    return text if text.startswith("hf:") and len(text) > 3 else input_path(text)


def resume_path(text: str) -> str:
    """argparse type of --resume: the words ``latest`` (also its bare form's value) and
    ``auto``, or a path."""
    if text in ("latest", "auto"):
        return text
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got ''")
    return ResumePath(text)


def check_work(pp: int, chunks: int, microbatches: int) -> None:
    """Refuse a schedule with more stage-microbatches than MAX_STAGE_MICROBATCHES, before it is
    built (``chunks``: stages per rank, at most what the schedule will have)."""
    work = pp * chunks * microbatches
    if work > MAX_STAGE_MICROBATCHES:
        raise ConfigError(
            f"--pp {pp} x --chunks {chunks} x --microbatches {microbatches} = {work} "
            f"stage-microbatches, more than a schedule may have ({MAX_STAGE_MICROBATCHES}: "
            "planning it would take minutes and gigabytes); lower --microbatches or --pp")


def local_process_limit() -> int:
    """How many local processes `train` may start: LOCAL_PROCESSES_PER_CPU per usable core."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return LOCAL_PROCESSES_PER_CPU * max(cores, 1)


def check_local_processes(pp: int, dp: int, tp: int, cp: int = 1) -> None:
    """Refuse to start more local processes than ``local_process_limit``."""
    limit = local_process_limit()
    if pp * dp * tp * cp > limit:
        product = f"--pp {pp} x --dp {dp} x --tp {tp}" + (f" x --cp {cp}" if cp > 1 else "")
        raise ConfigError(
            f"{product} = {pp * dp * tp * cp} processes, more than train "
            f"starts on one machine ({limit}: {LOCAL_PROCESSES_PER_CPU} per CPU core); run it "
            "across machines with torchrun (docs/training.md), or lower --pp / --dp / --tp"
            " / --cp")


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def flag_of(args: argparse.Namespace, dest: str) -> str:
    """What an error calls the setting ``dest``: its flag, or for a path a ``--config`` file
    set, the file and key (``--config run.toml: checkpoint-dir``, main's ``setting_origins``)."""
    origins: dict[str, str] = getattr(args, SETTING_ORIGINS, None) or {}
    return origins.get(dest, flag_name(dest))


def named_by_origin(message: str, args: argparse.Namespace) -> str:
    """``message`` with a leading flag (``--data X: ...``) that a ``--config`` file set
    replaced by the file and key, for the errors found after the up-front checks."""
    origins: dict[str, str] = getattr(args, SETTING_ORIGINS, None) or {}
    for dest, origin in origins.items():
        if message.startswith(flag_name(dest) + " "):
            return origin + message[len(flag_name(dest)):]
    return message


def _writable_folder(folder: Path) -> str | None:
    """Why a new file cannot be made in ``folder`` (None if it can): tried for real, since
    permission bits say nothing for root or on a read-only mount."""
    if not folder.exists():
        return f"its folder {folder} does not exist; create it first or choose another path"
    if not folder.is_dir():
        return f"{folder} is not a folder"
    try:
        fd, probe = tempfile.mkstemp(prefix=".pipeoffload-check-", dir=folder)
    except OSError as error:
        return f"cannot create files in {folder} ({error.strerror or error})"
    os.close(fd)
    os.unlink(probe)
    return None


def _not_text(path: Path, head_bytes: int = 1 << 16) -> str | None:
    """Why ``path`` cannot be read as UTF-8 text (None if its first bytes can)."""
    try:
        with open(path, "rb") as f:
            head = f.read(head_bytes)
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError as error:
        return f"is not UTF-8 text (byte {error.start}: {error.reason}); pass a text file"
    return None


def _special(path: Path) -> bool:
    """Whether ``path`` exists and is neither a regular file nor a folder (a FIFO, a device,
    /dev/stdin): opening it may block, and reading it consumes what the command needs."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def check_path(flag: str, path: CheckedPath) -> None:
    """Raise ConfigError naming ``flag`` if ``path`` cannot serve as its role. Never blocks
    and never reads from a FIFO or device (the command reads it once, later)."""
    where = Path(path)
    problem = None
    if isinstance(path, OutputFile):
        if where.is_dir():
            problem = "is a folder; name a file"
        elif isinstance(path, StoredOutputFile) and _special(where):
            problem = ("is a pipe or device, which would stall the run while nothing reads "
                       "it; name a regular file")
        elif _special(where):  # opening a FIFO here would block, or end its reader's input
            problem = None if os.access(where, os.W_OK) else "cannot be written"
        elif where.exists():
            try:
                with open(where, "ab"):
                    pass
            except OSError as error:
                problem = f"cannot be written ({error.strerror or error})"
        else:
            problem = _writable_folder(where.parent)
    elif isinstance(path, OutputDir):
        if where.is_symlink() and not where.exists():
            problem = (f"is a symlink to {os.readlink(where)}, which does not exist; create "
                       "the target folder or pass another path")
        elif where.exists():
            problem = ("is a file; name a folder" if not where.is_dir()
                       else _writable_folder(where))
        else:
            ancestor = where.parent
            while not ancestor.exists() and ancestor != ancestor.parent:
                ancestor = ancestor.parent
            problem = _writable_folder(ancestor)
    elif isinstance(path, (InputFile, InputPath)):
        if not where.exists():
            problem = "does not exist"
        elif isinstance(path, InputFile) and where.is_dir():
            problem = "is a folder; name a file"
        elif isinstance(path, InputFile) and _special(where):  # a pipe: read once, later
            problem = None if os.access(where, os.R_OK) else "cannot be read"
        elif isinstance(path, InputFile):
            problem = _not_text(where)
        elif _special(where):
            problem = ("is not a regular file or folder (a pipe or device); every process "
                       "reads it, so save it to a file first")
    if problem:
        raise ConfigError(f"{flag} {path}: {problem}")


def check_text(flag: str, value: str) -> None:
    """Refuse a value no file system call takes: a NUL byte, or bytes that are not UTF-8 (a
    command line's undecodable bytes arrive as lone surrogates), which would fail the run at
    its first write instead of now."""
    if "\0" in value:
        raise ConfigError(f"{flag} {value!r}: contains a NUL byte, which no path can hold")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        shown = value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        raise ConfigError(f"{flag} {shown}: is not UTF-8 text (its bytes were undecodable); "
                          "rename it or pass a UTF-8 path") from None


def check_args(args: argparse.Namespace) -> None:
    """Refuse non-finite floats and NUL bytes or undecodable bytes in any flag, check every
    marked path (see the module doc), and refuse outputs that would overwrite an input or
    another output, or land inside an input or output folder (``check_places``). A positional
    argument is named by its metavar where the parser's defaults list it (``arg_names``)."""
    names: dict[str, str] = getattr(args, "arg_names", {})

    def name(dest: str) -> str:
        return names.get(dest) or flag_of(args, dest)

    for dest, value in vars(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name(dest)} must be a finite number, got {value}")
        if isinstance(value, str):
            check_text(name(dest), value)
    for dest, value in vars(args).items():
        if isinstance(value, CheckedPath):
            check_path(name(dest), value)
    paths = [(name(dest), value) for dest, value in vars(args).items()
             if isinstance(value, CheckedPath)]
    chosen = [(flag, path) for flag, path in paths if not isinstance(path, DefaultOutputFile)]
    check_places(chosen)
    for dest, value in vars(args).items():
        if isinstance(value, DefaultOutputFile):
            problem = place_problem([(name(dest), value), *chosen])
            if problem is not None:
                setattr(args, dest, None)
                off = f"; {value.off} silences this note" if value.off else ""
                note(getattr(args, "command", None) or "", f"{problem}, so it is not written "
                     f"(a default: pass {name(dest)} FILE elsewhere to have it{off})")


def check_places(paths: Sequence[tuple[str, CheckedPath]]) -> None:
    """Refuse an output (file or folder) that is another given path, or lies inside another
    output folder or an input folder (a data folder reads every file in it; a metrics file
    in a checkpoint folder overwrites its files), or holds another output. A checkpoint to
    resume (ResumePath) may be, or lie inside, an output folder."""
    problem = place_problem(paths)
    if problem is not None:
        raise ConfigError(f"{problem}; outputs go outside the checkpoint folder and the data, "
                          f"each to its own place: choose another path{_off(paths, problem)}")


def _off(paths: Sequence[tuple[str, CheckedPath]], problem: str) -> str:
    """How to turn off the output ``problem`` names first, if it can be."""
    for flag, path in paths:
        if (isinstance(path, OutputFile) and path.off
                and problem.startswith(f"{flag} {path} ")):
            return f", or pass {path.off}"
    return ""


def place_problem(paths: Sequence[tuple[str, CheckedPath]]) -> str | None:
    """What ``check_places`` refuses ("FLAG PATH would be written into the folder of FLAG2
    PATH2"), or None."""
    for index, (flag, path) in enumerate(paths):
        if not isinstance(path, (OutputFile, OutputDir)):
            continue
        for other_index, (other_flag, other) in enumerate(paths):
            if other is path or (isinstance(other, (OutputFile, OutputDir))
                                 and other_index < index):
                continue
            clash = _clash(Path(path), Path(other), isinstance(path, OutputDir),
                           isinstance(other, (OutputFile, OutputDir)),
                           isinstance(other, ResumePath))
            if clash == _HOLDS:
                flag, path, other_flag, other = other_flag, other, flag, path
            if clash:
                return (f"{flag} {path} {_INSIDE if clash == _HOLDS else clash} {other_flag} "
                        f"{other}")
    return None


_INSIDE = "would be written into the folder of"
_HOLDS = "holds"  # the other output would be written inside this one's folder


def _clash(output: Path, other: Path, folder: bool, other_output: bool,
           resume: bool) -> str | None:
    """How writing ``output`` (a ``folder`` or a file) would touch ``other`` (an
    ``other_output``, or an input; ``resume``: the checkpoint to resume), or None."""
    if _special(output):  # /dev/stdout, a FIFO: nothing stored
        return None
    try:
        same = output.exists() and other.exists() and os.path.samefile(output, other)
    except OSError:
        same = False
    mine, theirs = output.resolve(), other.resolve()
    if same or mine == theirs:
        return None if folder and resume else f"is the same {'folder' if folder else 'file'} as"
    if theirs in mine.parents and (other_output or other.is_dir()):
        return _INSIDE
    if mine in theirs.parents and folder and other_output:
        return _HOLDS
    return None


def add_fifo_wait(parser: argparse.ArgumentParser | Any) -> None:
    """``--fifo-wait S``: how long an output that is a FIFO waits for its reader."""
    parser.add_argument("--fifo-wait", type=number(minimum=0, maximum=1e7),
                        default=errors.READER_WAIT_S, metavar="S",
                        help="seconds an output that is a FIFO waits for its reader before the "
                        f"command fails (default {errors.READER_WAIT_S:g})")


@contextmanager
def writing_output(command: str, flag: str, path: str | os.PathLike[str],
                   fifo_wait_s: float) -> Iterator[None]:
    """Write output ``path`` (``flag``'s value) inside the block: a FIFO waits up to
    ``fifo_wait_s`` for its reader, with a note, then fails naming it (errors.writing_output)."""
    with errors.writing_output(path, flag, fifo_wait_s, lambda text: note(command, text)):
        yield


def note(command: str, text: str) -> None:
    """A line on stderr about something skipped or worth knowing (never an error)."""
    print(f"pipeoffload {command}: note: {text}", file=sys.stderr, flush=True)


def offload_notes(command: str, report: Any, fetch_on_use: bool,
                  peaks_after: Sequence[float] | None = None) -> None:
    """Notes on an offload plan that will run but does less than asked: FETCH with nothing
    offloaded, or copies that lower no rank's peak (``peaks_after``: the simulated peaks, the
    plan's own by default)."""
    if fetch_on_use and not report.offloaded:
        note(command, "--fetch-on-use has no effect: the plan offloads nothing "
             "(give --offload SPEC, or a po-h / po-f schedule)")
    after = report.peak_after if peaks_after is None else peaks_after
    if report.offloaded and all(a >= b - 1e-9 for a, b in zip(after, report.peak_before)):
        note(command, "the plan copies activations to host memory but lowers no rank's peak, "
             "so the copies only cost host-link time; try a larger --offload target (all, "
             "chunks:K) or another schedule")


def need_torch(command: str) -> None:
    """Refuse a command that needs PyTorch where it is not installed (the pure-Python ones,
    simulate, plan and schedules, run without it)."""
    if importlib.util.find_spec("torch") is None:
        raise ConfigError(f"{command} runs on PyTorch, which is not installed: pip install "
                          "'pipeoffload[torch]' (or torch for your CUDA version, "
                          "https://pytorch.org); simulate, plan and schedules run without it")


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


MATPLOTLIB_MISSING = ("matplotlib is not installed, so {what} was not written; "
                      "pip install 'pipeoffload[plot]' to get it")


class _StandardOutput:
    """``sys.stdout`` whose write errors name it, as a full disk fails a write with an error
    that names no file."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        with writing("standard output"):
            return self._stream.write(text)

    def flush(self) -> None:
        with writing("standard output"):
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _silence(stream: Any) -> None:
    """Point ``stream``'s file at the null device, so that the exit's own flush of what could
    not be written does not fail again."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (a test's capture)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def run_command(command: str, handler: Callable[[argparse.Namespace], int],
                args: argparse.Namespace,
                on_interrupt: Callable[[argparse.Namespace], str] | None = None) -> int:
    """Check ``args``, run ``handler`` and map every expected failure to an `error:` line and
    an exit status (2 input, 1 failed work, 130 interrupted); ``on_interrupt`` adds a word on
    what survives a Ctrl-C. A closed standard output is refused up front; text the terminal's
    encoding cannot show (an ASCII locale, a file name that is not UTF-8) is escaped."""
    prefix = f"pipeoffload {command}: error:"
    if sys.stdout is None:  # started with stdout closed (`>&-`)
        if sys.stderr is not None:
            print(f"{prefix} standard output is closed; redirect it (> FILE, > /dev/null)",
                  file=sys.stderr)
        return INPUT_ERROR
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")
    stdout = sys.stdout
    sys.stdout = _StandardOutput(stdout)
    try:
        check_args(args)
        status = handler(args)
        sys.stdout.flush()
        return status
    except BrokenPipeError:  # the reader (head, less) went away: not an error
        _silence(stdout)
        return 0
    except OSError as error:
        if error.filename == "standard output":
            _silence(stdout)
        where = f"{error.filename}: " if error.filename else ""
        print(f"{prefix} {where}{error.strerror or error}", file=sys.stderr)
        return FAILED
    except PipeoffloadError as error:
        print(f"{prefix} {named_by_origin(str(error), args)}", file=sys.stderr)
        return INPUT_ERROR
    except UnicodeDecodeError as error:
        print(f"{prefix} an input file is not UTF-8 text ({error.reason} at byte "
              f"{error.start}); pass a text file", file=sys.stderr)
        return INPUT_ERROR
    except KeyboardInterrupt:
        extra = on_interrupt(args) if on_interrupt is not None else ""
        print(f"{prefix} interrupted (Ctrl-C){'; ' + extra if extra else ''}", file=sys.stderr)
        return INTERRUPTED
    finally:
        sys.stdout = stdout
