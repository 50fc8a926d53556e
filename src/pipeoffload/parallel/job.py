"""Joining a job torchrun (or cli/launch.py) started: its environment checked, and a rendezvous
that names what is wrong instead of a raw traceback or a timeout that says nothing.

- ``read_job_env``: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and LOCAL_RANK must be whole
  numbers in range (``RANK=abc``, an empty WORLD_SIZE, ``MASTER_PORT=99999``,
  ``RANK >= WORLD_SIZE`` are refused naming the variable), pure Python, checked before torch.
- ``join_store``: the TCP store torch's env:// rendezvous would make (torch/distributed/
  rendezvous.py ``_create_c10d_store``: rank 0 hosts it at MASTER_ADDR:MASTER_PORT, or
  torchrun's agent does when TORCHELASTIC_USE_AGENT_STORE is set), with its errors named: a
  port in use, a store nobody hosts. Then every rank announces its RANK, WORLD_SIZE and what
  the ranks must agree on (``agree``: the training options) and reads the others'
  announcements as they come, so ranks that disagree on WORLD_SIZE or on an option, or two
  processes with one RANK, fail at once with both sides named; after the timeout, the ranks
  that never came are listed. The process group is then built on this store.
"""

from __future__ import annotations

import datetime
import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeoffload.errors import ConfigError, PipelineRuntimeError

_WHOLE = re.compile(r"[0-9]+")
_TORCHRUN = "set by torchrun (or by hand for each process: RANK, WORLD_SIZE, MASTER_ADDR, " \
            "MASTER_PORT)"


