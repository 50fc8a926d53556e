"""Training checkpoints that survive a crash at any moment: per-stage files, then a manifest.

Layout: ``<root>/step_<N:08d>/`` holds ``stage_<s:03d>.pt`` (model and AdamW state of stage s,
written once per stage by data-parallel replica 0), ``rank_<g:05d>.pt`` (RNG states of global
rank g), any extra files the caller adds (``train`` adds ``config.toml``, its effective
settings) and, written last, ``manifest.json`` (the step, every file's size and SHA-256, and
what the checkpoint is only valid with: run id, topology, model shape, data position). Stage
and rank files record the run id and step too; what is read, and how, is
checkpoint_files.py's (plain files inside the folder only, identities checked on load).

Note: [atomic checkpoint] Every file is written to a temporary name in the same folder, flushed,
fsynced and renamed over its final name (``os.replace`` is atomic on POSIX), and the folder is
fsynced; the manifest is written only after every rank's files are in place. So a crash leaves
either a folder without a manifest (ignored: it is not a checkpoint yet) or a complete one. A
manifest whose files are missing or differ from their recorded SHA-256 is corrupt and raises
CheckpointError; nothing here ever falls back to a fresh start.

Note: [sharded optimizer checkpoint] A ``sharded`` optimizer (parallel/zero.py ZeroAdamW) is
saved by every rank it is sharded over, the data-parallel replicas times the
context-parallel ranks: ``stage_<s>[_tp<t>]_dp<d>.pt`` holds shard d (``Topology.grad_index``,
0 <= d < dp * cp; with cp = 1 the replica) of the float32 masters and AdamW moments with the
layout (each parameter's numel and shape, the buckets), and shard 0's also the stage's model
state; the manifest, written last, lists them all. Loading joins the shards into the whole
stage state StageAdamW saves (``load_stage``), which either optimizer loads at any dp and cp:
a resume may change dp, cp and ``--zero``, and `pipeoffload export` reads the joined state.
FSDP2 stages (``--zero 3``, parallel/fsdp.py) write the same shard form, their model state
gathered whole.
Tensor-parallel shards are not re-sharded (same tp only).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from pipeoffload.errors import ConfigError, writing
from pipeoffload.parallel.checkpoint_files import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    CheckpointError,
    FileIdentity,
    check_identity,
    check_name,
    read_plain_file,
    step_folders,
    step_of,
    tidy,
)
from pipeoffload.parallel.fsdp import is_sharded_stage, load_whole, whole_state
from pipeoffload.parallel.optimizer import CheckpointedOptimizer
from pipeoffload.parallel.rank_order import DIMS, RankOrder, parse_order
from pipeoffload.parallel.sharded_state import load_tensors, local_state
from pipeoffload.parallel.topology import Topology
from pipeoffload.parallel.zero import join_shards
from pipeoffload.runtime.groups import collective_device

FORMAT_VERSION = 2  # 2: stage and rank files record the run id and step
#: Identity keys a resume may change: stage files hold whole stages (or every replica's shard,
#: joined on loading), so another dp or zero level re-shards (Note: [sharded optimizer
#: checkpoint]).
RESHARDABLE = frozenset({"dp", "processes", "zero"})


@dataclass(frozen=True)
class FileRecord:
    """One written checkpoint file: its name inside the step folder, size and SHA-256."""

    name: str
    size_bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """A complete checkpoint: ``step`` optimizer steps done; ``info`` is what it requires."""

    folder: Path
    step: int
    files: dict[str, FileRecord]
    info: dict[str, Any]


def step_folder(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def stage_file(stage: int, tp_index: int | None = None, dp_index: int | None = None) -> str:
    """Stage ``stage``'s file; with tensor parallelism one per tensor-parallel rank (its
    shards, parallel/sharded_state.py Note: [sharded checkpoint]); with a sharded optimizer
    one per data-parallel replica too (Note: [sharded optimizer checkpoint])."""
    name = f"stage_{stage:03d}" + ("" if tp_index is None else f"_tp{tp_index}")
    return name + ("" if dp_index is None else f"_dp{dp_index}") + ".pt"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> FileRecord:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one
    (see Note: [atomic checkpoint])."""
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)
    return FileRecord(path.name, len(data), hashlib.sha256(data).hexdigest())


