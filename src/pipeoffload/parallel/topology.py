"""Where each process of a job sits: the (pp, dp, cp, tp) device mesh, its process groups and
this process's device (``Topology``), and joining a job torchrun (or `pipeoffload train`'s own
launcher, cli/launch.py) started (``connect``).

Note: [rank layout] The processes form a device mesh of shape (pp, dp, tp), dims named
"pp", "dp", "tp" (``init_device_mesh``): global rank g is tensor-parallel rank ``g % tp`` of
data-parallel replica ``(g // tp) % dp`` of pipeline rank ``g // (dp * tp)``. Tensor-parallel
peers (the heaviest traffic, collectives in every layer) are neighbours, then the replicas of
one pipeline rank (the gradient all-reduce), so with torchrun's node-major numbering both stay
inside a node where they can and the pipeline's point-to-point hops (light) cross nodes. Each
(replica, tensor-parallel rank) has its own pipeline group, each (pipeline rank,
tensor-parallel rank) its own data-parallel group; with tp = 1, g = pp_rank * dp + replica.
With context parallelism (cp > 1) the mesh has a fourth dimension, "cp", and its order is
data: parallel/rank_order.py Note: [rank order] (default pp, dp, cp, tp: the layout above with
each tensor-parallel group's context-parallel peers next to it). Gradients are averaged over
the data- and context-parallel ranks together (``grad_group``), as each context-parallel rank
holds the gradient of its part of every sequence.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeoffload.errors import ConfigError
from pipeoffload.parallel.rank_order import DEFAULT_ORDER, RankOrder

if TYPE_CHECKING:
    import torch

    from pipeoffload.runtime.sequence import SequenceSplit


@dataclass(frozen=True)
class Topology:
    """Where this process sits; see Note: [rank layout]. ``local()``: one process, all ranks."""

    pp: int
    dp: int
    rank: int = 0
    distributed: bool = False
    device: torch.device | None = None
    pp_group: Any = None
    dp_group: Any = None
    channel_groups: Any = None  # {lowering.Channel: group}, see Pipeline(channel_groups=)
    tp: int = 1
    tp_mesh: Any = None  # the 1-D DeviceMesh of this process's tensor-parallel group (tp > 1)
    cp: int = 1
    cp_group: Any = None  # this process's context-parallel group (cp > 1)
    grad_group: Any = None  # the data- x context-parallel group gradients are averaged over
    order: tuple[str, ...] = DEFAULT_ORDER  # Note: [rank order]

    @classmethod
    def local(cls, pp: int, device: torch.device | str = "cpu") -> Topology:
        import torch

        return cls(pp=pp, dp=1, device=torch.device(device))

    @property
    def rank_order(self) -> RankOrder:
        return RankOrder({"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp},
                         self.order)

    @property
    def pp_rank(self) -> int:
        return self.rank_order.index(self.rank, "pp")

    @property
    def dp_index(self) -> int:
        return self.rank_order.index(self.rank, "dp")

    @property
    def tp_index(self) -> int:
        return self.rank_order.index(self.rank, "tp")

    @property
    def cp_index(self) -> int:
        return self.rank_order.index(self.rank, "cp")

    @property
    def grad_replicas(self) -> int:
        """How many ranks hold a part of each parameter's gradient: dp * cp."""
        return self.dp * self.cp

    @property
    def grad_index(self) -> int:
        """This process's position in its data- x context-parallel group (``grad_group``):
        torch numbers a group's members by global rank, so it depends on the rank order."""
        members = sorted(self.rank_order.group_ranks(self.rank, "dp", "cp"))
        return members.index(self.rank)

    @property
    def pipeline_ranks(self) -> tuple[int, ...]:
        """The pipeline ranks this process runs."""
        return (self.pp_rank,) if self.distributed else tuple(range(self.pp))

    def global_rank(self, pp_rank: int, dp_index: int, tp_index: int = 0,
                    cp_index: int = 0) -> int:
        return self.rank_order.rank(pp=pp_rank, dp=dp_index, tp=tp_index, cp=cp_index)

    def stages_of(self, schedule: Any) -> list[int]:
        """The stages of ``schedule`` this process holds (every stage in local mode)."""
        return sorted(s for r in self.pipeline_ranks for s in schedule.stages_on_rank(r))

    def sequence_split(self) -> SequenceSplit:
        """This process's share of every sequence (runtime/sequence.py; cp = 1: all of it)."""
        from pipeoffload.runtime.sequence import SequenceSplit  # torch: not at import

        return SequenceSplit(self.cp, self.cp_index, self.cp_group)

    def pipeline_options(self) -> dict[str, Any]:
        """What ``Pipeline`` takes from the job: ``Pipeline(stages, schedule, loss_fn,
        **topology.pipeline_options())`` (the pipeline group, its P2P channel groups, the
        device, and with cp > 1 the context split)."""
        if not self.distributed:
            return {"device": self.device}
        options = {"group": self.pp_group, "channel_groups": self.channel_groups,
                   "device": self.device}
        if self.cp > 1:
            options["context"] = self.sequence_split()
        return options


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """"cpu", "cuda" or "auto" (CUDA when available) as this process's device."""
    import torch

    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda was asked for but CUDA is not available")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def connect(pp: int, dp: int, device: str = "auto", timeout_s: float = 300.0,
            env: Mapping[str, str] = os.environ, tp: int = 1,
            agree: Mapping[str, Any] | None = None, cp: int = 1,
            order: tuple[str, ...] = DEFAULT_ORDER) -> Topology:
    """Join the job torchrun (or ``launch``) started: init the default group from env://
    (NCCL on GPUs, gloo on CPU; ``timeout_s`` for every collective, and on NCCL the bound for a
    hung receive: runtime/p2p.py Note: [NCCL posting]), build the (pp, dp, cp, tp) device mesh
    in ``order`` and take the pipeline, data-parallel, context-parallel and tensor-parallel
    groups from it (see Note: [rank layout]). On CUDA the group is bound to this process's
    device (``device_id``: eager NCCL init, new groups split from it), and each pipeline gets
    one communicator per lowering.Channel (Note: [NCCL channels]). The environment is checked
    and the ranks meet through parallel/job.py first, so a bad variable, a port in use or ranks
    that disagree on WORLD_SIZE or on ``agree`` (e.g. the training options) are named, not a
    timeout."""
    import torch
    import torch.distributed as dist

    from pipeoffload.parallel.job import join_store, read_job_env

    layout = RankOrder({"pp": pp, "dp": dp, "cp": cp, "tp": tp}, tuple(order))
    job = read_job_env(env)
    store = join_store(job, timeout_s, {"pp": pp, "dp": dp, "tp": tp, "cp": cp,
                                        "order": list(order), **(agree or {})})
    world = job.world_size
    if world != layout.world_size:
        raise ConfigError(f"the job has WORLD_SIZE={world} processes but --pp {pp} x --dp {dp} "
                          f"x --tp {tp} x --cp {cp} = {layout.world_size}; start "
                          "pp*dp*tp*cp processes")
    where = resolve_device(device, job.local_rank)
    backend = "nccl" if where.type == "cuda" else "gloo"
    if where.type == "cuda":
        torch.cuda.set_device(where)
    timeout = datetime.timedelta(seconds=timeout_s)
    bound: dict[str, Any] = {"device_id": where} if where.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=job.rank, world_size=world,
                            timeout=timeout, **bound)
    return mesh_topology(pp, dp, tp, where, timeout_s, cp=cp, order=tuple(order))


