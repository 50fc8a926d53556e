"""Making communication explicit: SEND / RECV actions where a stage boundary crosses ranks.

A schedule from a generator usually has compute (and transfer) actions only; the runtime then
adds, on each rank, RECV_F(s, m) right before F(s, m) and SEND_F(s, m) right after it when the
neighbouring stage lives on another rank, and likewise RECV_B / SEND_B around the backward that
produces or needs the gradient (I or B). A boundary between two stages of one rank (V placement)
gets nothing: the output is handed over in memory. A schedule that already has comm actions is
used as it is (torch.distributed.pipelining's lowered CSVs, for instance).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from enum import Enum

from pipeoffload.core.actions import OFFLOAD_KINDS, Action, Kind
from pipeoffload.core.deps import Dependencies
from pipeoffload.core.schedule import Schedule

_COMM = (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)


def with_comms(schedule: Schedule) -> Schedule:
    """``schedule`` with explicit SEND / RECV actions (unchanged if it has some already).
    Neighbours are those on the microbatch's route (``Schedule.previous_stage`` /
    ``next_stage``): where one route ends and the next begins nothing is sent, on whichever
    ranks the two stages live."""
    if schedule.has_kind(*_COMM):
        return schedule
    stages = range(schedule.num_stages)
    # Per stage: whether its input comes from, and its output goes to, another rank.
    takes_remote = [_on_other_rank(schedule, s, schedule.previous_stage(s)) for s in stages]
    gives_remote = [_on_other_rank(schedule, s, schedule.next_stage(s)) for s in stages]
    rows = []
    for actions in schedule.ranks:
        row: list[Action] = []
        for action in actions:
            stage, kind, mb = action
            if kind is Kind.F and takes_remote[stage]:
                row.append(Action(stage, Kind.RECV_F, mb))
            if kind.is_backward and gives_remote[stage]:
                row.append(Action(stage, Kind.RECV_B, mb))
            row.append(action)
            if kind is Kind.F and gives_remote[stage]:
                row.append(Action(stage, Kind.SEND_F, mb))
            if kind.is_backward and takes_remote[stage]:
                row.append(Action(stage, Kind.SEND_B, mb))
        rows.append(row)
    return schedule.with_ranks(rows)


def _on_other_rank(schedule: Schedule, stage: int, neighbour: int | None) -> bool:
    return neighbour is not None and schedule.rank_of(neighbour) != schedule.rank_of(stage)


def forward_only(lowered: Schedule) -> Schedule:
    """A lowered schedule's F actions and their SEND_F / RECV_F, in the same order: what
    Pipeline.evaluate runs (no backward, transfers or recomputation; NCCL pairs the forward
    messages in the order training posts them)."""
    return lowered.without(Kind.B, Kind.I, Kind.W, Kind.SEND_B, Kind.RECV_B, Kind.RECOMPUTE,
                           *OFFLOAD_KINDS)


def message_of(action: Action) -> tuple[str, int, int]:
    """The message a comm action sends or receives: (direction, receiving stage, microbatch)."""
    stage, kind, mb = action
    if kind is Kind.SEND_F:
        return ("F", stage + 1, mb)
    if kind is Kind.RECV_F:
        return ("F", stage, mb)
    if kind is Kind.SEND_B:
        return ("B", stage - 1, mb)
    if kind is Kind.RECV_B:
        return ("B", stage, mb)
    raise ValueError(f"{action} is not a communication action")


def peer_of(schedule: Schedule, action: Action) -> int:
    """The rank a comm action talks to."""
    stage, kind, _ = action
    neighbour = stage + 1 if kind in (Kind.SEND_F, Kind.RECV_B) else stage - 1
    return schedule.rank_of(neighbour)


class Channel(str, Enum):
    """Which communicator a message travels on: forward or backward, towards a higher or a
    lower rank (see Note: [NCCL channels])."""

    F_UP = "F_UP"
    F_DOWN = "F_DOWN"
    B_UP = "B_UP"
    B_DOWN = "B_DOWN"


# Note: [NCCL channels]
# NCCL runs the point-to-point operations of one communicator in posting order on one stream,
# and a large send completes only together with its receive, so two messages on one
# communicator can wait for each other across ranks. In runtime/rendezvous.py's model (m = 2p,
# one communicator per group), one communicator deadlocks every zoo schedule but gpipe, and one
# for forward plus one for backward messages still deadlocks zbv, v-half and interleaved-1f1b at
# p = 2, 4, 8 and v-min at p = 4, 8 (docs/runtime.md). Splitting each direction again by whether
# the receiver's rank is higher or lower than the sender's gives four communicators on which
# every zoo schedule runs, with and without offload, at p = 2, 4, 8
# (tests/test_runtime_rendezvous.py).


def sender_and_receiver(schedule: Schedule, message: tuple[str, int, int]) -> tuple[int, int]:
    """The ranks that send and receive ``message``."""
    direction, stage, _ = message
    source = stage - 1 if direction == "F" else stage + 1
    return schedule.rank_of(source), schedule.rank_of(stage)


def channel_between(direction: str, sender: int, receiver: int) -> Channel:
    """The communicator of a ``direction`` ("F" / "B") message from rank ``sender`` to rank
    ``receiver`` (Note: [NCCL channels])."""
    up = receiver > sender
    if direction == "F":
        return Channel.F_UP if up else Channel.F_DOWN
    return Channel.B_UP if up else Channel.B_DOWN


def channel_of(schedule: Schedule, message: tuple[str, int, int]) -> Channel:
    """The communicator ``message`` uses in ``schedule`` (Note: [NCCL channels])."""
    return channel_between(message[0], *sender_and_receiver(schedule, message))


_CHANNEL_ORDER = {channel: index for index, channel in enumerate(Channel)}


def peer_connections(schedule: Schedule
                     ) -> list[tuple[Channel, int, int, tuple[str, int, int]]]:
    """Every (channel, sender, receiver) that carries a message of ``schedule`` (lowered with
    ``with_comms``), with its first message, in one fixed order (channel, then sender, then
    receiver) that every rank computes alike: the order in which ``Pipeline.connect_peers`` sets
    up NCCL's connections before the first step (rendezvous.py Note: [rendezvous model])."""
    first: dict[tuple[Channel, int, int], tuple[str, int, int]] = {}
    for _, _, action in schedule.actions:
        if action.kind in (Kind.SEND_F, Kind.SEND_B):
            message = message_of(action)
            sender, receiver = sender_and_receiver(schedule, message)
            key = (channel_between(message[0], sender, receiver), sender, receiver)
            first.setdefault(key, message)
    ordered = sorted(first, key=lambda k: (_CHANNEL_ORDER[k[0]], k[1], k[2]))
    return [(*key, first[key]) for key in ordered]


