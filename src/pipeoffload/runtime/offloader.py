"""The activation offloader: moves a (stage, microbatch)'s saved tensors to host and back.

One saved_tensors_hooks scope per (stage, microbatch) forward captures what autograd saves
(docs/method.md section 5): parameters and tiny tensors (<= OffloadConfig.min_offload_elements
elements) stay as they are; every other saved tensor is recorded by its storage, so several saved
views of one storage move once and come back as the same views (same offset, sizes, strides).

Note: [streaming offload] (shared with the simulator, sim/memory.py) a scope opened with
``stream=True`` starts each storage's copy to host as soon as autograd saves it, during the
forward, and the offloader keeps its device reference only until that copy has completed; the
OFFLOAD action then only marks the scope offloaded. With ``stream=False`` OFFLOAD starts the
copies after the forward. Either way the device storage is released when its copy completes;
RELOAD allocates device memory, starts the copy back, and the backward that needs it waits on it
(``wait_reloaded``). On CUDA copies run on two side streams
(device-to-host, host-to-device) ordered by events, into pinned pooled buffers, and the host never
blocks. On CPU the same code runs with synchronous copies: the host copy is a separate tensor and
the original storage is released at once.
Shapes may change between steps: records live for one forward/backward, buffers are pooled by size.

Note: [release order] the device storage of a copy to host is released in one of two ways:
- in host time: ``poll`` (between actions) releases the copies whose event has completed; copies
  complete in the order they were queued on the one copy stream, so it pops a deque's head;
- in stream order: the compute stream waits for a copy's event and the storage is released at
  once, so whatever the allocator gives that memory to next is queued behind the copy. OFFLOAD_WAIT
  does this for its scope, and so does the cap ``OffloadConfig.max_pending_copy_bytes`` for the
  oldest copies whenever more device bytes than that wait for their copy: when the host runs
  ahead of the GPU, host-time release alone would keep offloaded activations on the device long
  after their copy (a peak above the plan's).

Note: [kept on device] a saved DTensor (tensor parallelism) is moved as its local shard and
rebuilt around the returned shard when autograd unpacks it, and an AsyncCollectiveTensor as
the tensor its collective produced (runtime/shards.py). What stays on
the device is summed by reason in ``kept_bytes``: parameters, tensors of at most
``min_offload_elements`` elements, tensors on another device, and what is not a dense tensor
(sparse, meta, other tensor subclasses), which the offloader cannot rebuild.

Note: [class offload] a scope opened with ``classes`` (the schedule's ClassChoice of that
(stage, microbatch), core/classes.py) moves only the storages whose tensor class is one of them:
a storage's class is the one ``ClassTagger`` (runtime/classes.py) names when autograd first saves
it; the others stay on the device as a kept tensor does ("kept by class choice" in
``kept_bytes``), counted resident by the meter until autograd frees them. Every scope's bytes per
class are recorded (``class_bytes``) so a run can size the classes the simulator reads.

Note: [fetch on use] (shared with the simulator, sim/simulator.py) FETCH is the alternative to
RELOAD: it only marks the scope, and from then on every backward pass (I, W or B) reads each
saved storage back from its host copy when autograd unpacks it (``_unpack``). The offloader keeps
no device reference to that copy, only a weak one to its storage, so the copy lives as long as
autograd uses it (the node that unpacked it), several views of one storage unpacked while it
lives share it, and nothing of the activation is held on the device between uses; the meter never
counts it. Host copies stay until ``discard`` at the end of the backward (W re-reads). On CUDA a
read is queued on the host-to-device stream after the storage's copy out, and the stream
autograd runs the node on waits for it (never the host).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Hashable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import cast

import torch

from pipeoffload.errors import PipelineRuntimeError
from pipeoffload.runtime.class_recompute import OpRecorder, Ref, replay
from pipeoffload.runtime.classes import ClassTagger
from pipeoffload.runtime.config import OffloadConfig
from pipeoffload.runtime.copies import CopyEngine, CopyQueue, CudaCopies, HostCopies
from pipeoffload.runtime.keep import KeepRule
from pipeoffload.runtime.meter import ActivationMeter, ResidentToken, storage_key
from pipeoffload.runtime.pool import HostBufferPool
from pipeoffload.runtime.shards import (
    SavedShard,
    ShardLayout,
    is_dtensor,
    is_pending_collective,
    local_shards,
)


@dataclass(eq=False)
class _Storage:
    """One saved device storage: its bytes on the device and/or on the host."""

    nbytes: int
    device: torch.device
    on_device: torch.Tensor | None  # uint8 alias of the whole storage while it is on the device
    original: weakref.ref  # the storage it was saved from, to tell a reused address apart
    token: ResidentToken | None = None
    host: torch.Tensor | None = None
    copied: object | None = None  # CUDA: event of its copy to host
    read: object | None = None  # CUDA: event of the last fetch-on-use read of ``host``
    fetched: weakref.ref | None = None  # the storage of the live fetched copy, if any
    pending: bool = False  # on the device, its copy to host queued and not seen complete

    def device_bytes(self) -> torch.Tensor:
        """``on_device``, where the caller's state says the storage is on the device."""
        assert self.on_device is not None, "the storage is not on the device"
        return self.on_device

    def host_bytes(self) -> torch.Tensor:
        """``host``, where the caller's state says the storage has a host copy."""
        assert self.host is not None, "the storage has no host buffer"
        return self.host


