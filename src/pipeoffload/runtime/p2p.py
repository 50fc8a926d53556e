"""Moving stage outputs and input gradients between ranks, separate from compute.

Two transports with one interface: ``LocalTransport`` (one process runs every rank: a mailbox)
and ``DistTransport`` (torch.distributed point-to-point, any process group, gloo or NCCL).
DistTransport learns tensor shapes and dtypes on the first step (each forward message is then
preceded by a small metadata message), and turns a peer that died or never sends into a
PipelineRuntimeError naming the action that waited, after ``timeout_s``.

Note: [NCCL posting] what makes the same code right on NCCL, where gloo forgives:
- One posting style: every operation goes through ``dist.batch_isend_irecv`` (a batch per
  message part, the same batches on both sides), so NCCL never puts a message's two halves on
  different communicators (unbatched and batched P2P do without ``device_id``).
- Messages travel on four communicators, forward / backward x towards a higher / lower rank
  (lowering.py Note: [NCCL channels]); runtime/rendezvous.py checks that no schedule deadlocks.
  ``groups.channel_groups`` makes them; gloo gains from them too (``groups.new_channel_groups``).
- Connections before the first step: NCCL sets up a (communicator, sender -> receiver) pair
  in the host on its first post, a blocking meeting with the peer's first post on it
  (rendezvous.py Note: [rendezvous model]); ``connect_peers`` sends one tiny message per
  connection in one order on every rank, so that no step meets a set-up.
- Nothing allocates pinned memory inside a step: the first step's metadata leaves from a
  pinned staging area made by ``connect_peers`` (a pinned allocation synchronises the device,
  which can deadlock NCCL mid-step; docs/runtime.md "GPU rules").
- No host wait on NCCL: a receive is waited for with ``work.wait()``, which makes the compute
  stream wait; a timeout there would busy-wait the host. Hangs are bounded by the process
  group's own timeout (``init_process_group(timeout=)``, NCCL's watchdog). Only the first
  step's shape metadata is waited for by the host (it needs the values), polling
  ``is_completed`` against ``timeout_s``. On gloo the host waits with ``timeout_s``.
- A send's tensors are dropped as soon as its work is seen completed (checked whenever a
  message is posted), not at the end of the step; on NCCL the process group keeps them safe
  from the allocator until the send has run (PyTorch >= 2.7 stashes the tensors of a work
  until it is waited for or seen complete, instead of ``record_stream``: pytorch/pytorch#148590),
  so the end of a step waits for nothing there.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pipeoffload.core.actions import Action
from pipeoffload.errors import PipelineRuntimeError
from pipeoffload.runtime.groups import uses_nccl
from pipeoffload.runtime.lowering import Channel, channel_between

TensorTuple = tuple[torch.Tensor, ...]
Meta = tuple[tuple[tuple[int, ...], torch.dtype], ...]
Message = tuple[str, int, int]  # (direction "F" / "B", receiving stage, microbatch)

_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)
_META_LEN = 64


def meta_of(tensors: TensorTuple) -> Meta:
    return tuple((tuple(t.shape), t.dtype) for t in tensors)


@dataclass
class Pending:
    """A posted receive; ``DistTransport.wait`` / ``LocalTransport.wait`` completes it."""

    message: Message
    peer: int
    action: Action
    works: list[dist.Work] = field(default_factory=list)
    buffers: TensorTuple = ()
    meta_buffer: torch.Tensor | None = None


class LocalTransport:
    """Every rank in this process: a send is a mailbox entry, a receive takes it."""

    def __init__(self) -> None:
        self._box: dict[Message, TensorTuple] = {}

    def begin_step(self) -> None:
        self._box.clear()

    def send(self, message: Message, tensors: TensorTuple, peer: int, action: Action) -> None:
        # A copy, as a real transfer would make: the receiver owns its activation storage.
        self._box[message] = tuple(t.detach().clone() for t in tensors)

    def recv(self, message: Message, peer: int, meta: Meta | None, action: Action) -> Pending:
        return Pending(message, peer, action)

    def wait(self, pending: Pending) -> TensorTuple:
        try:
            return self._box.pop(pending.message)
        except KeyError:
            raise PipelineRuntimeError(
                f"{pending.action}: message {pending.message} was never sent; the schedule "
                "runs a receive before the matching send"
            ) from None

    def abandon(self) -> None:
        self._box.clear()

    def finish(self) -> None:
        if self._box:
            raise PipelineRuntimeError(f"messages sent but never received: {sorted(self._box)}")


@dataclass
class _Sent:
    """A posted send (or metadata send): kept until its works complete."""

    works: list[dist.Work]
    tensors: TensorTuple
    action: Action
    peer: int


class DistTransport:
    """torch.distributed P2P for rank ``rank`` of ``group`` (None = the default group).

    ``channel_groups``: one process group over the same ranks per Channel (Note: [NCCL
    posting]); without it forward messages use ``group`` and gradients ``backward_group`` (or
    ``group``). ``nccl``: whether NCCL carries this device's tensors (default: asked of
    ``group``, groups.uses_nccl).
    """

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device,
                 timeout_s: float, num_stages: int, microbatches: int,
                 backward_group: dist.ProcessGroup | None = None,
                 channel_groups: Mapping[Channel, dist.ProcessGroup] | None = None,
                 nccl: bool | None = None) -> None:
        self._group = group
        backward = group if backward_group is None else backward_group
        self._groups = {c: (backward if c.value.startswith("B") else group) for c in Channel}
        if channel_groups is not None:
            self._groups.update(channel_groups)
        self._rank = dist.get_rank(group)
        self._nccl = uses_nccl(group, device) if nccl is None else nccl
        self._device = device
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._stages = num_stages
        self._microbatches = microbatches
        self._learnt: dict[tuple[str, int], Meta] = {}  # (direction, receiving stage) -> meta
        self._sends: list[_Sent] = []
        self._step = 0
        self._staging: torch.Tensor | None = None  # pinned rows for the first step's metadata
        self._staged = 0

    def connect_peers(self, connections: Sequence[tuple[Channel, int, int, object]],
                      metadata_sends: int = 0) -> None:
        """Before the first step: set up every connection of ``connections`` (sender and
        receiver ranks of this group per channel, ``lowering.peer_connections``: the same list
        in the same order on every rank) with a one-element message each, waiting for each on
        the host with the timeout; and make the pinned staging rows of the first step's
        ``metadata_sends`` shape messages (Note: [NCCL posting])."""
        if self._device.type == "cuda" and metadata_sends:
            self._staging = torch.empty((metadata_sends, _META_LEN), dtype=torch.int64,
                                        pin_memory=True)
        token = torch.zeros(1, dtype=torch.int64, device=self._device)
        for channel, sender, receiver, _ in connections:
            if self._rank not in (sender, receiver):
                continue
            send = self._rank == sender
            peer = receiver if send else sender
            what = f"connection setup ({channel.value}, rank {sender} -> rank {receiver})"
            op = dist.P2POp(dist.isend if send else dist.irecv, token, self._global(peer),
                            self._groups[channel], self._warm_tag(channel))
            self._host_wait(self._post([op], what, peer, "the connection"), what, peer,
                            "the connection")

    def begin_step(self) -> None:
        self._step += 1

    @property
    def _first_step(self) -> bool:
        return self._step == 1

    @property
    def sends_in_flight(self) -> int:
        """Sends posted and not yet seen completed (their tensors are still held)."""
        return len(self._sends)

    def _global(self, peer: int) -> int:
        return peer if self._group is None else dist.get_global_rank(self._group, peer)

    def _warm_tag(self, channel: Channel) -> int:
        """Tags above every message's and metadata's (``_tag``): gloo matches by tag."""
        return 4 * self._stages * self._microbatches + list(Channel).index(channel)

    def _tag(self, message: Message, meta: bool = False) -> int:
        direction, stage, mb = message
        tag = 2 * (mb * self._stages + stage) + (direction == "B")
        return tag + (2 * self._stages * self._microbatches if meta else 0)

    def send(self, message: Message, tensors: TensorTuple, peer: int, action: Action) -> None:
        self._drop_completed_sends()
        boundary = (message[0], message[1])
        meta = meta_of(tensors)
        if message[0] == "F":
            if self._first_step:
                encoded = self._to_device(_encode(meta, action))
                works = self._post([self._op(True, encoded, peer, message, True)],
                                   action, peer, "shape metadata")
                self._sends.append(_Sent(works, (encoded,), action, peer))
                self._learnt.setdefault(boundary, meta)
            if self._learnt.get(boundary) != meta:
                raise PipelineRuntimeError(
                    f"rank {self._rank}, {action}: outputs have shapes {meta} but "
                    f"{self._learnt.get(boundary)} on the first step; the receiver's buffers "
                    "have the first step's shapes (shapes must not change between steps)"
                )
        payload = tuple(t.contiguous() for t in tensors)
        works = self._post([self._op(True, t, peer, message) for t in payload],
                           action, peer, "the send to start")
        self._sends.append(_Sent(works, payload, action, peer))

    def recv(self, message: Message, peer: int, meta: Meta | None, action: Action) -> Pending:
        """Post a receive. ``meta`` is known for gradients; forward shapes are learnt."""
        self._drop_completed_sends()
        pending = Pending(message, peer, action)
        if meta is None:
            meta = self._learnt.get((message[0], message[1]))
        if meta is None or (message[0] == "F" and self._first_step):
            pending.meta_buffer = torch.zeros(_META_LEN, dtype=torch.int64, device=self._device)
            pending.works = self._post(
                [self._op(False, pending.meta_buffer, peer, message, True)],
                action, peer, "shape metadata")
            return pending
        self._post_data(pending, meta)
        return pending

    def _post_data(self, pending: Pending, meta: Meta) -> None:
        pending.buffers = tuple(torch.empty(shape, dtype=dtype, device=self._device)
                                for shape, dtype in meta)
        ops = [self._op(False, b, pending.peer, pending.message) for b in pending.buffers]
        pending.works = self._post(ops, pending.action, pending.peer, "tensors")

    def wait(self, pending: Pending) -> TensorTuple:
        """The received tensors; on NCCL the current stream waits for them, not the host."""
        if pending.meta_buffer is not None:
            self._host_wait(pending.works, pending.action, pending.peer, "shape metadata")
            meta = _decode(pending.meta_buffer)
            self._learnt.setdefault((pending.message[0], pending.message[1]), meta)
            pending.meta_buffer = None
            self._post_data(pending, meta)
        if self._nccl:
            self._stream_wait(pending.works, pending.action, pending.peer)
        else:
            self._host_wait(pending.works, pending.action, pending.peer, "tensors")
        return pending.buffers

    def finish(self) -> None:
        """End of step. Gloo: wait for every send (its buffers may then be freed). NCCL: wait
        for none; the process group keeps unfinished sends' buffers (Note: [NCCL posting])."""
        if self._nccl:
            self._drop_completed_sends()
            return
        sends, self._sends = self._sends, []
        for sent in sends:
            self._host_wait(sent.works, sent.action, sent.peer, "the send to complete")

    def abandon(self) -> None:
        """Forget a failed step's sends (they cannot be cancelled; the group is suspect now)."""
        self._sends = []

    def _drop_completed_sends(self) -> None:
        self._sends = [s for s in self._sends
                       if not all(w.is_completed() for w in s.works)]

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A small host tensor on the device, from a pinned staging row made before the first
        step (no pinned allocation inside a step), without a pageable synchronous copy."""
        if self._device.type != "cuda":
            return host
        if self._staging is None or self._staged >= len(self._staging):
            raise PipelineRuntimeError(
                f"rank {self._rank}: no pinned staging row left for shape metadata; "
                "Pipeline.connect_peers makes one per forward message of the first step")
        row = self._staging[self._staged]
        self._staged += 1
        row.copy_(host)
        return row.to(self._device, non_blocking=True)

    def _op(self, send: bool, tensor: torch.Tensor, peer: int, message: Message,
            meta: bool = False) -> dist.P2POp:
        ends = (self._rank, peer) if send else (peer, self._rank)
        channel = channel_between(message[0], *ends)
        return dist.P2POp(dist.isend if send else dist.irecv, tensor, self._global(peer),
                          self._groups[channel], self._tag(message, meta))

    def _post(self, ops: list[dist.P2POp], action: Action | str, peer: int,
              what: str) -> list[dist.Work]:
        if not ops:
            return []
        try:
            return list(dist.batch_isend_irecv(ops))
        except Exception as error:
            raise self._failure(action, peer, what, repr(error)) from error

    def _stream_wait(self, works: list[dist.Work], action: Action | str, peer: int) -> None:
        for work in works:
            try:
                work.wait()
            except Exception as error:
                raise self._failure(action, peer, "tensors", repr(error)) from error

    def _host_wait(self, works: list[dist.Work], action: Action | str, peer: int,
                   what: str) -> None:
        """Block the host until ``works`` complete, at most ``timeout_s``."""
        if self._nccl:
            deadline = time.monotonic() + self._timeout.total_seconds()
            while not all(w.is_completed() for w in works):
                if time.monotonic() > deadline:
                    raise self._failure(action, peer, what, "timed out")
                time.sleep(0.0002)
            self._stream_wait(works, action, peer)
            return
        for work in works:
            try:
                completed = work.wait(self._timeout)
            except Exception as error:
                raise self._failure(action, peer, what, repr(error)) from error
            if completed is False:
                raise self._failure(action, peer, what, "timed out")

    def _failure(self, action: Action | str, peer: int, what: str,
                 why: str) -> PipelineRuntimeError:
        return PipelineRuntimeError(
            f"rank {self._rank}: {action} waited for {what} from/to rank {peer} and failed after "
            f"at most {self._timeout.total_seconds():g} s ({why}). The peer died, failed, or runs "
            "a different schedule or shapes; look at its error. Tune RuntimeConfig.p2p_timeout_s."
        )


def _encode(meta: Meta, action: Action) -> torch.Tensor:
    values = [len(meta)]
    for shape, dtype in meta:
        if dtype not in _DTYPES:
            raise PipelineRuntimeError(f"{action}: cannot send dtype {dtype}; supported: {_DTYPES}")
        values += [_DTYPES.index(dtype), len(shape), *shape]
    if len(values) > _META_LEN:
        raise PipelineRuntimeError(f"{action}: too many or too high-rank outputs to describe in "
                                   f"{_META_LEN} integers")
    return torch.tensor(values + [0] * (_META_LEN - len(values)), dtype=torch.int64)


def _decode(buffer: torch.Tensor) -> Meta:
    values = buffer.tolist()
    count, position, meta = values[0], 1, []
    for _ in range(count):
        dtype, ndim = _DTYPES[values[position]], values[position + 1]
        shape = tuple(values[position + 2: position + 2 + ndim])
        meta.append((shape, dtype))
        position += 2 + ndim
    return tuple(meta)
