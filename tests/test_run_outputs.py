"""Where a run's outputs may go and what it may delete (issue 40, items 1-5, 14): outputs never
inside the checkpoint folder or the data nor one another, NUL and undecodable bytes refused up
front, --keep-last removes only what a save wrote and never through a symlink, one run per
checkpoint folder (a lock naming its holder), and a requeued run finishes an interrupted export.

Every refusal is checked with a snapshot of the folder before and after: nothing the run did
not write changes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from cli_calls import run
from test_runtime_support import one_thread  # noqa: F401 - autouse fixture

from pipeoffload.parallel import checkpoint as ckpt
from pipeoffload.parallel.checkpoint_files import CheckpointError, tidy
from pipeoffload.parallel.checkpoint_lock import LOCK_FILE, FolderLock, check_unlocked

TRAIN = ["train", "--model", "tiny", "--pp", "1", "--batch-size", "4", "--microbatches", "2",
         "--steps", "1", "--no-png", "--no-baseline"]


def snapshot(root: Path) -> dict[str, str]:
    """Every file and link under ``root``: its SHA-256 (or link target)."""
    found = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            found[key] = "-> " + os.readlink(path)
        elif path.is_file():
            found[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif path.is_dir():
            found[key] = "dir"
    return found


@pytest.fixture
def place(tmp_path: Path, monkeypatch) -> Path:
    """A data folder, a checkpoint folder with one (fake) step folder, a config file."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("some text to train on " * 40)
    step = tmp_path / "ck" / "step_00000002"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text('{"files": {}}\n')
    (tmp_path / "tb").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path


OUTPUT_CASES = [  # (argv, the words of the error line)
    (["--checkpoint-dir", "ck", "--metrics", "ck/step_00000002/manifest.json"],
     "--metrics ck/step_00000002/manifest.json would be written into the folder of "
     "--checkpoint-dir ck"),
    (["--resume", "ck/step_00000002", "--metrics", "ck/step_00000002/manifest.json"],
     "--metrics ck/step_00000002/manifest.json would be written into the folder of --resume"),
    (["--checkpoint-dir", "ck", "--tensorboard", "ck/tb"],
     "--tensorboard ck/tb would be written into the folder of --checkpoint-dir ck"),
    (["--checkpoint-dir", "ck", "--png", "ck/p.png"], "--png ck/p.png would be written into"),
    (["--checkpoint-dir", "ck", "--export-hf", "ck"], "--checkpoint-dir ck is the same folder as "
     "--export-hf ck"),
    (["--data", "data", "--export-hf", "data/ex"], "--export-hf data/ex would be written into "
     "the folder of --data data"),
    (["--data", "data", "--checkpoint-dir", "data/ck"], "--checkpoint-dir data/ck would be "
     "written into the folder of --data data"),
    (["--data", "data", "--tensorboard", "data"], "--tensorboard data is the same folder as "
     "--data"),
    (["--data", "data", "--tensorboard", "data/tb"], "--tensorboard data/tb would be written "
     "into the folder of --data data"),
    (["--checkpoint-dir", "ck", "--resume", "auto", "--metrics", "{binary}"],
     "--metrics binary.jsonl: not UTF-8 text (near byte 1"),
    (["--tensorboard", "tb", "--metrics", "tb/m.jsonl"], "--metrics tb/m.jsonl would be written "
     "into the folder of --tensorboard tb"),
    (["--export-hf", "out", "--tensorboard", "out/tb"], "--tensorboard out/tb would be written "
     "into the folder of --export-hf out"),
    (["--config", "{nul}"], "--config nul.toml: checkpoint-dir 'c\\x00k': contains a NUL"),
    (["--checkpoint-dir", "ck\udcff"], "--checkpoint-dir ck\\xff: is not UTF-8"),
    (["--metrics", "m\udcfe.jsonl"], "--metrics m\\xfe.jsonl: is not UTF-8"),
    (["--metrics", "{fifo}"], "is a pipe or device, which would stall the run"),
    (["--data", "data", "--png", "data/p.png"], "--png data/p.png would be written into the "
     "folder of --data data; outputs go outside the checkpoint folder and the data, each to "
     "its own place: choose another path, or pass --no-png"),
]


