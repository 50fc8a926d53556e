"""Checkpoint folders on long runs: step folders past 10^8 are found, dangling symlinks refused
before training, foreign stage files and manifest paths that escape the step folder refused
without being read, stale temporary files cleaned, ``--keep-last`` retention."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_runtime_support import one_thread  # noqa: F401 - autouse fixture
from test_train import run_inline
from test_train import tiny_config as tiny_batch16

from pipeoffload.cli.main import main
from pipeoffload.cli.train_options import config_error
from pipeoffload.errors import FieldError
from pipeoffload.parallel import checkpoint as ckpt
from pipeoffload.parallel import checkpoint_files
from pipeoffload.parallel.checkpoint import CheckpointError
from pipeoffload.parallel.checkpoint_lock import LOCK_FILE


def tiny_config(**changes):
    """The tests' tiny run with a batch of 4 sequences in 2 microbatches (quick on 2 cores)."""
    config = tiny_batch16(microbatches=2)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, batch_size=4))
    return dataclasses.replace(config, **changes)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple:
    """Two runs of the same shapes (seeds 0 and 1), checkpoints at steps 1 and 2."""
    roots = []
    for seed in (0, 1):
        root = tmp_path_factory.mktemp(f"seed{seed}")
        run_inline(tiny_config(pp=2, steps=2, seed=seed, checkpoint_every=1,
                               measure_baseline=False, checkpoint_dir=str(root)))
        roots.append(root)
    return tiny_config(pp=2, steps=3, measure_baseline=False, resume="latest"), roots


def copy(root: Path, dest: Path) -> Path:
    shutil.copytree(root, dest)
    return dest