def mesh_topology(pp: int, dp: int, tp: int, where: torch.device,
                  timeout_s: float = 300.0, *, cp: int = 1,
                  order: tuple[str, ...] = DEFAULT_ORDER) -> Topology:
    """In a process whose default group (of pp * dp * cp * tp ranks) is initialised: build
    the device mesh in ``order`` and this process's Topology (Note: [rank layout])."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pipeoffload.runtime.groups import backend_for, channel_groups

    rank, backend = dist.get_rank(), backend_for(None, where.type) or dist.get_backend()
    timeout = datetime.timedelta(seconds=timeout_s)
    layout = RankOrder({"pp": pp, "dp": dp, "cp": cp, "tp": tp}, order)
    mesh = init_device_mesh(where.type, layout.shape, mesh_dim_names=layout.dims,
                            backend_override={n: (backend, _options(backend, timeout))
                                              for n in layout.dims})
    topo = Topology(pp=pp, dp=dp, tp=tp, rank=rank, distributed=True, device=where,
                    pp_group=mesh.get_group("pp"), dp_group=mesh.get_group("dp"),
                    tp_mesh=mesh["tp"] if tp > 1 else None, cp=cp,
                    cp_group=mesh.get_group("cp") if cp > 1 else None, order=layout.dims)
    grad_group = topo.dp_group if cp == 1 else topo.cp_group
    if cp > 1 and dp > 1:  # every process makes every group, in one order
        grad_group, _ = dist.new_subgroups_by_enumeration(
            layout.all_groups("dp", "cp"), timeout=timeout, backend=backend,
            pg_options=_options(backend, timeout))
    # One communicator per channel and pipeline: NCCL runs each one's P2P in posting order, and
    # on gloo separate sockets per direction make sends faster (groups.channel_groups).
    pipelines = layout.all_groups("pp") if pp > 1 else []  # one stage: no P2P
    channels = channel_groups(pipelines, rank, timeout) if pipelines else None
    return dataclasses.replace(topo, channel_groups=channels, grad_group=grad_group)


def _options(backend: str, timeout: datetime.timedelta) -> Any:
    """Backend options carrying ``timeout``, so the mesh's groups fail as the default one."""
    import torch.distributed as dist

    options = (dist.ProcessGroupNCCL.Options() if backend == "nccl"
               else dist.ProcessGroupGloo._Options())  # type: ignore[attr-defined]  # not in stubs
    options._timeout = timeout
    return options


def disconnect(topology: Topology) -> None:
    import torch.distributed as dist

    if topology.distributed and dist.is_initialized():
        dist.destroy_process_group()