@pytest.mark.parametrize("argv, words", OUTPUT_CASES)
def test_outputs_stay_out_of_checkpoints_data_and_one_another(argv, words, place, capsys,
                                                              no_training) -> None:
    (place / "nul.toml").write_text('checkpoint-dir = "c\\u0000k"\n')
    if hasattr(os, "mkfifo"):
        os.mkfifo(place / "fifo")
    (place / "binary.jsonl").write_bytes(b'{\xff"step": 1}\n')  # read back by a resumed run
    argv = [a.replace("{nul}", "nul.toml").replace("{fifo}", "fifo")
            .replace("{binary}", "binary.jsonl") for a in argv]
    before = snapshot(place)
    code, err = run([*TRAIN, *argv], capsys)
    assert code == 2 and no_training == [], err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in err, err
    assert snapshot(place) == before


def test_a_resume_inside_its_own_checkpoint_folder_is_still_accepted(place, capsys,
                                                                     no_training) -> None:
    code, err = run([*TRAIN, "--checkpoint-dir", "ck", "--resume", "ck/step_00000002",
                     "--metrics", "m.jsonl"], capsys)
    assert "would be written into" not in err and "is the same" not in err, err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_picture_fifo_nobody_reads_ends_the_run_after_the_wait(place, capsys) -> None:
    """--png may be a FIFO (the picture is written once, at the end); with no reader the run
    used to block for ever there. --metrics, written all along, still refuses a FIFO."""
    os.mkfifo(place / "p.png")
    argv = [a for a in TRAIN if a != "--no-png"]
    code, err = run([*argv, "--data", "data", "--eval-fraction", "0", "--png", "p.png",
                     "--fifo-wait", "0.2"], capsys)
    assert code == 2, err
    assert err.splitlines()[-2:] == [
        "pipeoffload train: note: waiting up to 0.2 s for a reader on FIFO p.png",
        "pipeoffload train: error: --png p.png: no reader opened this FIFO within 0.2 s "
        "(--fifo-wait); start its reader first, or name a regular file"]


@pytest.mark.parametrize("flag", ["--checkpoint-dir", "--data"])
def test_the_default_picture_is_skipped_where_it_would_land_in_a_chosen_folder(
        flag, place, capsys, monkeypatch, no_training) -> None:
    """`train --checkpoint-dir .` (or `--data .`) was refused for the default picture, a file
    the user never named: now that picture is skipped with a note and the run starts."""
    monkeypatch.chdir(place / "data")
    before = snapshot(place)
    argv = [a for a in TRAIN if a != "--no-png"]
    code, err = run([*argv, flag, ".", "--eval-fraction", "0"], capsys)
    assert code == 0 and no_training, err
    assert (f"pipeoffload train: note: --png pipeoffload-train.png would be written into the "
            f"folder of {flag} ., so it is not written (a default: pass --png FILE elsewhere "
            "to have it; --no-png silences this note)") in err.splitlines(), err
    assert "error:" not in err
    assert snapshot(place) == before


def _complete_step(root: Path, step: int, extra: dict[str, bytes] | None = None) -> Path:
    """A step folder as a save leaves it: stage and rank files, then the manifest."""
    folder = ckpt.step_folder(root, step)
    records = [ckpt.write_atomic(folder / name, data) for name, data in
               {"stage_000.pt": b"s%d" % step, "rank_00000.pt": b"r%d" % step,
                **(extra or {})}.items()]
    ckpt.write_manifest(folder, step, records, {"run": "r"})
    return folder