def save_object(folder: Path, name: str, obj: object) -> FileRecord:
    """torch.save ``obj`` (tensors, dicts, numbers) to ``folder/name`` atomically."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return write_atomic(folder / name, buffer.getvalue())


def write_manifest(folder: Path, step: int, records: list[FileRecord],
                   info: dict[str, Any]) -> Path:
    """Write the manifest last, making ``folder`` a complete checkpoint."""
    names = [r.name for r in records]
    if len(set(names)) != len(names):
        raise CheckpointError(f"checkpoint {folder}: files {names} were recorded twice")
    body = {
        "format": FORMAT_VERSION,
        "step": step,
        "files": {r.name: {"size_bytes": r.size_bytes, "sha256": r.sha256} for r in records},
        "info": info,
    }
    write_atomic(folder / MANIFEST, (json.dumps(body, indent=1, sort_keys=True) + "\n").encode())
    return folder / MANIFEST


def prepare_folder(folder: Path) -> None:
    """Make ``folder`` ready for a new checkpoint: an old manifest there is removed first, so
    the folder is never a complete checkpoint while its files are being replaced."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MANIFEST).unlink(missing_ok=True)
    _fsync_dir(folder)


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Step folders under ``root`` that have a manifest, oldest first."""
    return [f.path for f in step_folders(root) if f.complete]


def find_checkpoint(resume: str | Path, root: str | Path | None) -> Path:
    """The folder ``--resume`` means: "latest" (the newest complete checkpoint under ``root``),
    a step folder, or a root folder (its newest). Raises CheckpointError if there is none."""
    if str(resume) != "latest":
        path = Path(resume)
        if (path / MANIFEST).is_file():
            return path
        if not path.exists():
            raise CheckpointError(f"checkpoint {path} does not exist; pass the folder of a "
                                  "checkpoint (step_<N>) or of a --checkpoint-dir")
        root = path
    if root is None:
        raise CheckpointError("--resume latest needs --checkpoint-dir (where to look)")
    found = complete_checkpoints(root)
    if not found:
        partial = sorted(p.name for p in Path(root).glob("step_*")) if Path(root).is_dir() else []
        why = (f"only incomplete ones (no {MANIFEST}, a crash during saving?): {partial}"
               if partial else "none")
        raise CheckpointError(
            f"no complete checkpoint in {root} ({why}); check the path, or start without "
            "--resume to train from scratch")
    return found[-1]


def read_manifest(folder: str | Path, *, verify_files: bool = True) -> Manifest:
    """Read and check ``folder``'s manifest and (``verify_files``) that every file it lists is
    intact; ``load_object`` checks each file it loads in any case."""
    folder = Path(folder)
    path = folder / MANIFEST
    try:
        if not path.exists():
            raise FileNotFoundError(path)
        body = json.loads(read_plain_file(folder, MANIFEST, max_bytes=MAX_MANIFEST_BYTES))
        step = body["step"]
        files = {check_name(folder, name): FileRecord(name, int(rec["size_bytes"]),
                                                      str(rec["sha256"]))
                 for name, rec in body["files"].items()}
        info = body["info"]
        version = body["format"]
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: {folder} is not a complete checkpoint "
                              "(saving was interrupted?); resume from an older one") from None
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{path} is unreadable or corrupt ({error!r}); resume from "
                              "another checkpoint") from None
    if version != FORMAT_VERSION:
        raise CheckpointError(f"{path} has format {version}, this version reads "
                              f"{FORMAT_VERSION}; finish that run with the pipeoffload that "
                              "wrote it, or start a new one")
    if not isinstance(step, int) or step < 0 or not isinstance(info, dict):
        raise CheckpointError(f"{path} is corrupt: bad step {step!r} or info")
    if step_of(folder.name) not in (None, step):
        raise CheckpointError(f"{path} records step {step}, but its folder is {folder.name}: "
                              "a checkpoint was copied or renamed; resume from another one")
    if verify_files:
        for record in files.values():
            _verify(folder, record)
    return Manifest(folder, step, files, info)


def _verify(folder: Path, record: FileRecord) -> bytes:
    path = folder / record.name
    data = read_plain_file(folder, record.name, size_bytes=record.size_bytes)
    digest = hashlib.sha256(data).hexdigest()
    if len(data) != record.size_bytes or digest != record.sha256:
        raise CheckpointError(
            f"checkpoint file {path} is corrupt: {len(data)} bytes with SHA-256 {digest[:12]}..., "
            f"but the manifest recorded {record.size_bytes} bytes, {record.sha256[:12]}...; "
            "resume from another checkpoint")
    return data


def load_object(manifest: Manifest, name: str, device: torch.device | str = "cpu") -> Any:
    """Load one file of a checked checkpoint (checked again: it could change since)."""
    record = manifest.files.get(name)
    if record is None:
        raise CheckpointError(
            f"checkpoint {manifest.folder} has no {name} (it holds {sorted(manifest.files)}); "
            "it was written by another topology, resume with the same --pp/--dp/--schedule")
    data = _verify(manifest.folder, record)
    try:
        return torch.load(io.BytesIO(data), map_location=device, weights_only=True)
    except Exception as error:
        raise CheckpointError(f"checkpoint file {manifest.folder / name} cannot be loaded "
                              f"({error!r})") from None


def run_id(manifest: Manifest) -> str:
    """The id of the run that wrote ``manifest`` (kept by a resumed run)."""
    run = manifest.info.get("run")
    if not isinstance(run, str) or not run:
        raise CheckpointError(f"{manifest.folder / MANIFEST} is corrupt: no run id")
    return run


def load_identified(manifest: Manifest, name: str, device: torch.device | str = "cpu") -> Any:
    """``load_object``, then refuse the file unless it records this checkpoint's run id, step
    and its own name (checkpoint_files.check_identity)."""
    saved = load_object(manifest, name, device)
    check_identity(manifest.folder / name, saved,
                   FileIdentity(run_id(manifest), manifest.step, name))
    return saved


def check_compatible(manifest: Manifest, expected: dict[str, Any]) -> None:
    """Raise CheckpointError naming every key of ``expected`` that the checkpoint differs in,
    except those a resume re-shards (RESHARDABLE)."""
    expected = json.loads(json.dumps({k: v for k, v in expected.items()
                                      if k not in RESHARDABLE}))  # as the manifest stores them
    diffs = [f"{key}: checkpoint {manifest.info.get(key)!r}, now {value!r}"
             for key, value in expected.items() if manifest.info.get(key) != value]
    if diffs:
        shards = ("; it holds each tensor-parallel rank's shards and is not resharded, so "
                  f"resume with --tp {manifest.info.get('tp')}"
                  if manifest.info.get("tp") != expected.get("tp", manifest.info.get("tp"))
                  else "")
        raise CheckpointError(
            f"checkpoint {manifest.folder} was written for another configuration ("
            + "; ".join(diffs) + f"){shards}; resume with the options it was saved with")


def check_resume_step(step: int, where: object, steps: int) -> None:
    """A resumed run must have steps left: --steps counts from the start of training."""
    if step >= steps:
        raise CheckpointError(f"--steps {steps}: the checkpoint to resume ({where}) is already at "
                          f"step {step}, so there is nothing to train; pass --steps above "
                          f"{step} (it counts from the start of training)")


class DataPosition(Protocol):
    """Where the data stands (training/data.py TextDataset satisfies it): its state is a JSON
    object whose ``step`` is the optimizer steps done, kept in the manifest."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class TrainingState:
    """What a checkpoint holds for one process: its stage modules and their optimizer's state,
    the data position (the step) and, per process, the RNG states."""

    stages: Mapping[int, nn.Module]
    optimizer: CheckpointedOptimizer
    dataset: DataPosition


