"""The NCCL path on CPU, with torch.distributed mocked: what DistTransport posts and waits for,
what Pipeline accepts on NCCL, and how connect() initialises the process group on CUDA
(runtime/p2p.py Note: [NCCL posting])."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from test_runtime_support import token_loss, transformer_stages

from pipeoffload.api import build_schedule
from pipeoffload.core.actions import Action, Kind
from pipeoffload.errors import ConfigError
from pipeoffload.parallel import topology as topology_module
from pipeoffload.runtime import groups
from pipeoffload.runtime.lowering import (
    Channel,
    channel_of,
    message_of,
    peer_connections,
    peer_of,
    with_comms,
)
from pipeoffload.runtime.p2p import DistTransport, _encode
from pipeoffload.runtime.pipeline import Pipeline
from pipeoffload.runtime.rendezvous import host_program, posts_of, warm_up_program


class FakeWork:
    """A work object that says whether it completed and records how it was waited for."""

    def __init__(self, polls_to_complete: int = 0) -> None:
        self.polls_left = polls_to_complete
        self.waits: list[tuple] = []
        self.polls = 0

    def is_completed(self) -> bool:
        self.polls += 1
        if self.polls_left > 0:
            self.polls_left -= 1
            return False
        return True

    def wait(self, *args: object) -> bool:
        self.waits.append(args)
        return True


class FakeOp:
    def __init__(self, op, tensor, peer, group, tag) -> None:
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


class FakeDist:
    """Records every batch posted; hands out works made by ``make_work``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
        self.batches: list[list[FakeOp]] = []
        self.works: list[FakeWork] = []
        self.make_work = FakeWork
        monkeypatch.setattr(dist, "P2POp", FakeOp)
        monkeypatch.setattr(dist, "batch_isend_irecv", self._batch)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)

        def unbatched(*args: object, **kwargs: object) -> None:
            raise AssertionError("an unbatched isend / irecv was posted")

        monkeypatch.setattr(dist, "isend", lambda *a, **k: unbatched())
        monkeypatch.setattr(dist, "irecv", lambda *a, **k: unbatched())

    def _batch(self, ops: list[FakeOp]) -> list[FakeWork]:
        self.batches.append(ops)
        for op in ops:  # a metadata receive gets what a sender of META would send
            if op.op is dist.irecv and op.tensor.dtype is torch.int64 and op.tensor.numel() == 64:
                op.tensor.copy_(_encode(META, None))
        work = self.make_work()
        self.works.append(work)
        return [work]

    def parts(self) -> list[tuple[str, str]]:
        """(send / recv, meta / data) of each batch."""
        return [("send" if b[0].op is dist.isend else "recv",
                 "meta" if b[0].tensor.dtype is torch.int64 and len(b) == 1
                 and b[0].tensor.numel() == 64 else "data") for b in self.batches]


CHANNELS = {c: f"group {c.value}" for c in Channel}
CUDA = torch.device("cuda", 0)
META = (((2, 3), torch.float64),)


def _transport(nccl: bool) -> DistTransport:
    return DistTransport(None, torch.device("cpu"), 5.0, num_stages=4, microbatches=2,
                         channel_groups=CHANNELS, nccl=nccl)


def test_nccl_receive_makes_the_stream_wait_and_never_the_host(monkeypatch) -> None:
    fake = FakeDist(monkeypatch, rank=1)
    transport = _transport(nccl=True)
    transport.begin_step()
    transport.begin_step()  # a later step: shapes known, no metadata
    transport._learnt[("F", 1)] = META
    action = Action(1, Kind.RECV_F, 0)
    pending = transport.recv(("F", 1, 0), 0, None, action)
    (received,) = transport.wait(pending)
    assert received.shape == (2, 3)
    (work,) = fake.works
    assert work.waits == [()]  # work.wait() with no timeout: a stream wait on NCCL
    assert work.polls == 0  # and no host polling either
    assert fake.batches[0][0].group == CHANNELS[Channel.F_UP]