def test_keep_last_removes_only_what_saves_wrote_never_through_a_link(tmp_path: Path) -> None:
    root, outside = tmp_path / "ck", tmp_path / "outside"
    old = _complete_step(root, 1, {"config.toml": b"settings"})
    (old / "notes.txt").write_text("mine")  # not the run's: stays, and so does its folder
    _complete_step(outside, 2)
    os.symlink(outside / "step_00000002", root / "step_00000002")  # a linked step folder
    _complete_step(root, 3)
    torn = root / "step_00000000"  # an older killed save: only its own files go
    torn.mkdir()
    (torn / "stage_000.pt").write_bytes(b"half")
    (torn / "config.toml").write_bytes(b"half")
    (torn / "keep.bin").write_bytes(b"user")
    _complete_step(root, 4)
    outside_before = snapshot(outside)
    retired = tidy(root, 1, ["config.toml"])
    assert sorted(p.name for p in retired) == ["step_00000000", "step_00000001",
                                               "step_00000003"]
    assert snapshot(outside) == outside_before  # the link was not followed
    assert (root / "step_00000002").is_symlink()
    assert sorted(p.name for p in old.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in torn.iterdir()) == ["keep.bin"]
    assert not (root / "step_00000003").exists()
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000002",
                                                                "step_00000004"]


def test_one_run_per_checkpoint_folder_and_a_dead_holder_is_stale(tmp_path: Path, capsys,
                                                                  monkeypatch) -> None:
    root = tmp_path / "ck"
    monkeypatch.chdir(tmp_path)
    held = FolderLock.acquire(root)
    try:
        before = snapshot(tmp_path)
        code, err = run([*TRAIN, "--checkpoint-dir", "ck", "--resume", "auto"], capsys)
        assert code == 2 and snapshot(tmp_path) == before, err
        lines = [line for line in err.splitlines() if "error:" in line]
        assert len(lines) == 1 and "Traceback" not in err, err
        assert f"--checkpoint-dir ck is in use by another run (pid {os.getpid()} on host " \
            in lines[0], err
        # The trainer takes the lock too (two runs that both passed the up-front check).
        from test_train import run_inline, tiny_config

        with pytest.raises(CheckpointError, match="in use by another run"):
            run_inline(tiny_config(pp=1, steps=1, microbatches=2, measure_baseline=False,
                                   checkpoint_dir=str(root)))
        assert not ckpt.complete_checkpoints(root)
    finally:
        held.release()
    # The up-front checks of one job's ranks run at once: one's probe never refuses another's.
    import fcntl

    probe = os.open(root / LOCK_FILE, os.O_RDONLY)
    try:
        fcntl.flock(probe, fcntl.LOCK_SH)
        check_unlocked(root)
    finally:
        os.close(probe)
    # A holder killed without releasing: the kernel dropped its flock, the file names it still.
    subprocess.run([sys.executable, "-c", "import os, sys; from pipeoffload.parallel."
                    "checkpoint_lock import FolderLock; FolderLock.acquire(sys.argv[1]); "
                    "os._exit(9)", str(root)], check=False)
    assert "pid" in (root / LOCK_FILE).read_text()
    FolderLock.acquire(root).release()
    assert (root / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} ")


def test_a_requeued_run_finishes_an_interrupted_export(tmp_path: Path, capsys,
                                                       monkeypatch) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    monkeypatch.chdir(tmp_path)
    transformers.LlamaConfig(vocab_size=256, hidden_size=16, intermediate_size=32,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                             max_position_embeddings=32, head_dim=8).save_pretrained("llama")
    Path("text.txt").write_text("a small text to train a tiny model on, twice over. " * 40)
    argv = ["train", "--model", "llama/config.json", "--data", "text.txt", "--seq-len", "16",
            "--batch-size", "4", "--pp", "1", "--steps", "1", "--no-png", "--no-baseline",
            "--checkpoint-dir", "ck", "--resume", "auto", "--export-hf", "ex"]
    code, err = run(argv, capsys)
    assert code == 0, err
    whole = snapshot(tmp_path / "ex")
    # Killed while exporting: the weights half written, config.json (written last) missing.
    (tmp_path / "ex" / "config.json").unlink()
    (tmp_path / "ex" / "model.safetensors").write_bytes(b"torn")
    (tmp_path / "ex" / ".model.safetensors.x1.tmp").write_bytes(b"torn")
    checkpoints = snapshot(tmp_path / "ck")
    code, err = run(argv, capsys)
    assert code == 0, err
    assert "finishing the export to ex" in err
    assert snapshot(tmp_path / "ex") == whole  # the same bytes as the uninterrupted export
    assert snapshot(tmp_path / "ck") == checkpoints
    # Rerun once more: complete, nothing to do. A file no export writes is never removed.
    code, err = run(argv, capsys)
    assert code == 0 and "the export in ex is complete" in err, err
    (tmp_path / "ex" / "config.json").unlink()
    (tmp_path / "ex" / "notes.txt").write_text("mine")
    code, err = run(argv, capsys)
    assert code == 2 and "'notes.txt', which no export writes" in err, err
    assert (tmp_path / "ex" / "notes.txt").read_text() == "mine"