@dataclass(eq=False)
class _Scope:
    key: Hashable
    owner: Hashable
    stream: bool
    storages: dict[tuple[str, int], _Storage] = field(default_factory=dict)
    offloaded: bool = False
    fetched: bool = False
    reload_event: object | None = None
    keep: frozenset[tuple[str, int]] = frozenset()  # storages saved as they are (scope(keep=))
    classes: frozenset[str] | None = None  # the classes it moves; None: all (Note: [class offload])
    tags: dict[tuple[str, int], str] = field(default_factory=dict)  # kept storages' classes
    # Note: [class recompute]: the classes dropped after the forward, the recording of its ops,
    # the dropped storages and saved tensors, and the saved tensors a recompute reads
    recomputed: frozenset[str] = frozenset()
    recorder: OpRecorder | None = None
    dropped_storages: dict[tuple[str, int], tuple[weakref.ref, str]] = field(default_factory=dict)
    dropped: list[_Dropped] = field(default_factory=list)
    readable: dict[Ref, object] = field(default_factory=dict)
    remade: list[object] = field(default_factory=list)  # the meter's tokens of what came back


@dataclass(eq=False)
class _Dropped:
    """What autograd keeps for a saved tensor of a recomputed class: the op output it is, and
    after the recompute the tensor itself (Note: [class recompute])."""

    ref: Ref
    name: str
    value: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)