def test_gloo_receive_waits_on_the_host_with_the_timeout(monkeypatch) -> None:
    fake = FakeDist(monkeypatch, rank=2)
    transport = _transport(nccl=False)
    transport.begin_step()
    transport.begin_step()
    pending = transport.recv(("B", 2, 1), 3, META, Action(2, Kind.RECV_B, 1))
    transport.wait(pending)
    assert fake.works[0].waits == [(datetime.timedelta(seconds=5.0),)]
    assert fake.batches[0][0].group == CHANNELS[Channel.B_DOWN]


def test_first_step_posts_as_the_rendezvous_model_says(monkeypatch) -> None:
    fake = FakeDist(monkeypatch, rank=1)
    fake.make_work = lambda: FakeWork(polls_to_complete=3)
    transport = _transport(nccl=True)
    transport.begin_step()
    send, recv = Action(1, Kind.SEND_F, 0), Action(1, Kind.RECV_F, 0)
    transport.send(("F", 2, 0), (torch.ones(2, 3, dtype=torch.float64),), 2, send)
    assert [p for _, p in fake.parts()] == list(posts_of(send, first_step=True))
    fake.batches.clear()
    pending = transport.recv(("F", 1, 0), 0, None, recv)
    assert [p for _, p in fake.parts()] == list(posts_of(recv, first_step=True))
    meta_work = fake.works[-1]
    assert meta_work.polls == 0  # posting never waits
    transport._learnt.pop(("F", 1), None)
    (received,) = transport.wait(pending)
    assert meta_work.polls >= 4  # the host polled the metadata against its deadline
    assert fake.parts()[-1] == ("recv", "data") and received.shape == (2, 3)
    assert all(op.group == CHANNELS[Channel.F_UP] for b in fake.batches for op in b)


def test_sends_are_dropped_once_complete_and_nccl_finish_waits_for_none(monkeypatch) -> None:
    fake = FakeDist(monkeypatch, rank=0)
    transport = _transport(nccl=True)
    transport.begin_step()
    transport.begin_step()
    transport._learnt[("F", 1)] = (((4,), torch.float32),)
    fake.make_work = lambda: FakeWork(polls_to_complete=10**9)
    transport.send(("F", 1, 0), (torch.ones(4),), 1, Action(0, Kind.SEND_F, 0))
    assert transport.sends_in_flight == 1
    fake.works[0].polls_left = 0  # the send has run
    fake.make_work = lambda: FakeWork(polls_to_complete=10**9)
    transport.send(("F", 1, 1), (torch.ones(4),), 1, Action(0, Kind.SEND_F, 1))
    assert transport.sends_in_flight == 1  # the first one's tensors are gone
    transport.finish()
    assert fake.works[1].waits == []  # NCCL: the end of the step does not wait for a send
    assert transport.sends_in_flight == 1


def _fake_nccl_world(monkeypatch: pytest.MonkeyPatch, rank: int, world: int,
                     backend: str = "nccl", bound: torch.device | None = CUDA) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(groups, "default_bound_device", lambda: bound)


def _rank_stages(schedule, rank: int) -> dict:
    all_stages = transformer_stages(schedule.num_stages)
    return {s: all_stages[s] for s in schedule.stages_on_rank(rank)}


def test_pipeline_on_nccl_refuses_communicators_that_deadlock(monkeypatch) -> None:
    _fake_nccl_world(monkeypatch, rank=0, world=2)
    schedule = build_schedule("zbv", pp=2, microbatches=4)
    stages = _rank_stages(schedule, 0)
    with pytest.raises(ConfigError, match="deadlock.*channel_groups.*device_id"):
        Pipeline(stages, schedule, token_loss, backward_group="the B group")
    pipe = Pipeline(stages, schedule, token_loss, channel_groups=CHANNELS)
    assert pipe.distributed


def test_lazy_nccl_groups_are_refused_saying_how_to_bind_the_device(monkeypatch) -> None:
    _fake_nccl_world(monkeypatch, rank=0, world=2, bound=None)
    schedule = build_schedule("1f1b", pp=2, microbatches=4)
    with pytest.raises(ConfigError, match=r"lazily.*device_id=torch.device\('cuda'"):
        Pipeline(_rank_stages(schedule, 0), schedule, token_loss, channel_groups=CHANNELS)