def rewrite_manifest(folder: Path, **changes) -> None:
    """Edit a manifest and re-hash every file it lists, as someone patching it by hand would."""
    path = folder / "manifest.json"
    body = json.loads(path.read_text())
    body.update(changes)
    for name, record in body["files"].items():
        data = (folder / name).read_bytes() if (folder / name).is_file() else b""
        record.update(size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    path.write_text(json.dumps(body))


def test_step_folders_are_found_by_their_number_past_10_to_the_8(two_runs,
                                                                  tmp_path: Path) -> None:
    _, (root, _) = two_runs
    root = copy(root, tmp_path / "ck")
    big = root / "step_100000002"
    shutil.copytree(root / "step_00000002", big)
    rewrite_manifest(big, step=100000002)
    names = ["step_00000001", "step_00000002", "step_99999999", "step_100000002",
             "step_1234567890123"]
    (root / "step_99999999").mkdir()
    (root / "step_1234567890123").mkdir()  # incomplete: no manifest
    assert [f.path.name for f in checkpoint_files.step_folders(root)] == names
    assert ckpt.find_checkpoint("latest", root) == big
    assert ckpt.complete_checkpoints(root)[-1] == big
    assert "resuming from" in ckpt.describe_resume("latest", root)
    assert "skipping newer step_1234567890123" in ckpt.describe_resume("latest", root)
    # Its stage files still say step 2: resuming it is refused, not silently mixed.
    config, _ = two_runs
    with pytest.raises(CheckpointError, match="belongs to another checkpoint"):
        run_inline(dataclasses.replace(config, checkpoint_dir=str(root), steps=100000004))
    # A folder whose name and manifest disagree (copied or renamed) is refused.
    shutil.copytree(root / "step_00000002", root / "step_00000003")
    with pytest.raises(CheckpointError, match="records step 2, but its folder is step_00000003"):
        ckpt.read_manifest(root / "step_00000003")


def test_a_dangling_checkpoint_dir_symlink_is_refused_before_training(tmp_path: Path,
                                                                      capsys) -> None:
    link = tmp_path / "ck"
    link.symlink_to(tmp_path / "gone" / "target")
    argv = ["train", "--model", "tiny", "--pp", "2", "--inline", "--no-png", "--steps", "1",
            "--checkpoint-dir", str(link)]
    assert main(argv) == 2
    err = capsys.readouterr()
    assert "--checkpoint-dir" in err.err and "is a symlink to" in err.err
    assert "step" not in err.out  # nothing trained
    steps = []
    with pytest.raises(CheckpointError, match="is a symlink to .* which does not exist"):
        from pipeoffload.parallel.topology import Topology
        from pipeoffload.training.trainer import train

        train(tiny_config(pp=2, steps=1, checkpoint_dir=str(link)), Topology.local(2),
              on_step=steps.append)
    assert steps == []


@pytest.mark.parametrize("donor", ["other seed", "other step"])
def test_a_foreign_stage_file_is_refused_even_with_a_rehashed_manifest(
        two_runs, tmp_path: Path, donor: str) -> None:
    config, (root, other) = two_runs
    root = copy(root, tmp_path / "ck")
    target = root / "step_00000002"
    source = (other / "step_00000002" if donor == "other seed"
              else root / "step_00000001") / "stage_001.pt"
    shutil.copy(source, target / "stage_001.pt")
    rewrite_manifest(target)
    ckpt.read_manifest(target)  # the checksums match: only the file's identity tells
    with pytest.raises(CheckpointError, match=r"stage_001.pt belongs to another checkpoint"):
        run_inline(dataclasses.replace(config, checkpoint_dir=str(root)))
    # Another run with the same seed is another run too.
    same_seed = tmp_path / "again"
    run_inline(tiny_config(pp=2, steps=2, measure_baseline=False,
                           checkpoint_dir=str(same_seed)))
    shutil.copy(same_seed / "step_00000002" / "rank_00000.pt", target / "rank_00000.pt")
    shutil.copy(two_runs[1][0] / "step_00000002" / "stage_001.pt", target / "stage_001.pt")
    rewrite_manifest(target)
    with pytest.raises(CheckpointError, match=r"rank_00000.pt belongs to another checkpoint"):
        run_inline(dataclasses.replace(config, checkpoint_dir=str(root)))


def _watch_opens(monkeypatch) -> list[str]:
    opened: list[str] = []
    real = os.open

    def recording(path, flags, *args, **kwargs):
        opened.append(str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(checkpoint_files.os, "open", recording)
    return opened


@pytest.mark.timeout(120)  # a FIFO opened for reading without O_NONBLOCK would hang here
@pytest.mark.parametrize("name, message", [
    ("/dev/zero", "not a file name inside the checkpoint folder"),
    ("../../etc/hostname", "not a file name inside the checkpoint folder"),
    ("sub/stage_000.pt", "not a file name inside the checkpoint folder"),
    ("..", "not a file name inside the checkpoint folder"),
    ("fifo", "is not a plain file"),
    ("link", "is a symlink"),
    ("big", "refused unread"),
])
def test_manifest_paths_are_only_plain_files_inside_the_step_folder(
        two_runs, tmp_path: Path, monkeypatch, name: str, message: str) -> None:
    config, (root, _) = two_runs
    root = copy(root, tmp_path / "ck")
    folder = root / "step_00000002"
    body = json.loads((folder / "manifest.json").read_text())
    if "/" in name or name == "..":  # a path out of the folder, listed in the manifest
        body["files"][name] = {"size_bytes": 1, "sha256": "0" * 64}
    else:  # stage_001.pt itself replaced by a FIFO, a symlink, or recorded as 10^15 bytes
        stage = folder / "stage_001.pt"
        if name == "fifo":
            stage.unlink()
            os.mkfifo(stage)
        elif name == "link":
            stage.unlink()
            stage.symlink_to("/etc/hostname")
        else:
            body["files"]["stage_001.pt"]["size_bytes"] = 10**15
    (folder / "manifest.json").write_text(json.dumps(body))
    opened = _watch_opens(monkeypatch)
    with pytest.raises(CheckpointError, match=message):
        ckpt.read_manifest(folder)
    with pytest.raises(CheckpointError, match=message):
        run_inline(dataclasses.replace(config, checkpoint_dir=str(root)))
    opened = [p for p in opened if Path(p) != root / LOCK_FILE]  # the run's folder lock
    assert opened and all(Path(p).parent == folder for p in opened), opened


def test_a_completed_save_removes_stale_temporary_files(two_runs, tmp_path: Path) -> None:
    config, (root, _) = two_runs
    root = copy(root, tmp_path / "ck")
    stale = [root / "step_00000002" / ".stage_000.pt.k3j4.tmp",
             root / "step_00000003" / ".rank_00000.pt.x9.tmp"]  # a killed save of step 3
    stale[1].parent.mkdir()
    for path in stale:
        path.write_bytes(b"partial")
    keep = root / "step_00000002" / "notes.txt"  # not ours: left alone
    keep.write_text("mine")
    run_inline(dataclasses.replace(config, checkpoint_dir=str(root)))
    assert not any(p.exists() for p in stale)
    assert keep.read_text() == "mine"
    assert ckpt.find_checkpoint("latest", root).name == "step_00000003"


def test_keep_last_retires_old_checkpoints_and_never_the_newest(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    base = tiny_config(pp=2, steps=4, checkpoint_every=1, measure_baseline=False,
                       checkpoint_dir=str(root), keep_last=2)
    run_inline(base)
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000003",
                                                                "step_00000004"]
    torn = root / "step_00000001"  # an older save that was killed: removed with the old ones
    torn.mkdir()
    (torn / "stage_000.pt").write_bytes(b"half")
    newer_torn = root / "step_00000009"  # newer than the run: not touched
    newer_torn.mkdir()
    run_inline(dataclasses.replace(base, steps=5, keep_last=1, resume="latest"))
    assert sorted(p.name for p in root.iterdir() if p.name != LOCK_FILE) == ["step_00000005",
                                                                         "step_00000009"]
    assert ckpt.read_manifest(root / "step_00000005").step == 5
    # Without --keep-last everything stays, as before.
    run_inline(dataclasses.replace(base, steps=7, keep_last=None, resume="latest"))
    assert [p.name for p in ckpt.complete_checkpoints(root)] == ["step_00000005",
                                                                "step_00000006",
                                                                "step_00000007"]
    with pytest.raises(FieldError) as caught:
        dataclasses.replace(base, keep_last=0)
    assert caught.value.fields == ("keep_last", "checkpoint_dir")
    assert str(config_error(caught.value)) == "--keep-last 0 needs --checkpoint-dir and N >= 1"


def test_resume_auto_starts_from_scratch_then_continues(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    base = tiny_config(pp=2, measure_baseline=False, checkpoint_dir=str(root), resume="auto")
    first = run_inline(dataclasses.replace(base, steps=2))
    second = run_inline(dataclasses.replace(base, steps=4))
    straight = run_inline(dataclasses.replace(base, steps=4, checkpoint_dir=str(tmp_path / "s")))
    assert (first.start_step, second.start_step) == (0, 2)
    assert first.losses + second.losses == straight.losses
    with pytest.raises(FieldError, match="TrainConfig.resume auto needs "
                       "TrainConfig.checkpoint_dir") as caught:
        dataclasses.replace(base, checkpoint_dir=None)
    assert str(config_error(caught.value)).startswith("--resume auto needs --checkpoint-dir")