def _world(where: Topology) -> int:
    """The processes whose state a checkpoint holds: context-parallel ranks hold the same
    (one writes it), so a run may resume with another cp."""
    return dist.get_world_size() // where.cp if where.distributed else 1


def _barrier(where: Topology) -> None:
    if where.distributed:
        dist.barrier()


def _json(value: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(value))


def rng_state(device: torch.device) -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)


def save(state: TrainingState, root: str | Path, step: int, identity: dict[str, Any],
         where: Topology, *, extra_files: Mapping[str, bytes] | None = None,
         keep_last: int | None = None) -> Path:
    """Write the checkpoint of ``step`` from every process (a collective under
    torch.distributed); data-parallel replica 0 writes the stages, global rank 0
    ``extra_files`` ({bare name: bytes}). ``identity["run"]`` (the run id) goes into every
    file. Once complete, stale temporary files go and ``keep_last`` retires older
    checkpoints (checkpoint_files.tidy). Returns its folder."""
    folder = step_folder(root, step)
    if where.rank == 0:
        prepare_folder(folder)
    _barrier(where)
    run = str(identity.get("run", ""))
    records = [save_object(folder, name, local_state({**payload, "identity": FileIdentity(
        run, step, name).as_dict()})) for name, payload in _stage_payloads(state, where)]
    name = rank_file(where.rank)
    records.append(save_object(folder, name, {**rng_state(_device(where)),
                                              "identity": FileIdentity(run, step, name).as_dict()}))
    if where.rank == 0:
        for extra, data in sorted((extra_files or {}).items()):
            records.append(write_atomic(folder / check_name(folder, extra), data))
    if where.distributed:
        records = [FileRecord(**r) for part in _gather_json([vars(r) for r in records])
                   for r in part]
    if where.rank == 0:
        info = {**identity, "processes": _world(where), "data": state.dataset.state_dict()}
        if where.distributed:  # whose RNG file a resume on another layout reads: _saved_rank
            info["layout"] = {**where.rank_order.sizes, "order": list(where.order)}
        write_manifest(folder, step, records, _json(info))
        tidy(root, keep_last, list(extra_files or {}))
    _barrier(where)
    return folder