class _Saved:
    """What autograd keeps for an offloadable saved tensor: where and how to rebuild it."""

    scope: _Scope
    storage: _Storage
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class ActivationOffloader:
    """Offloads the saved activations of scopes (keys such as (stage, microbatch))."""

    def __init__(
        self,
        device: torch.device,
        config: OffloadConfig,
        parameters: list[torch.Tensor],
        meter: ActivationMeter | None = None,
        copies: CopyEngine | None = None,
        pool: HostBufferPool | None = None,
    ) -> None:
        """``copies``: how copies to host run (default: CUDA side streams on a CUDA device,
        plain copies elsewhere; tests give engines whose copies finish late). ``pool``: the host
        buffers (default: pinned on CUDA; Pipeline makes a strict one on NCCL, runtime/pool.py
        Note: [host pool])."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type == "cuda" and not config.pin_memory:
            warnings.warn("OffloadConfig.pin_memory=False on CUDA: every copy to and from "
                          "pageable host memory blocks the host until it completes, so offload "
                          "no longer overlaps compute; set pin_memory=True", stacklevel=2)
        self._device = device
        self._config = config
        self._meter = meter
        self._keep = KeepRule(device, parameters, config.min_offload_elements)
        self._kept: dict[str, int] = {}
        self._scopes: dict[Hashable, _Scope] = {}
        self._cuda = device.type == "cuda"
        self._pool = pool or HostBufferPool(pin_memory=self._cuda and config.pin_memory)
        self._fetched_bytes = 0
        self._kept_stale = False  # kept_bytes describe the last step: cleared as the next begins
        if copies is None:
            copies = CudaCopies(device) if self._cuda else HostCopies()
        self._copies = copies
        self._waiting = CopyQueue(copies, config.max_pending_copy_bytes, self._release_device)
        # Note: [release order], default cap: asynchronous copies without an explicit cap wait
        # for at most this many times the largest activation seen before stream-order release.
        self._auto_cap = (config.pending_copy_activations
                          if config.max_pending_copy_bytes is None and not copies.synchronous
                          else None)
        self._largest_scope = 0
        self._cuda_copies = copies if isinstance(copies, CudaCopies) else None  # copy_in
        self.tagger = ClassTagger()  # Note: [class offload]
        self._class_bytes: dict[Hashable, dict[str, int]] = {}
        #: per scope key, the ops its last ``recompute`` ran (Note: [class recompute])
        self.recomputed_ops: dict[Hashable, tuple[str, ...]] = {}

    @property
    def class_bytes(self) -> dict[Hashable, dict[str, int]]:
        """Per scope key, the bytes of its distinct saved storages by tensor class, from its
        last forward (Note: [class offload]); kept tiny tensors and parameters excluded."""
        return {key: dict(tags) for key, tags in self._class_bytes.items()}

    @property
    def host_pool_bytes(self) -> int:
        """Bytes of host memory the pool holds now (pinned bytes on CUDA; runtime/pool.py Note:
        [host pool])."""
        return self._pool.allocated_bytes

    @property
    def host_pool_need_bytes(self) -> int:
        """The most host bytes the last finished step had in use at once."""
        return self._pool.last_step_need

    @property
    def host_pool(self) -> HostBufferPool:
        return self._pool

    def reserve_host(self, nbytes: int) -> None:
        """Allocate ``nbytes`` of host buffers now, before the first step (Note: [host pool])."""
        self._pool.reserve(nbytes)

    @property
    def fetched_bytes(self) -> int:
        """Bytes copied back to the device by fetch-on-use reads so far (each read copies a
        whole storage; see Note: [fetch on use])."""
        return self._fetched_bytes

    @property
    def kept_bytes(self) -> dict[str, int]:
        """Bytes of saved tensors left on the device, by reason (Note: [kept on device]):
        "parameter", "small" (<= min_offload_elements), "other device", "not dense" (sparse,
        meta, a tensor subclass other than DTensor), "kept by the caller" (``scope(keep=)``).
        Each save counts, so a tensor saved by two operations counts twice; DTensors count their
        local shard."""
        return dict(self._kept)

    def device_bytes(self, key: Hashable) -> int:
        """Bytes of ``key``'s recorded storages currently held on the device by the offloader."""
        scope = self._scopes.get(key)
        if scope is None:
            return 0
        return sum(s.nbytes for s in scope.storages.values() if s.on_device is not None)

    def host_bytes(self, key: Hashable) -> int:
        """Bytes of ``key``'s storages that have a host copy."""
        scope = self._scopes.get(key)
        if scope is None:
            return 0
        return sum(s.nbytes for s in scope.storages.values() if s.host is not None)

    @contextmanager
    def scope(self, key: Hashable, owner: Hashable, stream: bool = True,
              keep: Iterable[torch.Tensor] = (),
              classes: Iterable[str] | None = None,
              recomputed: Iterable[str] = ()) -> Iterator[None]:
        """Capture what autograd saves inside the block as ``key``'s activation; with ``stream``
        its copy to host starts right away (see Note: [streaming offload]). Saved tensors sharing
        a storage with one of ``keep`` stay on the device, like parameters: buffers that live on
        anyway (torch.distributed.pipelining's receive buffers), whose copy would free nothing.
        ``classes``: move only saved storages of these tensor classes (Note: [class offload]);
        ``recomputed``: drop those of these classes and make them again in ``recompute`` (Note:
        [class recompute])."""
        if self._kept_stale:
            self._kept, self._kept_stale = {}, False
        if key in self._scopes:
            raise PipelineRuntimeError(f"offload scope {key} is already open; each (stage, "
                                       "microbatch) runs its forward once per step")
        scope = _Scope(key, owner, stream, keep=frozenset(storage_key(t) for t in keep),
                       classes=None if classes is None else frozenset(classes),
                       recomputed=frozenset(recomputed))
        self._scopes[key] = scope
        self._class_bytes[key] = {}

        def pack(tensor: torch.Tensor) -> object:
            return self._pack(scope, tensor)

        with ExitStack() as stack:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, self._unpack))
            if scope.recomputed:
                scope.recorder = stack.enter_context(OpRecorder())
            try:
                yield
            finally:
                scope.recorder = None  # the recipes hold what they need; nothing else is

    @property
    def pending_copy_bytes(self) -> int:
        """Device bytes whose copy to host is queued and not yet seen complete."""
        return self._waiting.waiting_bytes

    @property
    def max_pending_bytes_seen(self) -> int:
        """The most ``pending_copy_bytes`` seen (after the cap applied), since construction."""
        return self._waiting.max_waiting_bytes

    def _pack(self, scope: _Scope, tensor: torch.Tensor) -> object:
        if is_dtensor(tensor) and not isinstance(tensor, torch.nn.Parameter):
            # This rank's shard is the memory: move it, rebuild the DTensor on unpack.
            [shard] = local_shards([tensor])
            return SavedShard(self._pack(scope, shard), ShardLayout.of(tensor))
        if is_pending_collective(tensor):
            return self._pack(scope, local_shards([tensor])[0])
        reason = self._keep.reason(tensor, scope.keep)
        if reason is not None:
            [local] = local_shards([tensor])
            self._kept[reason] = self._kept.get(reason, 0) + local.numel() * local.element_size()
            token = self._meter.track(tensor, scope.owner) if self._meter is not None else None
            # Detached: a saved output returned live would hold its own grad_fn, a reference
            # cycle through autograd that keeps the whole graph of a retained backward alive.
            return self._readable(scope, tensor, tensor.detach() if token is None else token)
        key = storage_key(tensor)
        raw = tensor.untyped_storage()
        if scope.recorder is not None:
            dropped = self._dropped(scope, tensor, key)
            if dropped is not None:
                return dropped
        kept = self._kept_by_class(scope, tensor, key)
        if kept is not None:
            return self._readable(scope, tensor, kept)
        storage = scope.storages.get(key)
        if storage is not None and storage.original() is not raw:
            # The storage saved under this address earlier was freed (possible once a streamed
            # copy dropped our reference) and the allocator reused the address.
            retired = (key[0], -1 - len(scope.storages))
            scope.storages[retired] = scope.storages.pop(key)
            storage = None
        if storage is None:
            alias = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(raw)
            storage = _Storage(raw.nbytes(), tensor.device, alias, weakref.ref(raw))
            scope.storages[key] = storage
            tags = self._class_bytes[scope.key]
            tag = self.tagger.current()
            tags[tag] = tags.get(tag, 0) + storage.nbytes
            self._note_scope_size(scope)
            if scope.stream:
                self._stream_out(scope, storage)
            elif self._meter is not None:
                storage.token = self._meter.track(alias, scope.owner)
        return self._readable(scope, tensor, _Saved(scope, storage, tensor.dtype,
                                                     tuple(tensor.shape), tuple(tensor.stride()),
                                                     int(tensor.storage_offset())))

    def _dropped(self, scope: _Scope, tensor: torch.Tensor, key: tuple[str, int]
                 ) -> _Dropped | None:
        """What autograd keeps for a saved tensor whose storage is of a recomputed class (the
        class it was first saved under), else None (Note: [class recompute])."""
        raw = tensor.untyped_storage()
        known = scope.dropped_storages.get(key)
        if known is not None and known[0]() is raw:
            tag = known[1]
        else:
            moved = scope.storages.get(key)
            if key in scope.tags or (moved is not None and moved.original() is raw):
                return None  # first saved under a class that is kept or moved
            tag = self.tagger.current()
            if tag not in scope.recomputed:
                return None
            scope.dropped_storages[key] = (weakref.ref(raw), tag)
            tags = self._class_bytes[scope.key]
            tags[tag] = tags.get(tag, 0) + raw.nbytes()
            if self._meter is not None:
                self._meter.note(tensor, scope.owner)  # part of the activation, not resident
        assert scope.recorder is not None
        ref = scope.recorder.ref_of(tensor)
        if ref is None:
            raise PipelineRuntimeError(
                f"a saved tensor of class {tag!r} of {scope.key} was not made by its forward's "
                "ops, so it cannot be recomputed; keep or offload that class")
        handle = _Dropped(ref, tag)
        scope.dropped.append(handle)
        return handle

    def _readable(self, scope: _Scope, tensor: torch.Tensor, packed: object) -> object:
        """Note a kept or moved saved tensor as one a recompute may read (Note: [class
        recompute]); returns ``packed``."""
        if scope.recorder is not None:
            ref = scope.recorder.ref_of(tensor)
            if ref is not None:
                scope.readable.setdefault(ref, packed)
        return packed

    def recompute(self, key: Hashable) -> None:
        """Make ``key``'s dropped saved tensors again (its first backward pass calls this;
        later calls do nothing): resident from now until ``discard`` (Note: [class
        recompute])."""
        scope = self._scopes.get(key)
        if scope is None or not scope.dropped or scope.dropped[0].value is not None:
            return
        readers = {ref: functools.partial(self._unpack, packed)
                   for ref, packed in scope.readable.items()}
        ran: list[str] = []
        values = replay([handle.ref for handle in scope.dropped], readers, ran)
        self.recomputed_ops[key] = tuple(ran)
        for handle in scope.dropped:
            handle.value = values[handle.ref]
            if self._meter is not None:
                scope.remade.append(self._meter.track(handle.value, scope.owner))

    def _kept_by_class(self, scope: _Scope, tensor: torch.Tensor, key: tuple[str, int]
                       ) -> object | None:
        """What autograd keeps for a tensor whose class the scope does not move (its storage
        first saved under such a class), else None (Note: [class offload])."""
        if scope.classes is None:
            return None
        moved = scope.storages.get(key)
        if moved is not None and moved.original() is tensor.untyped_storage():
            return None  # first saved under a class the scope moves
        # (a moved storage at this address may have been freed and the address reused)
        tag = scope.tags.get(key)
        if tag is None:
            tag = self.tagger.current()
            if tag in scope.classes:
                return None
            scope.tags[key] = tag
            tags = self._class_bytes[scope.key]
            tags[tag] = tags.get(tag, 0) + tensor.untyped_storage().nbytes()
            nbytes = tensor.untyped_storage().nbytes()
            self._kept["kept by class choice"] = self._kept.get("kept by class choice", 0) + nbytes
        token = self._meter.track(tensor, scope.owner) if self._meter is not None else None
        return tensor.detach() if token is None else token

    def _note_scope_size(self, scope: _Scope) -> None:
        """Track the largest activation, which sets the default cap (Note: [release order])."""
        if self._auto_cap is None:
            return
        size = sum(s.nbytes for s in scope.storages.values())
        if size > self._largest_scope:
            self._largest_scope = size
            self._waiting.cap_bytes = int(self._auto_cap * size)

    def _unpack(self, packed: object) -> torch.Tensor:
        if isinstance(packed, SavedShard):
            return packed.layout.rebuild(self._unpack(packed.inner))
        if isinstance(packed, ResidentToken):
            return packed.tensor
        if isinstance(packed, _Dropped):
            if packed.value is None:
                raise PipelineRuntimeError(
                    f"a tensor of recomputed class {packed.name!r} is needed before its "
                    "recompute (the first backward pass of its stage and microbatch runs it)")
            return packed.value
        if not isinstance(packed, _Saved):
            return cast(torch.Tensor, packed)  # not ours to rebuild: saved as it was
        storage = packed.storage
        if storage.on_device is not None:
            raw = storage.on_device.untyped_storage()
        elif packed.scope.fetched and storage.host is not None:
            raw = self._fetch_storage(storage)
        else:
            raise PipelineRuntimeError(
                f"a saved activation of {packed.scope.key} is on the host when its backward "
                "needs it: the schedule must RELOAD or FETCH it before its I or B"
            )
        rebuilt = torch.empty(0, dtype=packed.dtype, device=storage.device)
        return rebuilt.set_(raw, packed.offset, packed.size, packed.stride)

    def _fetch_storage(self, storage: _Storage) -> torch.UntypedStorage:
        """A device copy of ``storage``'s host bytes that only autograd holds: the live one if
        another saved view of it is still in use, else a fresh one (Note: [fetch on use])."""
        alive = storage.fetched() if storage.fetched is not None else None
        if alive is not None:
            return alive
        host = storage.host
        assert host is not None
        if self._cuda_copies is None:
            target = host.clone()
        else:
            # On the stream autograd runs the node on (compute), as RELOAD's (copies.py).
            [target], done = self._cuda_copies.copy_in([host], storage.copied)
            self._cuda_copies.compute_wait(done)
            storage.read = done
        self._fetched_bytes += storage.nbytes
        raw = target.untyped_storage()
        storage.fetched = weakref.ref(raw)
        return raw

    def _stream_out(self, scope: _Scope, storage: _Storage) -> None:
        """Start copying one storage to host during the forward."""
        storage.host = self._pool.take(storage.nbytes)
        if self._copies.synchronous:
            storage.host.copy_(storage.device_bytes())
            if self._meter is not None:
                self._meter.note(storage.device_bytes(), scope.owner)
            self._release_device(storage)
            return
        if self._meter is not None:
            storage.token = self._meter.track(storage.device_bytes(), scope.owner)
        self._copy_out([storage])

    def _copy_out(self, storages: list[_Storage]) -> None:
        """Queue copies to host after the compute stream's work (Note: [release order])."""
        copied = self._copies.copy_out([(s.host_bytes(), s.device_bytes()) for s in storages])
        for storage in storages:
            storage.copied = copied
        self._waiting.add(copied, storages)

    def offload(self, key: Hashable) -> None:
        """Start copying ``key``'s storages to host (unless streamed already); device memory is
        released once copied."""
        scope = self._scope_of(key, "OFFLOAD")
        if scope.offloaded:
            raise PipelineRuntimeError(f"{key} is already offloaded; OFFLOAD runs once per F")
        scope.offloaded = True
        if scope.stream:
            self.poll()
            return
        storages = list(scope.storages.values())
        for storage in storages:
            storage.host = self._pool.take(storage.nbytes)
        if self._copies.synchronous:
            for storage in storages:
                storage.host_bytes().copy_(storage.device_bytes())
                self._release_device(storage)
            return
        self._copy_out(storages)
        self.poll()

    def reload(self, key: Hashable) -> None:
        """Start copying ``key``'s storages back; the backward waits via ``wait_reloaded``."""
        scope = self._scope_of(key, "RELOAD")
        if scope.fetched:
            raise PipelineRuntimeError(f"RELOAD of {key} after its FETCH; an offloaded "
                                       "activation comes back by one of them, not both")
        if not scope.offloaded:
            raise PipelineRuntimeError(f"RELOAD of {key} without an OFFLOAD before it")
        scope.offloaded = False
        if self._cuda_copies is None:
            for storage in scope.storages.values():
                if storage.on_device is None:
                    self._to_device(scope, storage, storage.host_bytes().clone())
                self._waiting.stop_waiting(storage)
                self._pool.give_back(storage.host_bytes())
                storage.host = None
            return
        assert self._cuda_copies is not None
        back = []
        for storage in scope.storages.values():
            if storage.on_device is not None:
                # The D2H copy has not been seen to finish: the device bytes are still there.
                self._waiting.stop_waiting(storage)
                self._pool.give_back(storage.host_bytes(), storage.copied)
                storage.host = None
            else:
                back.append(storage)
        # The compute stream waits for ``done`` before the backward uses them (wait_reloaded,
        # or discard if the backward never ran).
        targets, done = self._cuda_copies.copy_in([s.host_bytes() for s in back])
        for storage, target in zip(back, targets):
            self._to_device(scope, storage, target)
            self._pool.give_back(storage.host_bytes(), done)
            storage.host = None
        scope.reload_event = done

    def fetch_on_use(self, key: Hashable) -> None:
        """FETCH: from now on ``key``'s backward passes read its saved storages back from host
        as autograd unpacks them, each copy held only while used (Note: [fetch on use])."""
        scope = self._scope_of(key, "FETCH")
        if scope.fetched:
            raise PipelineRuntimeError(f"{key} is already fetched; FETCH runs once per OFFLOAD")
        if not scope.offloaded:
            raise PipelineRuntimeError(
                f"FETCH of {key} without an OFFLOAD before it (or after its RELOAD); put "
                "OFFLOAD after its F and one FETCH or RELOAD before its I or B")
        scope.fetched = True

    def wait_offloaded(self, key: Hashable) -> None:
        """OFFLOAD_WAIT: the compute stream (never the host) waits until ``key``'s copies to
        host are done, and its device memory is released now: whatever reuses it is queued
        behind that wait. On CPU the copies are already done."""
        scope = self._scope_of(key, "OFFLOAD_WAIT")
        self._waiting.release_through(list(scope.storages.values()))

    def wait_reloaded(self, key: Hashable) -> None:
        """Make the compute stream (never the host) wait for ``key``'s RELOAD copies."""
        scope = self._scopes.get(key)
        if scope is None or scope.reload_event is None:
            return
        # the event CudaCopies.copy_in recorded
        torch.cuda.current_stream(self._device).wait_event(cast(torch.cuda.Event,
                                                                scope.reload_event))
        scope.reload_event = None

    def discard(self, key: Hashable) -> None:
        """Forget ``key`` after its backward: its storages are no longer needed."""
        scope = self._scopes.pop(key, None)
        if scope is None:
            return
        for handle in scope.dropped:  # autograd may hold the handles longer (a retained graph)
            handle.value = None
        scope.remade.clear()
        scope.readable.clear()
        if scope.reload_event is not None:  # reloaded, never used: its copies may still write
            self._copies.compute_wait(scope.reload_event)
        for storage in scope.storages.values():
            if storage.host is not None:
                # A read waited for the copy out, so the last read is the buffer's last use.
                ready = storage.read if storage.read is not None else storage.copied
                self._pool.give_back(storage.host, ready)
                storage.host = None
            if (storage.on_device is not None and storage.copied is not None
                    and not self._copies.done(storage.copied)):
                self._copies.retire(storage.on_device)  # its copy out may still read it
            self._release_device(storage)
            storage.fetched = None

    def poll(self) -> None:
        """Release device memory of offloads whose copy has completed (never blocks; Note:
        [release order])."""
        self._waiting.poll()

    def finish(self) -> None:
        """End of a step: every scope must have been discarded by its backward.

        Copies still in flight then only matter to the host pool, whose buffers carry their
        events, so nothing here waits for them.
        """
        self._waiting.forget()
        self._kept_stale = True
        if self._scopes:
            left = ", ".join(str(k) for k in self._scopes)
            self.abandon()
            raise PipelineRuntimeError(f"activations of {left} were never freed by a backward")
        self._pool.end_step()

    def abandon(self) -> None:
        """Forget a failed step's scopes; host buffers return to the pool when their copies end."""
        for key in list(self._scopes):
            self.discard(key)
        self._waiting.forget()
        self._kept_stale = True
        self._pool.end_step()

    def _release_device(self, storage: _Storage) -> None:
        """Drop the device reference: its bytes return to the allocator (Note: [release
        order] says when that is safe)."""
        self._waiting.stop_waiting(storage)
        storage.on_device = None
        storage.token = None

    def _to_device(self, scope: _Scope, storage: _Storage, target: torch.Tensor) -> None:
        storage.on_device = target
        if self._meter is not None:
            storage.token = self._meter.track(target, scope.owner)

    def _scope_of(self, key: Hashable, what: str) -> _Scope:
        scope = self._scopes.get(key)
        if scope is None:
            raise PipelineRuntimeError(
                f"{what} of {key}: no forward of it has run on this rank (the schedule must put "
                f"{what} after the F of the same stage and microbatch, on the rank that holds it)"
            )
        return scope