@pytest.fixture
def file_size_limit():
    """Sets the file-size limit (RLIMIT_FSIZE, as a quota or ulimit -f would) for a moment;
    Python ignores SIGXFSZ, so a write past it fails with EFBIG, an error naming no file."""
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    def limit(nbytes: int | None) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft if nbytes is None else nbytes, hard))

    yield limit
    limit(None)


def test_a_file_size_limit_or_full_disk_names_the_file(tmp_path: Path, file_size_limit) -> None:
    import errno

    from pipeoffload.training.metrics import MetricsConfig, MetricsWriter

    target = tmp_path / "ck" / "step_00000001" / "stage_000.pt"
    writer = MetricsWriter(MetricsConfig(jsonl=str(tmp_path / "m.jsonl")), 0)
    errors = []
    for write in (lambda: ckpt.write_atomic(target, b"x" * 4096),
                  lambda: writer.write_eval(1, 2.0)):
        file_size_limit(16)
        try:
            write()
        except OSError as error:
            errors.append(error)
        finally:
            file_size_limit(None)
    writer.close()
    assert [(e.errno, e.filename) for e in errors] == [
        (errno.EFBIG, str(target)), (errno.EFBIG, str(tmp_path / "m.jsonl"))]
    assert sorted(p.name for p in target.parent.iterdir()) == []  # no temporary file left


def test_tensorboard_on_a_full_disk_stops_its_events_with_one_note(tmp_path: Path, capsys,
                                                                   file_size_limit) -> None:
    pytest.importorskip("tensorboard")
    from test_train import tiny_config

    from pipeoffload.cli.progress import Reporter
    from pipeoffload.cli.train_report import ReportOptions
    from pipeoffload.parallel.topology import Topology

    report = ReportOptions(json=False, png=None, log_every=1, threads=1,
                           metrics=str(tmp_path / "m.jsonl"), tensorboard=str(tmp_path / "tb"),
                           peak_flops_per_s=None)
    reporter = Reporter(tiny_config(), report, Topology.local(1), sys.stdout)
    reporter.held_out(0, 3.0)  # opens both writers, the event file's header written
    events = next((tmp_path / "tb").iterdir())
    file_size_limit(events.stat().st_size)  # the disk is full from now on
    try:
        reporter.held_out(1, 2.5)
        reporter.held_out(2, 2.0)
    finally:
        file_size_limit(None)
    reporter.close()
    for thread in threading.enumerate():  # the event writer's thread ends after its hook ran
        if type(thread).__name__ == "_AsyncWriterThread":
            thread.join()
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err
    notes = [line for line in err.splitlines() if "--tensorboard" in line]
    assert len(notes) == 1 and f"--tensorboard {tmp_path / 'tb'}: File too large" in notes[0]
    assert "no more TensorBoard events are written (the run goes on" in notes[0]
    assert [json.loads(line)["step"] for line in (tmp_path / "m.jsonl").read_text().splitlines()
            ] == [0, 1, 2]  # --metrics goes on (its file is still smaller than the limit)