def _stage_payloads(state: TrainingState, where: Topology) -> list[tuple[str, dict[str, Any]]]:
    """(file name, contents) of the stage files this process writes: replica 0 (context-parallel
    rank 0) each stage's model and optimizer state; with a ``sharded`` optimizer every rank of
    the data- x context-parallel group its shard, shard 0 with the model (Note: [sharded
    optimizer checkpoint])."""
    sharded = state.optimizer.sharded
    shard = where.grad_index if where.distributed else 0
    if not sharded and (where.cp_index != 0 or where.dp_index != 0):
        return []  # context-parallel ranks and replicas hold the same parameters and state
    tp_index = _tp_index(where)
    payloads = []
    for s, module in sorted(state.stages.items()):
        optimizer = state.optimizer.stage_state(s)
        payload: dict[str, Any] = {"optimizer": optimizer.optimizer}
        if is_sharded_stage(module):  # FSDP2 (--zero 3): gathered whole by every replica
            model = whole_state(module)
            if shard == 0:
                payload["model"] = model
        elif shard == 0:
            payload["model"] = module.state_dict()
        if optimizer.masters is not None:
            payload["masters"] = optimizer.masters
        name = stage_file(s, tp_index, shard if sharded else None)
        payloads.append((name, payload))
    return payloads


def load_stage(manifest: Manifest, stage: int, tp_index: int | None,
               device: torch.device | str = "cpu") -> dict[str, Any]:
    """Stage ``stage``'s file as StageAdamW writes it (``model``, ``optimizer``, ``masters``),
    the shards joined when a sharded optimizer wrote it (Note: [sharded optimizer
    checkpoint])."""
    name = stage_file(stage, tp_index)
    if name in manifest.files or stage_file(stage, tp_index, 0) not in manifest.files:
        return dict(load_identified(manifest, name, device))
    dp = 1
    while stage_file(stage, tp_index, dp) in manifest.files:
        dp += 1
    parts = [load_identified(manifest, stage_file(stage, tp_index, d), device)
             for d in range(dp)]
    try:
        return {"model": parts[0]["model"],
                **join_shards([part["optimizer"]["shard"] for part in parts])}
    except (KeyError, RuntimeError, ValueError, TypeError) as error:
        raise CheckpointError(f"{manifest.folder}: the optimizer shards of stage {stage} do "
                              f"not join ({error!r}); resume from another checkpoint") from None


