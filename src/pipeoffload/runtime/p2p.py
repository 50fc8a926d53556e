"""Moving stage outputs and input gradients between ranks, separate from compute.

Two transports with one interface: ``LocalTransport`` (one process runs every rank: a mailbox)
and ``DistTransport`` (torch.distributed point-to-point, any process group, gloo or NCCL).
DistTransport learns tensor shapes and dtypes on the first step (each forward message is then
preceded by a small metadata message), posts batched isend / irecv, matches messages by tag
(gloo) or by order (NCCL: see lowering.order_conflicts), and turns a peer that died or never
sends into a PipelineRuntimeError naming the action that waited, after ``timeout_s``.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pipeoffload.core.actions import Action
from pipeoffload.errors import PipelineRuntimeError

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
    works: list[object] = field(default_factory=list)
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


class DistTransport:
    """torch.distributed P2P for rank ``rank`` of ``group`` (None = the default group)."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device,
                 timeout_s: float, num_stages: int, microbatches: int,
                 backward_group: dist.ProcessGroup | None = None) -> None:
        self._group = group
        self._groups = {"F": group, "B": group if backward_group is None else backward_group}
        self._rank = dist.get_rank(group)
        self._device = device
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._stages = num_stages
        self._microbatches = microbatches
        self._learnt: dict[tuple[str, int], Meta] = {}  # (direction, receiving stage) -> meta
        self._sends: list[tuple[list[object], TensorTuple, Action, int]] = []
        self._step = 0

    def begin_step(self) -> None:
        self._step += 1

    @property
    def _first_step(self) -> bool:
        return self._step == 1

    def _global(self, peer: int) -> int:
        return peer if self._group is None else dist.get_global_rank(self._group, peer)

    def _tag(self, message: Message, meta: bool = False) -> int:
        direction, stage, mb = message
        tag = 2 * (mb * self._stages + stage) + (direction == "B")
        return tag + (2 * self._stages * self._microbatches if meta else 0)

    def send(self, message: Message, tensors: TensorTuple, peer: int, action: Action) -> None:
        boundary = (message[0], message[1])
        meta = meta_of(tensors)
        ops = []
        if message[0] == "F":
            if self._first_step:
                ops.append(self._op(dist.isend, _encode(meta, action).to(self._device), peer,
                                     message, True))
                self._learnt.setdefault(boundary, meta)
            if self._learnt.get(boundary) != meta:
                raise PipelineRuntimeError(
                    f"rank {self._rank}, {action}: outputs have shapes {meta} but "
                    f"{self._learnt.get(boundary)} on the first step; the receiver's buffers "
                    "have the first step's shapes (shapes must not change between steps)"
                )
        payload = tuple(t.contiguous() for t in tensors)
        ops.extend(self._op(dist.isend, t, peer, message) for t in payload)
        works = self._post(ops, action, peer, "the send to start")
        self._sends.append((works, payload, action, peer))

    def recv(self, message: Message, peer: int, meta: Meta | None, action: Action) -> Pending:
        """Post a receive. ``meta`` is known for gradients; forward shapes are learnt."""
        pending = Pending(message, peer, action)
        if meta is None:
            meta = self._learnt.get((message[0], message[1]))
        if meta is None or (message[0] == "F" and self._first_step):
            pending.meta_buffer = torch.zeros(_META_LEN, dtype=torch.int64, device=self._device)
            pending.works = self._post(
                [self._op(dist.irecv, pending.meta_buffer, peer, message, True)],
                action, peer, "shape metadata")
            return pending
        self._post_data(pending, meta)
        return pending

    def _post_data(self, pending: Pending, meta: Meta) -> None:
        pending.buffers = tuple(torch.empty(shape, dtype=dtype, device=self._device)
                                for shape, dtype in meta)
        ops = [self._op(dist.irecv, b, pending.peer, pending.message) for b in pending.buffers]
        pending.works = self._post(ops, pending.action, pending.peer, "tensors")

    def wait(self, pending: Pending) -> TensorTuple:
        if pending.meta_buffer is not None:
            self._wait_all(pending.works, pending.action, pending.peer, "shape metadata")
            meta = _decode(pending.meta_buffer)
            self._learnt.setdefault((pending.message[0], pending.message[1]), meta)
            pending.meta_buffer = None
            self._post_data(pending, meta)
        self._wait_all(pending.works, pending.action, pending.peer, "tensors")
        return pending.buffers

    def finish(self) -> None:
        """Wait for every send of this step (so their buffers may be freed)."""
        sends, self._sends = self._sends, []
        for works, _, action, peer in sends:
            self._wait_all(works, action, peer, "the send to complete")

    def abandon(self) -> None:
        """Forget a failed step's sends (they cannot be cancelled; the group is suspect now)."""
        self._sends = []

    def _op(self, fn: object, tensor: torch.Tensor, peer: int, message: Message,
            meta: bool = False) -> dist.P2POp:
        return dist.P2POp(fn, tensor, self._global(peer), self._groups[message[0]],
                          self._tag(message, meta))

    def _post(self, ops: list[dist.P2POp], action: Action, peer: int, what: str) -> list[object]:
        if not ops:
            return []
        try:
            if len(ops) == 1:  # batching one op only adds overhead (NCCL coalesces several)
                op = ops[0]
                return [op.op(op.tensor, op.peer, op.group, op.tag)]
            return list(dist.batch_isend_irecv(ops))
        except Exception as error:
            raise self._failure(action, peer, what, repr(error)) from error

    def _wait_all(self, works: list[object], action: Action, peer: int, what: str) -> None:
        for work in works:
            try:
                completed = work.wait(self._timeout)  # type: ignore[attr-defined]
            except Exception as error:
                raise self._failure(action, peer, what, repr(error)) from error
            if completed is False:
                raise self._failure(action, peer, what, "timed out")

    def _failure(self, action: Action, peer: int, what: str, why: str) -> PipelineRuntimeError:
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