def two_groups(schedule: Schedule, message: tuple[str, int, int]) -> Hashable:
    """The older layout, one communicator per direction F / B (deadlocks on NCCL for V-shaped
    schedules; kept to show that and for callers that pass only ``backward_group``)."""
    return message[0]


def one_group(schedule: Schedule, message: tuple[str, int, int]) -> Hashable:
    """Every message on one communicator."""
    return ""


def order_conflicts(schedule: Schedule, per_direction: bool = False,
                    lane: Callable[[Schedule, tuple[str, int, int]], Hashable] | None = None,
                    ) -> list[str]:
    """Pairs of ranks whose messages are received in another order than they are sent.

    Backends that ignore tags (NCCL) match messages between two ranks in posting order, so such a
    schedule would pair the wrong buffers; gloo matches by tag and does not care. With
    ``per_direction`` forward and backward messages are compared separately (what matters when
    each direction has its own communicator); ``lane`` generalises it: messages are compared per
    ``lane(schedule, message)`` (e.g. ``channel_of``).
    """
    if lane is None:
        lane = two_groups if per_direction else one_group
    sent: dict[tuple[int, int, Hashable], list[tuple[str, int, int]]] = {}
    received: dict[tuple[int, int, Hashable], list[tuple[str, int, int]]] = {}
    for rank, _, action in schedule.actions:
        message = message_of(action) if action.kind in _COMM else None
        if message is None:
            continue
        key = lane(schedule, message)
        if action.kind in (Kind.SEND_F, Kind.SEND_B):
            sent.setdefault((rank, peer_of(schedule, action), key), []).append(message)
        else:
            received.setdefault((peer_of(schedule, action), rank, key), []).append(message)
    problems = []
    for pair, messages in sorted(sent.items()):
        got = received.get(pair, [])
        if messages != got:
            first = next((i for i, (a, b) in enumerate(zip(messages, got)) if a != b),
                         min(len(messages), len(got)))
            problems.append(f"rank {pair[0]} -> rank {pair[1]}: message {first} is sent as "
                            f"{messages[first] if first < len(messages) else None} but received "
                            f"as {got[first] if first < len(got) else None}")
    return problems


def early_receives(actions: list[Action], lookahead: int) -> dict[Action, tuple[Action, ...]]:
    """Where to post this rank's receives ahead of their place in ``actions`` (lowered).

    Returns {action: RECVs to post just before running it}. Each RECV moves back over up to
    ``lookahead`` compute actions, so that it is outstanding while they run (torch's lowering
    posts receives as soon as the peer's send is scheduled); a RECV_B never moves before the F
    of its own (stage, microbatch), whose outputs give the gradient's shapes. Only for backends
    that match messages by tag (gloo): on NCCL the posting order is the protocol (Note: [NCCL
    channels]). A RECV absent from the result stays where it is.
    """
    moved: dict[Action, list[Action]] = {}
    computes: list[int] = []  # positions of the compute actions seen so far
    for index, action in enumerate(actions):
        kind = action.kind
        if kind.is_compute:
            computes.append(index)
            continue
        if kind not in (Kind.RECV_F, Kind.RECV_B) or not computes:
            continue
        window = computes[max(0, len(computes) - lookahead):]
        if kind is Kind.RECV_B:
            forward = Action(action.stage, Kind.F, action.microbatch)
            after = [i for i, position in enumerate(window) if actions[position] == forward]
            window = window[after[-1] + 1:] if after else window
        if not window:
            continue
        target = window[0]
        moved.setdefault(actions[target], []).append(action)
    return {at: tuple(recvs) for at, recvs in moved.items()}


def interleave(schedule: Schedule, ranks: tuple[int, ...]) -> list[tuple[int, Action]]:
    """One execution order of ``ranks``' lists that respects every dependency among them.

    For one rank it is that rank's list. For several (local mode) each rank runs as far as it
    can, round robin, like the validator's clockless run; dependencies on ranks outside
    ``ranks`` do not exist here (local mode holds them all).
    """
    if len(ranks) == 1:
        return [(ranks[0], a) for a in schedule.ranks[ranks[0]]]
    deps = Dependencies(schedule)
    done: set[Action] = set()
    pointer = {r: 0 for r in ranks}
    order: list[tuple[int, Action]] = []
    progress = True
    while progress:
        progress = False
        for rank in ranks:
            actions = schedule.ranks[rank]
            while pointer[rank] < len(actions):
                action = actions[pointer[rank]]
                if any(d not in done for d in deps.of(action)):
                    break
                done.add(action)
                order.append((rank, action))
                pointer[rank] += 1
                progress = True
    assert all(pointer[r] == len(schedule.ranks[r]) for r in ranks), "validated schedule deadlocked"
    return order