def _gather_json(value: Any) -> list[Any]:
    """Every process's JSON-able ``value``, by rank: byte tensors of one padded length, so no
    pickling (torch's ``all_gather_object`` needs numpy, which torch does not install)."""
    data = json.dumps(value).encode()
    backend_device = collective_device(torch.device("cuda")).type  # NCCL: device tensors
    length = torch.tensor([len(data)], dtype=torch.int64, device=backend_device)
    lengths = [torch.empty_like(length) for _ in range(dist.get_world_size())]
    dist.all_gather(lengths, length)
    size = max(int(n.item()) for n in lengths)
    mine = torch.zeros(size, dtype=torch.uint8, device=backend_device)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty_like(mine) for _ in lengths]
    dist.all_gather(parts, mine)
    return [json.loads(bytes(p[:int(n.item())].cpu().tolist())) for p, n in zip(parts, lengths)]


def describe_resume(resume: str | Path, root: str | Path | None) -> str:
    """Which checkpoint ``--resume`` picks and why newer step folders are passed over."""
    folder = find_checkpoint(resume, root)
    step = read_manifest(folder, verify_files=False).step
    text = f"resuming from {folder} (step {step})"
    parent = folder.parent
    newer = [f.path.name for f in step_folders(parent) if f.step > step and not f.complete]
    if str(resume) == "latest" or Path(resume) == parent:
        if newer:
            text += (f", skipping newer {', '.join(newer)}: no {MANIFEST} (saving was "
                     "interrupted; they are not checkpoints)")
    return text


def restore(state: TrainingState, resume: str | Path, root: str | Path | None,
            identity: dict[str, Any], where: Topology) -> int:
    """Load this process's part of the checkpoint ``resume`` names into ``state``; returns the
    step it continues from. Raises CheckpointError if it is missing, corrupt or foreign."""
    manifest = read_manifest(find_checkpoint(resume, root), verify_files=False)
    check_compatible(manifest, identity)
    tp_index = _tp_index(where)
    for s, module in sorted(state.stages.items()):
        saved = load_stage(manifest, s, tp_index, _device(where))
        try:
            load = load_whole if is_sharded_stage(module) else load_tensors
            load(module.state_dict(), saved["model"])
            state.optimizer.load_stage_state(s, saved)
        except (KeyError, RuntimeError, ValueError) as error:
            raise CheckpointError(f"{manifest.folder / stage_file(s, tp_index)} does not fit "
                                  f"stage {s} ({error}); resume with the model it was saved "
                                  "with") from None
    set_rng_state(load_identified(manifest, rank_file(_saved_rank(manifest, where))),
                  _device(where))
    data = manifest.info.get("data")
    if not isinstance(data, dict) or data.get("step") != manifest.step:
        raise CheckpointError(f"{manifest.folder / MANIFEST} is corrupt: its data position "
                              f"{data!r} does not match step {manifest.step}")
    state.dataset.load_state_dict(data)
    return manifest.step


def _saved_rank(manifest: Manifest, where: Topology) -> int:
    """The rank whose RNG states this process continues with: the saving job's rank at this
    process's pipeline and tensor-parallel coordinates, its replica ``dp_index % saved dp``
    and context-parallel rank ``cp_index % saved cp`` (the same rank when the layout is the
    same); rank 0 after a one-process run."""
    if not where.distributed:
        return where.rank
    layout = manifest.info.get("layout")
    if not isinstance(layout, dict):  # one process wrote it, or a checkpoint of cp = 1 only
        saved_dp = manifest.info.get("dp", where.dp)
        if manifest.info.get("processes") == 1:
            return 0
        if not isinstance(saved_dp, int) or saved_dp == where.dp:
            return where.rank
        return (where.pp_rank * saved_dp + where.dp_index % saved_dp) * where.tp + where.tp_index
    try:
        saved = RankOrder({d: int(layout[d]) for d in DIMS}, parse_order(tuple(layout["order"])))
        return saved.rank(pp=where.pp_rank, dp=where.dp_index % saved.size("dp"),
                          cp=where.cp_index % saved.size("cp"), tp=where.tp_index)
    except (KeyError, TypeError, ValueError, ConfigError) as error:
        raise CheckpointError(f"{manifest.folder / MANIFEST} is corrupt: its layout {layout!r} "
                              f"({error})") from None


def _tp_index(where: Topology) -> int | None:
    return where.tp_index if where.tp > 1 else None


def _device(where: Topology) -> torch.device:
    return where.device or torch.device("cpu")