@dataclass(frozen=True)
class JobEnv:
    """This process's place in the job and where the job meets."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int = 0
    agent_store: bool = False  # torchrun's agent hosts the store (all ranks are clients)
    restart: int = 0  # torchrun's restart count: each attempt meets under its own keys


def _whole(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = env.get(name)
    if text is None and default is not None:
        return default
    if text is None or not _WHOLE.fullmatch(text.strip()):
        what = "is not set" if text is None else (
            "is empty" if not text.strip() else f"is {text!r}, not a whole number")
        raise ConfigError(f"environment variable {name} {what}; it is {_TORCHRUN}")
    return int(text.strip())


def read_job_env(env: Mapping[str, str]) -> JobEnv:
    """The job's environment, every variable checked (ConfigError naming the one that is
    wrong)."""
    world = _whole(env, "WORLD_SIZE")
    rank = _whole(env, "RANK")
    if world < 1:
        raise ConfigError("environment variable WORLD_SIZE is 0; it is the number of processes "
                          "of the job, >= 1")
    if rank >= world:
        raise ConfigError(f"environment variable RANK={rank} is not below WORLD_SIZE={world}: "
                          f"ranks are 0..{world - 1}; give each process its own RANK in that "
                          "range")
    addr = env.get("MASTER_ADDR", "").strip()
    if not addr:
        raise ConfigError(f"environment variable MASTER_ADDR is empty; it is {_TORCHRUN}: the "
                          "host name or address of rank 0")
    port = _whole(env, "MASTER_PORT")
    if not 1 <= port <= 65535:
        raise ConfigError(f"environment variable MASTER_PORT={port} is not a TCP port (1..65535)")
    local = _whole(env, "LOCAL_RANK", default=0)
    return JobEnv(rank, world, addr, port, local,
                  agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                  restart=_whole(env, "TORCHELASTIC_RESTART_COUNT", default=0))


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def join_store(job: JobEnv, timeout_s: float, agree: Mapping[str, Any] | None = None) -> Any:
    """The job's TCP store, once every rank has announced itself and agrees (see the module
    doc); ConfigError or PipelineRuntimeError naming the problem otherwise."""
    import torch.distributed as dist

    where = f"{job.master_addr}:{job.master_port}"
    timeout = datetime.timedelta(seconds=timeout_s)
    host = job.rank == 0 and not job.agent_store
    try:
        store = dist.TCPStore(job.master_addr, job.master_port, None, host, timeout,
                              wait_for_workers=False, multi_tenant=host)
    except RuntimeError as error:
        text = str(error)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise ConfigError(f"MASTER_PORT={job.master_port} is in use on this host (another "
                              "job, or a leftover process of an earlier run, listens there); "
                              "choose a free MASTER_PORT") from None
        if host:
            raise ConfigError(f"rank 0 cannot host the job's store at {where} "
                              f"({_first_line(error)}); MASTER_ADDR must name this host") from None
        raise PipelineRuntimeError(
            f"rank {job.rank}: cannot reach the job's store at {where} within {timeout_s:g} s "
            f"({_first_line(error)}): is rank 0 running there, and do all ranks have the same "
            "MASTER_ADDR and MASTER_PORT (not another program's port)?") from None
    try:
        _meet(store, job, timeout_s, dict(agree or {}))
    except RuntimeError as error:
        if isinstance(error, PipelineRuntimeError):
            raise
        raise PipelineRuntimeError(
            f"rank {job.rank}: lost the job's store at {where} while meeting the other ranks "
            f"({_first_line(error)}); rank 0 failed or stopped, look at its error") from None
    return store


def _meet(store: Any, job: JobEnv, timeout_s: float, agree: dict[str, Any]) -> None:
    """Announce this rank, read every announcement, refuse disagreements (module doc)."""
    prefix = f"pipeoffload/meet/{job.restart}/"
    mine = {"rank": job.rank, "world_size": job.world_size, "agree": agree}
    store.set(prefix + str(store.add(prefix + "count", 1)), json.dumps(mine))
    mine = json.loads(json.dumps(mine))  # compared as read back
    seen: dict[int, dict[str, Any]] = {}
    read, wait_s = 1, 0.01
    deadline = time.monotonic() + timeout_s
    while True:
        count = store.add(prefix + "count", 0)
        while read <= count and store.check([prefix + str(read)]):
            other = json.loads(store.get(prefix + str(read)))
            read += 1
            _compare(job, mine, other, seen)
            seen[other["rank"]] = other
        if len(seen) == job.world_size:
            return
        if time.monotonic() > deadline:
            missing = [r for r in range(job.world_size) if r not in seen]
            shown = ", ".join(map(str, missing[:20])) + (", ..." if len(missing) > 20 else "")
            raise PipelineRuntimeError(
                f"rank {job.rank}: only {len(seen)} of WORLD_SIZE={job.world_size} ranks joined "
                f"the job at {job.master_addr}:{job.master_port} within {timeout_s:g} s "
                f"(missing rank(s) {shown}); start every rank, with the same MASTER_ADDR, "
                "MASTER_PORT and WORLD_SIZE (raise --p2p-timeout if they start slowly)")
        time.sleep(wait_s)
        wait_s = min(2 * wait_s, 0.5)


def _compare(job: JobEnv, mine: dict[str, Any], other: dict[str, Any],
             seen: dict[int, dict[str, Any]]) -> None:
    rank = other["rank"]
    if rank in seen or (rank == job.rank and other != mine):
        raise ConfigError(f"two processes of the job have RANK={rank}; give each its own RANK "
                          f"in 0..{job.world_size - 1}")
    if other["world_size"] != job.world_size:
        raise ConfigError(f"the ranks disagree on WORLD_SIZE: rank {rank} has "
                          f"WORLD_SIZE={other['world_size']}, this rank ({job.rank}) has "
                          f"{job.world_size}; start every rank with the same WORLD_SIZE")
    theirs, ours = _flat(other["agree"]), _flat(mine["agree"])
    diffs = [f"{key}: {theirs.get(key)!r} there, {ours.get(key)!r} here"
             for key in sorted(set(theirs) | set(ours)) if theirs.get(key) != ours.get(key)]
    if diffs:
        raise ConfigError(f"rank {rank} was started with other options than this rank "
                          f"({job.rank}): {'; '.join(diffs[:5])}; start every rank with the "
                          "same command line")


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys (so a difference names the field: ``model.dim``)."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat
