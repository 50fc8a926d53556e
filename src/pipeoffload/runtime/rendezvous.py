"""A rendezvous model of NCCL point-to-point, run over a lowered schedule (pure Python).

Gloo delivers messages by tag and never makes a send wait for an unrelated message, so tests
over gloo cannot see what this model shows: whether the posting order of DistTransport, with a
given choice of communicators, can deadlock on NCCL.

Note: [rendezvous model]
- Per communicator, each rank's operations run one after another in posting order (one NCCL
  stream per communicator); a send completes only together with the matching receive, both at
  the head of their rank's queue on that communicator (messages larger than NCCL's buffers, the
  case of activations). With ``per_pair`` a communicator is one (group, rank pair), as NCCL
  builds lazily without ``device_id``; otherwise one per group (eager init with ``device_id``).
- Hosts post in program order what DistTransport posts (``posts_of``): one operation per
  message; on the first step a forward message is preceded by its shape metadata, whose receive
  the receiving host waits for (it needs the values) at the action that consumes the message,
  before posting the data receive.
- The consuming compute action (F for a forward message, I or B for a gradient) waits for the
  data. On gloo the host waits; on NCCL the compute stream does and the host runs on, but
  ProcessGroupNCCL makes every later operation's stream wait for the compute stream's work
  queued before it, so an operation posted after the consumer cannot start before the
  consumer ran either: holding the host at the consumer, as this model does, gives the same
  dependencies.
- A batch (one message's tensors, posted together) is one operation. Small messages that NCCL
  buffers (the metadata) are treated as rendezvous too, which can only add deadlocks: the model
  errs on the safe side. tests/test_runtime_nccl.py checks DistTransport posts what
  ``posts_of`` says.
- Connection setup (``lazy_connect``): NCCL connects a (communicator, sender -> receiver) pair
  the first time an operation on it is posted: ``p2pTaskAppend`` (NVIDIA/nccl src/enqueue.cc)
  marks the peer in ``connectSend`` / ``connectRecv``, and ``ncclGroupEnd`` runs
  ``ncclTransportP2pSetup`` (src/group.cc, src/transport.cc), which exchanges connection data
  with that peer by ``bootstrapSend`` / ``bootstrapRecv`` on the host. The sender's first post
  on the pair and the receiver's first post on it are therefore a host-level meeting: each host
  blocks at that post until the other reaches its own. ``warm_up`` prepends what
  ``Pipeline.connect_peers`` does before the first step: one tiny message per connection, in
  the one order of ``lowering.peer_connections`` on every rank, so that no step meets a
  connection setup.
- A device-wide synchronisation (``sync_at``: the caching allocator's ``cudaFree`` when an
  allocation fails and it retries, ``torch.cuda.empty_cache``, ``cudaHostAlloc`` /
  ``cudaHostRegister`` of pinned memory; CUDA C Programming Guide, "Implicit Synchronization")
  waits for everything queued on the device, this rank's posted NCCL operations included, which
  only complete with their peers: the host blocks there until every operation it posted so far
  has matched. runtime/pool.py keeps pinned allocations out of steps for that reason; Note:
  [GPU rules] in docs/runtime.md says which schedules survive one such sync anywhere.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.schedule import Schedule
from pipeoffload.runtime.lowering import (
    channel_of,
    message_of,
    peer_connections,
    sender_and_receiver,
    with_comms,
)

Message = tuple[str, int, int]
Lane = Callable[[Schedule, Message], Hashable]


@dataclass(frozen=True)
class Op:
    """One posted point-to-point operation."""

    send: bool
    part: str  # "meta", "data", or "warm" (the warm-up message of a connection)
    message: Message
    peer: int

    def connection(self, rank: int) -> tuple[int, int]:
        """(sender, receiver) of this operation posted by ``rank``."""
        return (rank, self.peer) if self.send else (self.peer, rank)


@dataclass(frozen=True)
class Outcome:
    """``deadlock`` is empty when every rank ran to its end with every operation matched."""

    deadlock: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.deadlock


def posts_of(action: Action, first_step: bool) -> tuple[str, ...]:
    """The parts DistTransport posts at a SEND or RECV action, in order (Note: [rendezvous
    model]): a forward message's metadata first on the first step; the receiver posts the
    data receive of such a message later, at its consumer."""
    meta = first_step and action.kind in (Kind.SEND_F, Kind.RECV_F)
    if action.kind is Kind.RECV_F and meta:
        return ("meta",)
    return ("meta", "data") if meta else ("data",)


def _consumed(action: Action) -> Message | None:
    """The received message a compute action needs, if it needs one."""
    if action.kind is Kind.F:
        return ("F", action.stage, action.microbatch)
    if action.kind in (Kind.I, Kind.B):
        return ("B", action.stage, action.microbatch)
    return None


@dataclass(frozen=True)
class Step:
    """One step of a host's program: post ``op``, wait for (``part``, ``message``), or (``sync``)
    wait until every operation this host posted so far has completed."""

    op: Op | None = None
    part: str = ""
    message: Message | None = None
    action: Action | None = None  # the action the host is at
    sync: bool = False


def warm_up_program(lowered: Schedule, rank: int,
                    connections: Sequence[tuple[object, int, int, Message]] | None = None
                    ) -> list[Step]:
    """``Pipeline.connect_peers`` on ``rank``: one warm-up message per connection this rank is
    an end of, in the order of ``lowering.peer_connections`` (the same on every rank), the host
    waiting for each to complete before the next."""
    program = []
    for _, sender, receiver, message in connections or peer_connections(lowered):
        if rank in (sender, receiver):
            send = rank == sender
            program.append(Step(Op(send, "warm", message, receiver if send else sender)))
            program.append(Step(sync=True))
    return program


def host_program(lowered: Schedule, rank: int, first_step: bool,
                 sync_before: int | None = None) -> list[Step]:
    """What DistTransport (driven by the executor) does on ``rank``, in order: the posts of each
    SEND / RECV, and at each consuming compute action the waits (and, on the first step, the
    data receive posted once the metadata arrived). ``sync_before``: a device-wide sync while
    the action at that index of the rank's lowered list runs (at its length: after the step's
    last action). See Note: [rendezvous model]."""
    program, ends = _program_and_ends(lowered, rank, first_step)
    return _with_sync(program, ends, sync_before)


def _program_and_ends(lowered: Schedule, rank: int,
                      first_step: bool) -> tuple[list[Step], list[int]]:
    """host_program without syncs, and for each action the length of the program after it."""
    program: list[Step] = []
    ends = []
    received: dict[Message, bool] = {}  # message -> whether its data receive is deferred
    for action in lowered.ranks[rank]:
        if action.kind.is_comm:
            message = message_of(action)
            sender, receiver = sender_and_receiver(lowered, message)
            send = action.kind in (Kind.SEND_F, Kind.SEND_B)
            parts = posts_of(action, first_step)
            program += [Step(Op(send, part, message, receiver if send else sender),
                             action=action) for part in parts]
            if not send:
                received[message] = "data" not in parts
        else:
            program += _consumer_steps(lowered, action, received)
        ends.append(len(program))
    return program, ends


def _with_sync(program: list[Step], ends: list[int], index: int | None) -> list[Step]:
    """``program`` with a device-wide sync while action ``index`` runs (after its waits)."""
    if index is None:
        return program
    at = ends[index] if index < len(ends) else len(program)
    action = None if index >= len(ends) else _action_at(program, ends, index)
    return program[:at] + [Step(action=action, sync=True)] + program[at:]


def _action_at(program: list[Step], ends: list[int], index: int) -> Action | None:
    begin = ends[index - 1] if index else 0
    steps = program[begin:ends[index]]
    return steps[0].action if steps else None


def _consumer_steps(lowered: Schedule, action: Action,
                    received: dict[Message, bool]) -> list[Step]:
    """The waits (and, for a deferred message, the metadata wait and the data receive) of a
    compute action that consumes a received message; nothing for other actions."""
    needed = _consumed(action)
    if needed is None or needed not in received:
        return []
    steps = []
    if received.pop(needed):
        sender, _ = sender_and_receiver(lowered, needed)
        steps.append(Step(part="meta", message=needed, action=action))
        steps.append(Step(Op(False, "data", needed, sender), action=action))
    steps.append(Step(part="data", message=needed, action=action))
    return steps


def sync_positions(schedule: Schedule) -> list[tuple[int, int]]:
    """Every (rank, index in the rank's lowered list) of a compute action: where a device-wide
    sync can happen in a step (an allocation inside F, I, W, B or RECOMPUTE)."""
    lowered = with_comms(schedule)
    return [(rank, index) for rank, actions in enumerate(lowered.ranks)
            for index, action in enumerate(actions) if action.kind.is_compute]


def simulate(schedule: Schedule, lane: Lane = channel_of, per_pair: bool = False,
             first_step: bool = False, lazy_connect: bool = False, warm_up: bool = False,
             sync_at: tuple[int, int] | None = None) -> Outcome:
    """Run every rank's posting and waiting under the model; see Note: [rendezvous model].

    ``lazy_connect``: model NCCL's connection setup on the first post per connection (a
    first step that no warm-up preceded); ``warm_up``: ``Pipeline.connect_peers`` runs first;
    ``sync_at``: (rank, index in that rank's lowered list) of one device-wide sync."""
    return _Model(schedule, lane, per_pair, first_step, lazy_connect, warm_up).run(sync_at)


def sync_deadlocks(schedule: Schedule, lane: Lane = channel_of, first_step: bool = False,
                   positions: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """The positions (default: ``sync_positions``) where one device-wide sync deadlocks, with
    the connections warmed up (the programs are built once for all positions)."""
    model = _Model(schedule, lane, False, first_step, False, True)
    return [at for at in positions or sync_positions(schedule) if not model.run(at).ok]


class _Model:
    """The hosts' programs of one configuration, run as often as asked with one sync each."""

    def __init__(self, schedule: Schedule, lane: Lane, per_pair: bool, first_step: bool,
                 lazy_connect: bool, warm_up: bool) -> None:
        self.lowered = with_comms(schedule)
        self.lane = lane
        self.per_pair = per_pair
        self.handshakes = lazy_connect or warm_up
        connections = peer_connections(self.lowered) if warm_up else []
        self.prefixes = [warm_up_program(self.lowered, r, connections) if warm_up else []
                         for r in range(self.lowered.num_ranks)]
        self.bodies = [_program_and_ends(self.lowered, r, first_step)
                       for r in range(self.lowered.num_ranks)]
        self.comms: dict[tuple[Message, int, int], Hashable] = {}

    def comm(self, message: Message, rank: int, peer: int) -> Hashable:
        key = (message, rank, peer)
        if key not in self.comms:
            group = self.lane(self.lowered, message)
            self.comms[key] = ((group, min(rank, peer), max(rank, peer)) if self.per_pair
                               else group)
        return self.comms[key]

    def run(self, sync_at: tuple[int, int] | None) -> Outcome:
        programs = [prefix + (_with_sync(body, ends, sync_at[1])
                              if sync_at is not None and sync_at[0] == rank else body)
                    for rank, (prefix, (body, ends)) in enumerate(zip(self.prefixes,
                                                                      self.bodies))]
        return _Run(self, programs).outcome()


class _Run:
    """One run of the hosts' programs under the model."""

    def __init__(self, model: _Model, programs: list[list[Step]]) -> None:
        self.model = model
        self.programs = programs
        ranks = len(programs)
        self.queues: dict[tuple[Hashable, int], deque[Op]] = {}
        self.received: list[set[tuple[str, Message]]] = [set() for _ in range(ranks)]
        self.pointer = [0] * ranks
        self.connected: set[tuple[Hashable, int, int]] = set()
        self.arrived: dict[tuple[Hashable, int, int], set[int]] = {}

    def handshake(self, rank: int, op: Op, key: Hashable) -> bool:
        """Whether ``rank`` may post ``op``: its connection is set up, or both ends have now
        reached their first post on it (Note: [rendezvous model], connection setup)."""
        connection = (key, *op.connection(rank))
        if not self.model.handshakes or connection in self.connected:
            return True
        ends = self.arrived.setdefault(connection, set())
        ends.add(rank)
        if len(ends) < 2:
            return False
        self.connected.add(connection)
        return True

    def advance(self, rank: int) -> bool:
        """Run rank's host as far as it can; True if it moved."""
        moved = False
        program = self.programs[rank]
        while self.pointer[rank] < len(program):
            step = program[self.pointer[rank]]
            if step.op is not None:
                key = self.model.comm(step.op.message, rank, step.op.peer)
                if not self.handshake(rank, step.op, key):
                    return moved
                self.queues.setdefault((key, rank), deque()).append(step.op)
            elif step.sync:
                if any(queue for (_, owner), queue in self.queues.items() if owner == rank):
                    return moved
            elif (step.part, step.message) not in self.received[rank]:
                return moved
            self.pointer[rank] += 1
            moved = True
        return moved

    def match(self) -> bool:
        """Complete every pair of matching operations at the heads of their queues."""
        fired_any = False
        fired = True
        while fired:
            fired = False
            for (key, rank), queue in self.queues.items():
                if not queue:
                    continue
                op = queue[0]
                other = self.queues.get((key, op.peer))
                if not other:
                    continue
                head = other[0]
                if (head.peer == rank and head.send != op.send and head.part == op.part
                        and head.message == op.message):
                    queue.popleft()
                    other.popleft()
                    receiver = op.peer if op.send else rank
                    self.received[receiver].add((op.part, op.message))
                    fired = fired_any = True
        return fired_any

    def outcome(self) -> Outcome:
        ranks = range(len(self.programs))
        progress = True
        while progress:
            progress = False
            for rank in ranks:
                progress |= self.advance(rank)
            progress |= self.match()
        stuck = [r for r in ranks if self.pointer[r] < len(self.programs[r])]
        waiting = [(key, rank, queue[0]) for (key, rank), queue in self.queues.items() if queue]
        if not stuck and not waiting:
            return Outcome(())
        lines = [_describe_wait(r, self.programs[r][self.pointer[r]]) for r in stuck]
        lines += [f"rank {rank} on communicator {key}: "
                  f"{'send' if op.send else 'receive'} of {op.part} {op.message} "
                  f"{'to' if op.send else 'from'} rank {op.peer} waits for its match"
                  for key, rank, op in waiting[:6]]
        return Outcome(tuple(lines))


def _describe_wait(rank: int, step: Step) -> str:
    if step.sync:
        return (f"rank {rank} waits at action {step.action} in a device-wide sync for its "
                "posted operations")
    if step.op is not None:
        sender, receiver = step.op.connection(rank)
        return (f"rank {rank} waits at action {step.action} to set up the connection "
                f"{sender} -> {receiver} ({step.op.part} {step.op.message})")
    return f"rank {rank} waits at action {step.action} for {step.part} {step.message}"
