"""The command line with pipes, FIFOs, closed or full output, odd encodings and odd specs:
every case ends in the command's output or one `error:` line, never a hang or a traceback
(issue 25, point 9)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cli_calls import run

from pipeoffload.checks import parse_json
from pipeoffload.cli.main import _grid_width, main
from pipeoffload.core.text import read_csv, to_csv_text
from pipeoffload.errors import ConfigError
from pipeoffload.offload.targets import TargetKind, parse_target

CLI = [sys.executable, "-m", "pipeoffload.cli"]
SIMULATE = [*CLI, "simulate", "--pp", "2", "--no-grid"]


def _run(args, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=kwargs.pop("capture", True), text=True,
                          **kwargs)


@pytest.fixture
def plan_csv(tmp_path: Path) -> Path:
    path = tmp_path / "plan.csv"
    done = _run([*SIMULATE, "--csv", str(path)])
    assert done.returncode == 0, done.stderr
    return path


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_an_output_fifo_gets_the_csv_when_its_reader_comes_after_the_command(tmp_path,
                                                                           plan_csv):
    """The check used to open the FIFO: it blocked until a reader came, then closed it, so
    the reader saw an empty stream and the real write blocked for ever."""
    fifo = tmp_path / "out.csv"
    os.mkfifo(fifo)
    command = subprocess.Popen([*SIMULATE, "--csv", str(fifo)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    try:
        got = fifo.read_text()  # opened after the command started, read to its end
        assert command.wait() == 0, command.stderr.read() if command.stderr else ""
    finally:
        command.kill()
        command.wait()
    assert got == plan_csv.read_text()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_an_output_fifo_gets_the_picture_when_its_reader_comes_after_the_command(tmp_path):
    """matplotlib seeks in the file it writes, which a FIFO cannot: the picture is drawn in
    memory and written in one go."""
    fifo = tmp_path / "out.png"
    os.mkfifo(fifo)
    command = subprocess.Popen([*SIMULATE, "--png", str(fifo)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    try:
        got = fifo.read_bytes()
        assert command.wait() == 0, command.stderr.read() if command.stderr else ""
    finally:
        command.kill()
        command.wait()
    assert got.startswith(b"\x89PNG\r\n")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("flag", ["--csv", "--trace", "--png"])
def test_an_output_fifo_nobody_reads_ends_in_an_error_after_the_wait(tmp_path, capsys, flag):
    """A FIFO without a reader used to block the command for ever; now it waits --fifo-wait
    seconds (said once on stderr), then fails naming the FIFO, which it leaves as it was."""
    fifo = tmp_path / ("out.png" if flag == "--png" else "out")
    os.mkfifo(fifo)
    code, err = run(["simulate", "--pp", "2", "--no-grid", flag, str(fifo), "--fifo-wait",
                     "0.2"], capsys)
    assert code == 2
    assert err.splitlines() == [
        f"pipeoffload simulate: note: waiting up to 0.2 s for a reader on FIFO {fifo}",
        f"pipeoffload simulate: error: {flag} {fifo}: no reader opened this FIFO within 0.2 s "
        "(--fifo-wait); start its reader first, or name a regular file"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.parametrize("how", ["stdin", "pipe"])
def test_a_schedule_from_a_pipe_is_read_once(plan_csv, how):
    if how == "stdin":
        with open(plan_csv) as source:
            done = _run([*CLI, "simulate", "--from-csv", "/dev/stdin", "--json"], stdin=source)
    else:
        read_end, write_end = os.pipe()
        writer = threading.Thread(target=lambda: (os.write(write_end, plan_csv.read_bytes()),
                                                  os.close(write_end)))
        writer.start()
        done = _run([*CLI, "simulate", "--from-csv", f"/dev/fd/{read_end}", "--json"],
                    pass_fds=(read_end,))
        writer.join()
        os.close(read_end)
    assert done.returncode == 0, done.stderr
    assert '"offload": "given"' in done.stdout  # the transfers arrived with the file


def test_closed_standard_output_is_refused_in_one_line():
    done = _run(SIMULATE, preexec_fn=lambda: os.close(1))
    assert done.returncode == 2
    assert done.stderr.strip() == ("pipeoffload simulate: error: standard output is closed; "
                                   "redirect it (> FILE, > /dev/null)")


def test_an_ascii_terminal_gets_escapes_instead_of_a_traceback(tmp_path):
    target = tmp_path / "plän.csv"
    done = _run([*SIMULATE, "--csv", str(target)],
                env={**os.environ, "PYTHONIOENCODING": "ascii", "PYTHONUTF8": "0"})
    assert done.returncode == 0, done.stderr
    assert "wrote csv: " in done.stdout and "pl\\xe4n.csv" in done.stdout
    assert target.exists()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_a_full_disk_names_the_file_it_could_not_write():
    done = _run([*SIMULATE, "--csv", "/dev/full"])
    assert done.returncode == 1
    assert done.stderr.strip() == ("pipeoffload simulate: error: /dev/full: No space left on "
                                   "device")
    with open("/dev/full", "w") as full:
        done = _run([*CLI, "schedules"], stdout=full, stderr=subprocess.PIPE, capture=False)
    assert done.returncode == 1
    assert done.stderr.strip() == ("pipeoffload schedules: error: standard output: No space "
                                   "left on device")


def test_a_csv_with_a_byte_order_mark_loads(tmp_path, plan_csv):
    marked = tmp_path / "marked.csv"
    marked.write_bytes(b"\xef\xbb\xbf" + plan_csv.read_bytes())
    assert to_csv_text(read_csv(marked)) == plan_csv.read_text()


@pytest.mark.parametrize("argv,says", [
    (["simulate", "--csv", "{a}", "--trace", "{a}"], "--csv {a} is the same file as --trace"),
    (["simulate", "--from-csv", "{csv}", "--csv", "{csv}"], "is the same file as --from-csv"),
    (["train", "--data", "{dir}", "--png", "{dir}/pic.png"],
     "would be written into the folder of --data"),
    (["train", "--data", "{dir}/pic.png", "--png", "{dir}/pic.png"],
     "is the same file as --data"),
])
def test_an_output_may_not_overwrite_an_input_or_another_output(tmp_path, capsys, plan_csv,
                                                                argv, says):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "pic.png").write_text("text that happens to be named .png\n")
    names = {"a": str(tmp_path / "a.out"), "csv": str(plan_csv), "dir": str(folder)}
    assert main([part.format(**names) for part in argv]) == 2
    assert says.format(**names) in capsys.readouterr().err
    assert (folder / "pic.png").read_text().startswith("text")


def test_a_deeply_nested_json_file_is_an_error_not_a_recursion(tmp_path, capsys):
    deep = tmp_path / "model.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match="nested too deeply"):
        parse_json(deep.read_text(), str(deep))
    assert main(["plan", "--model", str(deep), "--gpus", "8"]) == 2
    assert f"{deep}: JSON nested too deeply" in capsys.readouterr().err


@pytest.mark.parametrize("spec,says", [
    ("", "is empty"),
    ("   ", "is empty"),
    ("none:5", "none takes no value"),
    ("all:0.3", "all takes no value"),
    ("given:7", "given takes no value"),
    ("chunks:\u00b2", "K must be a whole number >= 1 (digits 0-9)"),
    ("chunks:\u0663", "K must be a whole number >= 1 (digits 0-9)"),  # Arabic-Indic three
    ("limit:1e308GiB", "in bytes it overflows"),
])
def test_offload_specs_that_say_nothing_clear_are_refused_by_name(spec, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        parse_target(spec)


@pytest.mark.parametrize("spec,kind", [(" ALL", TargetKind.ALL), ("Chunks: 2", TargetKind.CHUNKS),
                                       ("LIMIT:2GiB", TargetKind.LIMIT)])
def test_offload_specs_ignore_case_and_spaces(spec, kind):
    assert parse_target(spec).kind is kind


@pytest.mark.parametrize("spec,says", [
    ("", "--offload '': empty; use none, all"),
    ("given", "train builds its schedule by name"),
    ("none:5", "--offload: offload target 'none:5': none takes no value"),
    ("bogus", "--offload 'bogus': unknown; use none, all, chunks:K"),
])
def test_train_offload_specs_are_checked_when_the_config_is_made(spec, says):
    pytest.importorskip("torch")
    from pipeoffload.training.train import TrainConfig, train_offload

    with pytest.raises(ConfigError, match=re.escape(says)):
        TrainConfig(offload=spec)
    assert train_offload("  Recompute-Chunks:1+ALL ") == "recompute-chunks:1+all"
    assert train_offload(" All") == "all"


@pytest.mark.parametrize("columns,width", [("\u00b2", None), ("12\u00b2", None), ("", None),
                                           (" 150 ", 150)])
def test_columns_takes_ascii_digits_only(monkeypatch, columns, width):
    monkeypatch.setenv("COLUMNS", columns)
    assert _grid_width(None) == width


def test_simulate_refuses_an_empty_offload_instead_of_using_the_default(capsys):
    assert main(["simulate", "--pp", "2", "--offload", ""]) == 2
    assert "offload target '' is empty" in capsys.readouterr().err