@pytest.mark.parametrize(("backend", "device", "nccl"), [
    ("cpu:gloo,cuda:nccl", "cuda", True), ("cpu:gloo,cuda:nccl", "cpu", False),
    ("cuda:nccl,cpu:gloo", "cuda", True), ("nccl", "cuda", True), ("gloo", "cpu", False),
    ("cpu:gloo", "cuda", False),
])
def test_nccl_is_told_by_the_device_a_group_serves(monkeypatch, backend: str, device: str,
                                                     nccl: bool) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    assert groups.uses_nccl("a group", torch.device(device)) is nccl
    assert DistTransport(None, torch.device(device), 5.0, 4, 2,
                         channel_groups=CHANNELS)._nccl is nccl


def test_a_compound_backend_serving_cuda_gets_the_nccl_rules(monkeypatch) -> None:
    """"cpu:gloo,cuda:nccl" on a CUDA pipeline: the layout is checked, receives are posted in
    place (no lookahead) and waited for by the stream; on a CPU pipeline gloo's rules hold."""
    _fake_nccl_world(monkeypatch, rank=0, world=2, backend="cpu:gloo,cuda:nccl")
    schedule = build_schedule("zbv", pp=2, microbatches=4)
    stages = _rank_stages(schedule, 0)
    with pytest.raises(ConfigError, match="deadlock"):
        Pipeline(stages, schedule, token_loss, device="cuda:0", backward_group="the B group")
    on_cuda = Pipeline(stages, schedule, token_loss, device="cuda:0", channel_groups=CHANNELS)
    assert on_cuda._transport._nccl and on_cuda._executors[0]._early == {}
    on_cpu = Pipeline(stages, schedule, token_loss, backward_group="the B group")
    assert not on_cpu._transport._nccl and on_cpu._executors[0]._early


