"""What the processes of a training run tell each other around its steps (small all-gathers
of float64 values on the default group): the loss, peaks, host-pool bytes and stop requests
after each step, the start step and run id before the first, the per-stage activation sizes
(and, with class choices, the share of them moved);
and a failed collective turned into an error naming this rank (``peer_failures``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple, cast

import torch
import torch.distributed as dist

from pipeoffload.core.schedule import Schedule
from pipeoffload.errors import PipelineRuntimeError, PipeoffloadError
from pipeoffload.parallel.checkpoint_files import CheckpointError
from pipeoffload.parallel.topology import Topology
from pipeoffload.runtime.groups import collective_device
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.offloader import ActivationOffloader


def gather_floats(topology: Topology, values: list[float]) -> list[list[float]]:
    """Every process's ``values`` (same length everywhere), by global rank."""
    if not topology.distributed:
        return [values]
    device = collective_device(topology.device or torch.device("cpu"))  # NCCL: device tensors
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [t.tolist() for t in everyone]


class StepGather(NamedTuple):
    """What every process learns after a step (one all-gather)."""

    loss: float  # mean over replicas
    peak_bytes: list[int]  # per pipeline rank, replica 0
    pool_bytes: tuple[int, ...] = ()  # host pool per pipeline rank, replica 0
    stop_signum: int = 0  # the largest stop request of any process (0: none)


def gather_step(topology: Topology, loss: torch.Tensor | None, meter: ActivationMeter,
                last_rank: int, *, pool_bytes: int = 0, stop_signum: int = 0) -> StepGather:
    """The step's loss, peak and host-pool bytes per pipeline rank, and whether any process
    was asked to stop (Note: [stopping on a signal]): all in the one gather a step makes."""
    if not topology.distributed:
        assert loss is not None
        return StepGather(loss.item(), [meter.peak_bytes(r) for r in range(topology.pp)],
                          (pool_bytes,), stop_signum)  # one process: one pool
    value = math.nan if loss is None else loss.item()
    rows = gather_floats(topology, [value, float(meter.peak_bytes(topology.pp_rank)),
                              float(pool_bytes), float(stop_signum)])
    losses = [rows[topology.global_rank(last_rank, d)][0] for d in range(topology.dp)]
    replica0 = [rows[topology.global_rank(p, 0)] for p in range(topology.pp)]
    return StepGather(sum(losses) / len(losses), [int(r[1]) for r in replica0],
                      tuple(int(r[2]) for r in replica0), int(max(r[3] for r in rows)))


def agree_on_start(topology: Topology, start: int, run: str,
                   stop_signum: int = 0) -> tuple[str, int]:
    """Check every process starts at the same step (each found the same checkpoint); return the
    run id of global rank 0 (each drew or read its own) and the largest stop request so far."""
    if not topology.distributed:
        return run, stop_signum
    rows = gather_floats(topology, [float(start), float(int(run, 16)), float(stop_signum)])
    starts = sorted({int(r[0]) for r in rows})
    if len(starts) > 1:
        raise CheckpointError(f"the processes would start at different steps {starts}: they "
                              "found different newest checkpoints (a file system that is not "
                              "the same on every node?); pass --resume PATH")
    return f"{int(rows[0][1]):012x}", int(max(r[2] for r in rows))


def stage_sizes(topology: Topology, meter: ActivationMeter,
                num_stages: int) -> tuple[int, ...] | None:
    """Per-stage activation bytes of one microbatch measured on the last step, from every
    process; None if a stage's microbatches differed (the simulator takes one size)."""
    seen: dict[int, set[int]] = {}
    for (stage, _), nbytes in meter.stage_scope_bytes.items():
        seen.setdefault(stage, set()).add(nbytes)
    # Per stage: its size, -1 if its microbatches differed, -2 if this process has none of it.
    local = [float(next(iter(seen[s])) if len(seen[s]) == 1 else -1) if s in seen else -2.0
             for s in range(num_stages)]
    sizes = []
    for values in zip(*gather_floats(topology, local)):
        measured = {int(v) for v in values if v != -2}
        sizes.append(measured.pop() if len(measured) == 1 else -1)
    return None if min(sizes) < 0 else tuple(sizes)


def stage_moved_shares(topology: Topology, offloader: ActivationOffloader | None,
                       schedule: Schedule) -> dict[int, tuple[float, float]] | None:
    """Per stage, the (moved, recomputed) shares of one microbatch's saved bytes its class
    choice moves and drops, measured on the last step (``ActivationOffloader.class_bytes``),
    from every process: what the simulator reads for a schedule with class choices
    (core/classes.py); None when the schedule has none or a stage's microbatches differed."""
    choices = dict(schedule.classes)
    if not choices:
        return None
    seen: dict[int, set[tuple[float, float]]] = {}
    measured = offloader.class_bytes if offloader is not None else {}
    for key, tags in measured.items():
        stage_mb = cast(tuple[int, int], key)
        choice = choices.get(stage_mb)
        total = sum(tags.values())
        if choice is not None and total:
            moved, recomputed = (sum(tags.get(name, 0) for name in names) / total
                                 for names in choice.names)
            seen.setdefault(stage_mb[0], set()).add((moved, recomputed))
    # two floats per stage: -2 where this process has no item of it, -1 where its items differ
    local: list[float] = []
    for stage in range(schedule.num_stages):
        pairs = seen.get(stage)
        local.extend(next(iter(pairs)) if pairs is not None and len(pairs) == 1
                     else (-1.0, -1.0) if pairs else (-2.0, -2.0))
    gathered = list(zip(*gather_floats(topology, local)))
    shares: dict[int, tuple[float, float]] = {}
    for stage in range(schedule.num_stages):
        found = {pair for pair in zip(gathered[2 * stage], gathered[2 * stage + 1])
                 if pair[0] != -2}
        if len(found) > 1 or any(pair[0] == -1 for pair in found):
            return None
        if found:
            shares[stage] = found.pop()
    return shares


@contextmanager
def peer_failures(topology: Topology, what: str) -> Iterator[None]:
    """Turn a failed collective (a peer died) into a PipelineRuntimeError naming this rank."""
    try:
        yield
    except RuntimeError as error:
        if isinstance(error, PipeoffloadError) or not topology.distributed:
            raise
        tensor_rank = f", tensor-parallel rank {topology.tp_index}" if topology.tp > 1 else ""
        where = (f"rank {topology.rank} (pipeline rank {topology.pp_rank}, replica "
                 f"{topology.dp_index}{tensor_rank}), {what}")
        if not _from_communication(error):  # this rank's own failure: no peer to blame
            raise PipelineRuntimeError(f"{where}: failed on this rank ({error})") from error
        raise PipelineRuntimeError(
            f"{where}: a collective failed ({error}); a peer died or failed, look at its "
            "error") from error


def _from_communication(error: RuntimeError) -> bool:
    """Whether a failed collective was the transport's (a peer gone, a timeout) rather than
    something local such as a missing package."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error).lower()
    return any(word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout",
                                         "peer", "socket", "broken pipe"))
