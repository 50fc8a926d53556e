"""Process groups for the pipeline: which backend serves a device, whether NCCL communicators
are set up eagerly, and one communicator per message channel for every pipeline of a job.

Note: [NCCL groups]
- A group made with ``backend="cpu:gloo,cuda:nccl"`` reports that compound string from
  ``dist.get_backend``; what decides NCCL's rules (posting order, no host waits, device
  tensors only) is the backend that serves the tensors' device, so ``backend_for`` reads the
  string per device type.
- Without a device bound to the default group (``init_process_group(device_id=)``) NCCL
  communicators are created lazily, by the group's first operation: for a batched P2P that is
  ``ncclCommInitRank`` over every rank of the group (ProcessGroupNCCL ``pointToPoint`` takes the
  group-wide key when a batch is active), a host-level collective that hangs when only two of
  the group's ranks use a channel. With a bound device, PyTorch creates every new group's
  communicator when the group is made, split from the default one (``ncclCommSplit``), so no
  step meets a communicator set-up. ``require_bound_device`` refuses the lazy case on NCCL.
- ``channel_groups`` makes the four channel communicators of every pipeline with one
  ``dist.split_group`` per channel where the backend can split (NCCL with a bound device): four
  calls over the job instead of 4 * dp * tp ``new_group`` calls, each of which every process
  joins.
"""

from __future__ import annotations

import datetime
from collections.abc import Hashable, Mapping, Sequence

import torch
import torch.distributed as dist

from pipeoffload.core.schedule import Schedule
from pipeoffload.errors import ConfigError
from pipeoffload.runtime import rendezvous
from pipeoffload.runtime.lowering import Channel, channel_of, order_conflicts


def backend_for(group: dist.ProcessGroup | None, device_type: str) -> str | None:
    """The backend of ``group`` (None: the default group) that serves tensors on devices of
    ``device_type``: "nccl" for ``"cpu:gloo,cuda:nccl"`` and "cuda", "gloo" for it and "cpu";
    a plain backend name serves every device; None when the string names others only."""
    name = str(dist.get_backend(group)).lower()
    if ":" not in name:
        return name
    for part in name.split(","):
        device, _, backend = part.partition(":")
        if device.strip() == device_type:
            return backend.strip()
    return None


def uses_nccl(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether tensors on ``device`` travel over NCCL in ``group`` (Note: [NCCL groups])."""
    return backend_for(group, device.type) == "nccl"


def collective_device(device: torch.device) -> torch.device:
    """Where a small tensor for a collective on the default group must live: the training
    device when NCCL serves it (NCCL takes device tensors only), else the CPU."""
    return device if uses_nccl(None, device) else torch.device("cpu")


def default_bound_device() -> torch.device | None:
    """The device bound to the default process group (``init_process_group(device_id=)``)."""
    world = dist.group.WORLD
    return getattr(world, "bound_device_id", None) if world is not None else None


def require_bound_device() -> None:
    """Refuse lazily created NCCL communicators (Note: [NCCL groups]), saying how to fix it."""
    if default_bound_device() is None:
        raise ConfigError(
            "NCCL process groups made without a device bound to the default group create their "
            "communicators lazily, in the first operation, as a collective over every rank of "
            "the group; a channel that only two ranks use then hangs. Bind the device when "
            "initialising: dist.init_process_group('nccl', device_id=torch.device('cuda', "
            "local_rank)), then make the channel groups after it "
            "(pipeoffload.runtime.groups.channel_groups, or pipeoffload.init_distributed, "
            "which does both)")


def new_channel_groups(ranks: list[int], timeout: datetime.timedelta | None = None
                       ) -> dict[Channel, dist.ProcessGroup]:
    """One process group over ``ranks`` (global ranks, one pipeline) per ``Channel``, for
    ``Pipeline(channel_groups=)``. Collective: every process of the default group calls it
    with the same arguments, in the same order as its other ``new_group`` calls.

    NCCL needs them (p2p.py Note: [NCCL posting]). On gloo each group is its own set of
    sockets, so a pair of ranks does not push both directions' messages and receive notices
    through one socket: a send does not queue behind the other direction's traffic. Measured on
    2 CPU ranks, together with receives posted 8 ahead (RuntimeConfig.recv_lookahead): interleaved
    1F1B and ZB-V steps 10-14 % faster than on one group with receives 2 ahead
    (benchmarks/vs_torch.py --transport-baseline, docs/benchmarks.md)."""
    return {channel: dist.new_group(ranks, timeout=timeout) for channel in Channel}


def channel_groups(pipelines: Sequence[Sequence[int]], rank: int,
                   timeout: datetime.timedelta | None = None
                   ) -> dict[Channel, dist.ProcessGroup] | None:
    """This process's communicator per ``Channel``, for ``Pipeline(channel_groups=)``, over the
    pipeline of ``pipelines`` (disjoint lists of global ranks) that holds global ``rank``; None
    when no pipeline holds it. Collective: every process of the default group calls it with the
    same arguments. Splits the default group once per channel where the backend can (NCCL with
    a bound device), else one ``new_group`` per pipeline and channel (Note: [NCCL groups])."""
    splits = [list(members) for members in pipelines]
    if _can_split():
        groups = {channel: dist.split_group(split_ranks=splits, timeout=timeout,
                                            group_desc=f"pipeoffload {channel.value}")
                  for channel in Channel}
        mine = {c: g for c, g in groups.items() if g is not None}
        return mine or None
    found = None
    for members in splits:
        made = new_channel_groups(members, timeout)
        if rank in members:
            found = made
    return found


def _can_split() -> bool:
    return (hasattr(dist, "split_group") and backend_for(None, "cuda") == "nccl"
            and default_bound_device() is not None)


def check_nccl_layout(lowered: Schedule, group: dist.ProcessGroup | None,
                      backward_group: dist.ProcessGroup | None,
                      channel_groups: Mapping[Channel, dist.ProcessGroup] | None) -> None:
    """Refuse communicators on which NCCL would pair the wrong messages or deadlock, in
    runtime/rendezvous.py's model with ``Pipeline.connect_peers`` run before the first step."""
    backward = group if backward_group is None else backward_group
    groups = {c: backward if c.value.startswith("B") else group for c in Channel}
    groups.update(channel_groups or {})
    ids = {c: id(g) for c, g in groups.items()}

    def lane(schedule: Schedule, message: tuple[str, int, int]) -> Hashable:
        return ids[channel_of(schedule, message)]

    fix = ("pass channel_groups=pipeoffload.runtime.groups.channel_groups(<every pipeline's "
           "ranks>, rank), one group per pipeoffload.runtime.lowering.Channel, made after "
           "init_process_group(..., device_id=...) (pipeoffload.init_distributed does)")
    problems = order_conflicts(lowered, lane=lane)
    if problems:
        raise ConfigError(
            "NCCL matches messages between two ranks in the order they are posted, and this "
            "schedule receives some in another order than it sends them: "
            + "; ".join(problems[:3]) + f"; {fix}")
    for first_step in (True, False):
        outcome = rendezvous.simulate(lowered, lane, first_step=first_step, warm_up=True)
        if not outcome.ok:
            raise ConfigError(
                "on these communicators NCCL would deadlock (runtime/rendezvous.py's model, "
                f"{'first' if first_step else 'later'} steps): "
                + "; ".join(outcome.deadlock[:4]) + f"; {fix}")