def test_connect_binds_the_cuda_device_and_makes_four_channels(monkeypatch) -> None:
    calls: dict[str, dict] = {}
    made: list[list[int]] = []
    monkeypatch.setattr(topology_module, "resolve_device",
                        lambda name, local: torch.device("cuda", 1))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.setdefault("init", dict(kw, backend=backend)))

    def new_group(members: list[int], timeout: object = None) -> object:
        made.append(list(members))
        return object()

    class FakeMesh:  # init_device_mesh's groups (pp, dp, tp), as the mesh would make them
        def get_group(self, name: str) -> object:
            return f"the {name} group"

        def __getitem__(self, name: str) -> FakeMesh:
            return self

    def init_device_mesh(device_type: str, shape: tuple[int, ...], **kw) -> FakeMesh:
        calls["mesh"] = dict(kw, device_type=device_type, shape=shape)
        return FakeMesh()

    import torch.distributed.device_mesh as device_mesh

    monkeypatch.setattr(device_mesh, "init_device_mesh", init_device_mesh)
    monkeypatch.setattr(topology_module, "_options", lambda backend, timeout: (backend, timeout))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(groups, "default_bound_device", lambda: torch.device("cuda", 1))
    splits: list[list[list[int]]] = []

    def split_group(split_ranks: list[list[int]], **kw: object) -> object:
        splits.append(split_ranks)
        return object()

    monkeypatch.setattr(dist, "split_group", split_group)
    from pipeoffload.parallel import job

    store = object()  # the ranks' meeting (parallel/job.py) is tested in test_job.py
    monkeypatch.setattr(job, "join_store", lambda env, timeout_s, agree: store)
    topology = topology_module.connect(pp=2, dp=2, device="cuda",
                              env={"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    init = calls["init"]
    assert init["backend"] == "nccl" and init["device_id"] == torch.device("cuda", 1)
    assert init["store"] is store and (init["rank"], init["world_size"]) == (0, 4)
    assert calls["mesh"]["device_type"] == "cuda" and calls["mesh"]["shape"] == (2, 2, 1, 1)
    assert calls["mesh"]["mesh_dim_names"] == ("pp", "dp", "cp", "tp")  # the default order
    assert topology.pp_group == "the pp group"
    assert set(topology.channel_groups) == set(Channel)
    assert len({id(g) for g in topology.channel_groups.values()}) == 4
    # One split of the default group per channel over both pipelines, no new_group per pipeline
    # (groups.py Note: [NCCL groups]).
    assert splits == [[[0, 2], [1, 3]]] * 4 and made == []


@pytest.mark.parametrize(("pp", "dp", "expected"), [
    (2, 2, [[0, 2]] * 4 + [[1, 3]] * 4),  # every process makes every pipeline's groups
    (1, 2, []),  # one stage: nothing to send, no channels
])
def test_gloo_gets_channel_groups_too(monkeypatch, pp: int, dp: int, expected) -> None:
    made: list[list[int]] = []

    def new_group(members: list[int], timeout: object = None) -> object:
        made.append(list(members))
        return object()

    class FakeMesh:
        def get_group(self, name: str) -> object:
            return f"the {name} group"

    import torch.distributed.device_mesh as device_mesh

    monkeypatch.setattr(device_mesh, "init_device_mesh", lambda *a, **kw: FakeMesh())
    monkeypatch.setattr(topology_module, "_options", lambda backend, timeout: (backend, timeout))
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "new_group", new_group)
    topology = topology_module.mesh_topology(pp, dp, 1, torch.device("cpu"))
    assert made == expected
    if pp > 1:  # this process (rank 0) is in the first pipeline
        assert set(topology.channel_groups) == set(Channel)
        assert len({id(g) for g in topology.channel_groups.values()}) == 4
    else:
        assert topology.channel_groups is None


def _consumed(action: Action) -> tuple[str, int, int] | None:
    """The received message the executor takes at a compute action (RankExecutor._take)."""
    if action.kind is Kind.F:
        return ("F", action.stage, action.microbatch)
    if action.kind.is_backward:
        return ("B", action.stage, action.microbatch)
    return None


@pytest.mark.parametrize(("name", "pp"), [("zbv", 2), ("zbv", 4), ("interleaved-1f1b", 2),
                                          ("v-half", 4), ("po-f", 4), ("1f1b", 4)])
def test_the_transport_posts_what_the_rendezvous_model_runs(monkeypatch, name: str,
                                                             pp: int) -> None:
    """Drive the real DistTransport as the executor does, rank by rank, over a whole lowered
    schedule (the connection warm-up, the first step and a later one): its batches are the
    model's posts, in order, on the model's channels."""
    lowered = with_comms(build_schedule(name, pp=pp, microbatches=2 * pp))
    for rank in range(pp):
        fake = FakeDist(monkeypatch, rank)
        transport = DistTransport(None, torch.device("cpu"), 5.0, lowered.num_stages,
                                  lowered.microbatches, channel_groups=CHANNELS, nccl=True)
        transport.connect_peers(peer_connections(lowered))
        warm = [(b[0].op is dist.isend, b[0].group, b[0].peer) for b in fake.batches]
        assert warm == [(s.op.send, CHANNELS[channel_of(lowered, s.op.message)], s.op.peer)
                        for s in warm_up_program(lowered, rank) if s.op is not None]
        assert all(w.waits for w in fake.works)  # each connection completed before the next
        for first_step in (True, False):
            transport.begin_step()
            fake.batches.clear()
            pending = {}
            for action in lowered.ranks[rank]:
                if action.kind in (Kind.SEND_F, Kind.SEND_B):
                    transport.send(message_of(action), (torch.ones(2, 3, dtype=torch.float64),),
                                   peer_of(lowered, action), action)
                elif action.kind in (Kind.RECV_F, Kind.RECV_B):
                    message = message_of(action)
                    pending[message] = transport.recv(message, peer_of(lowered, action),
                                                      META if message[0] == "B" else None, action)
                elif _consumed(action) in pending:
                    transport.wait(pending.pop(_consumed(action)))
            assert not pending
            posted = [(b[0].op is dist.isend, b[0].group, b[0].tag, b[0].peer)
                      for b in fake.batches]
            expected = [(s.op.send, CHANNELS[channel_of(lowered, s.op.message)],
                         transport._tag(s.op.message, s.op.part == "meta"), s.op.peer)
                        for s in host_program(lowered, rank, first_step) if s.op is not None]
            assert posted == expected