def test_the_picture_draws_one_collection_per_lane_and_colour(tmp_path: Path,
                                                              monkeypatch) -> None:
    """Not one per action: at p = 64, m = 512 that was over 300 s of CPU (docs/benchmarks.md);
    nor one per copy that takes no time (a tick), which kept po-f there at 49 s."""
    pytest.importorskip("matplotlib")
    from matplotlib.collections import LineCollection, PolyCollection
    from matplotlib.figure import Figure

    import pipeoffload as po
    from pipeoffload.sim.costs import CostModel
    from pipeoffload.sim.render_png import render_png
    from pipeoffload.sim.simulator import simulate

    figures = []
    real_save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig),
                                                                  real_save(fig, *a, **k)))
    result = simulate(po.build_schedule("po-f", pp=2, microbatches=8), CostModel())
    render_png(result, tmp_path / "p.png")
    gantts = [ax for ax in figures[0].axes if ax.get_yticklabels()
              and ax.get_yticklabels()[0].get_text() == "compute"]
    assert len(gantts) == 2
    for rank, ax in enumerate(gantts):
        bars = [c for c in ax.collections if isinstance(c, PolyCollection)]
        timed = [t for t in result.timeline[rank] if t.end > t.start]
        kinds = {(t.lane, t.action.kind, result.schedule.chunk_of(t.action.stage))
                 for t in timed}
        assert len(bars) == len(kinds) < len(timed)
        assert sum(len(c.get_paths()) for c in bars) == len(timed)  # every action drawn
        ticks = [c for c in ax.collections if isinstance(c, LineCollection)]
        free = [t for t in result.timeline[rank]
                if t.end == t.start and t.lane.value in ("d2h", "h2d")]
        groups = {(t.lane, t.action.kind, result.schedule.chunk_of(t.action.stage))
                  for t in free}
        assert free and len(ticks) == len(groups) < len(free)
        assert sum(len(c.get_segments()) for c in ticks) == len(free)


def test_an_interrupted_export_with_its_tokenizer_files_is_cleared_but_a_foreign_file_is_not(
        tmp_path: Path) -> None:
    from pipeoffload.errors import ConfigError
    from pipeoffload.parallel.export import clear_unfinished_export

    written = ["model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", ".config.json.tmp"]
    for name in written:  # everything an export writes before config.json, its last file
        (tmp_path / name).write_text("x")
    clear_unfinished_export(tmp_path)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "tokenizer.json").write_text("x")
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="'notes.txt', which no export writes"):
        clear_unfinished_export(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "tokenizer.json"]


@pytest.mark.parametrize("argv, line", [
    (["export", ".", "out"], "pipeoffload export: error: DIR out would be written into the "
     "folder of CHECKPOINT .; outputs go outside the checkpoint folder and the data, each to "
     "its own place: choose another path"),
    (["tokenize", "missing", "out", "--tokenizer", "t.json"],
     "pipeoffload tokenize: error: DATA missing: does not exist"),
    (["train", "--model", "tiny", "--steps", "1", "--no-png"],
     "pipeoffload train: error: the reference model's 4 layers (--layers) cannot fill 8 "
     "pipeline stages (--pp 4 x 2 stages per rank; each needs a layer); lower --pp or --chunks, "
     "or raise --layers"),
    (["train", "--model", "tiny", "--pp", "1", "--steps", "1", "--no-png", "--dim", "31"],
     "pipeoffload train: error: --dim 31 is not divisible by --heads 4; choose --dim = --heads "
     "x the head width"),
])
def test_refusals_name_what_the_user_typed(argv, line, place, capsys, no_training) -> None:
    """A positional argument was named as a flag no command has (`--output out`, `--checkpoint
    .`), too few layers for the default layout named no flag at all, and a model shape named
    ModelConfig's fields, not the flags (issue 40 item 22)."""
    code, err = run(argv, capsys)
    assert code == 2 and no_training == []
    assert err.strip().splitlines()[-1] == line
