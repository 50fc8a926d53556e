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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.schedule import Schedule
from pipeoffload.runtime.lowering import channel_of, message_of, sender_and_receiver, with_comms

Message = tuple[str, int, int]
Lane = Callable[[Schedule, Message], Hashable]


@dataclass(frozen=True)
class Op:
    """One posted point-to-point operation."""

    send: bool
    part: str  # "meta" or "data"
    message: Message
    peer: int


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
    """One step of a host's program: post ``op``, or wait for (``part``, ``message``)."""

    op: Op | None = None
    part: str = ""
    message: Message | None = None
    action: Action | None = None  # the action the host is at


def host_program(lowered: Schedule, rank: int, first_step: bool) -> list[Step]:
    """What DistTransport (driven by the executor) does on ``rank``, in order: the posts of each
    SEND / RECV, and at each consuming compute action the waits (and, on the first step, the
    data receive posted once the metadata arrived). See Note: [rendezvous model]."""
    program: list[Step] = []
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
            continue
        needed = _consumed(action)
        if needed is None or needed not in received:
            continue
        if received.pop(needed):
            sender, _ = sender_and_receiver(lowered, needed)
            program.append(Step(part="meta", message=needed, action=action))
            program.append(Step(Op(False, "data", needed, sender), action=action))
        program.append(Step(part="data", message=needed, action=action))
    return program


def simulate(schedule: Schedule, lane: Lane = channel_of, per_pair: bool = False,
             first_step: bool = False) -> Outcome:
    """Run every rank's posting and waiting under the model; see Note: [rendezvous model]."""
    lowered = with_comms(schedule)
    ranks = lowered.num_ranks
    programs = [host_program(lowered, r, first_step) for r in range(ranks)]
    queues: dict[tuple[Hashable, int], deque[Op]] = {}
    received: list[set[tuple[str, Message]]] = [set() for _ in range(ranks)]
    pointer = [0] * ranks

    def comm(message: Message, rank: int, peer: int) -> Hashable:
        group = lane(lowered, message)
        return (group, min(rank, peer), max(rank, peer)) if per_pair else group

    def advance(rank: int) -> bool:
        """Run rank's host as far as it can; True if it moved."""
        moved = False
        program = programs[rank]
        while pointer[rank] < len(program):
            step = program[pointer[rank]]
            if step.op is not None:
                key = (comm(step.op.message, rank, step.op.peer), rank)
                queues.setdefault(key, deque()).append(step.op)
            elif (step.part, step.message) not in received[rank]:
                return moved
            pointer[rank] += 1
            moved = True
        return moved

    def match() -> bool:
        """Complete every pair of matching operations at the heads of their queues."""
        fired_any = False
        fired = True
        while fired:
            fired = False
            for (key, rank), queue in queues.items():
                if not queue:
                    continue
                op = queue[0]
                other = queues.get((key, op.peer))
                if not other:
                    continue
                head = other[0]
                if (head.peer == rank and head.send != op.send and head.part == op.part
                        and head.message == op.message):
                    queue.popleft()
                    other.popleft()
                    receiver = op.peer if op.send else rank
                    received[receiver].add((op.part, op.message))
                    fired = fired_any = True
        return fired_any

    progress = True
    while progress:
        progress = False
        for rank in range(ranks):
            progress |= advance(rank)
        progress |= match()
    stuck = [r for r in range(ranks) if pointer[r] < len(programs[r])]
    waiting = [(key, rank, queue[0]) for (key, rank), queue in queues.items() if queue]
    if not stuck and not waiting:
        return Outcome(())
    lines = [f"rank {r} waits at action {programs[r][pointer[r]].action} for "
             f"{programs[r][pointer[r]].part} {programs[r][pointer[r]].message}"
             for r in stuck]
    lines += [f"rank {rank} on communicator {key}: "
              f"{'send' if op.send else 'receive'} of {op.part} {op.message} "
              f"{'to' if op.send else 'from'} rank {op.peer} waits for its match"
              for key, rank, op in waiting[:6]]
    return Outcome(tuple(lines))
