"""The activation offloader: moves a (stage, microbatch)'s saved tensors to host and back.

One saved_tensors_hooks scope per (stage, microbatch) forward captures what autograd saves
(paper-notes.md section 5): parameters and tiny tensors (<= OffloadConfig.min_offload_elements
elements) stay as they are; every other saved tensor is recorded by its storage, so several saved
views of one storage move once and come back as the same views (same offset, sizes, strides).

Note: [streaming offload] (shared with the simulator, sim/simulator.py) a scope opened with
``stream=True`` starts each storage's copy to host as soon as autograd saves it, during the
forward, and the offloader keeps its device reference only until that copy has completed; the
OFFLOAD action then only marks the scope offloaded. With ``stream=False`` OFFLOAD starts the
copies after the forward. Either way the device storage is released when its copy completes;
RELOAD allocates device memory, starts the copy back, and the backward that needs it waits on it
(``wait_reloaded``). On CUDA copies run on two side streams
(device-to-host, host-to-device) ordered by events, into pinned pooled buffers, and completion is
polled with ``event.query()`` between actions, so the host never blocks. On CPU the same code runs
with synchronous copies: the host copy is a separate tensor and the original storage is released.
Shapes may change between steps: records live for one forward/backward, buffers are pooled by size.

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

import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from pipeoffload.errors import PipelineRuntimeError
from pipeoffload.runtime.config import OffloadConfig
from pipeoffload.runtime.meter import ActivationMeter, ResidentToken, is_plain, storage_key
from pipeoffload.runtime.pool import HostBufferPool


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
    ) -> None:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._device = device
        self._config = config
        self._meter = meter
        self._params = {storage_key(p) for p in parameters if p.untyped_storage().nbytes()}
        self._scopes: dict[Hashable, _Scope] = {}
        self._cuda = device.type == "cuda"
        self._pool = HostBufferPool(pin_memory=self._cuda and config.pin_memory)
        self._pending: list[tuple[object, list[_Storage]]] = []  # (D2H event, storages to free)
        self._fetched_bytes = 0
        if self._cuda:
            self._d2h = torch.cuda.Stream(device)
            self._h2d = torch.cuda.Stream(device)

    @property
    def host_pool_bytes(self) -> int:
        """Bytes of host buffers allocated so far (they are reused, not freed)."""
        return self._pool.allocated_bytes

    @property
    def fetched_bytes(self) -> int:
        """Bytes copied back to the device by fetch-on-use reads so far (each read copies a
        whole storage; see Note: [fetch on use])."""
        return self._fetched_bytes

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
              keep: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        """Capture what autograd saves inside the block as ``key``'s activation; with ``stream``
        its copy to host starts right away (see Note: [streaming offload]). Saved tensors sharing
        a storage with one of ``keep`` stay on the device, like parameters: buffers that live on
        anyway (torch.distributed.pipelining's receive buffers), whose copy would free nothing."""
        if key in self._scopes:
            raise PipelineRuntimeError(f"offload scope {key} is already open; each (stage, "
                                       "microbatch) runs its forward once per step")
        scope = _Scope(key, owner, stream, keep=frozenset(storage_key(t) for t in keep))
        self._scopes[key] = scope

        def pack(tensor: torch.Tensor) -> object:
            return self._pack(scope, tensor)

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def _pack(self, scope: _Scope, tensor: torch.Tensor) -> object:
        keep = (
            not is_plain(tensor)
            or tensor.device.type != self._device.type
            or tensor.device.index != self._device.index
            or isinstance(tensor, torch.nn.Parameter)
            # a view of a parameter made in the step (FSDP's unsharded parameters) stays too
            or isinstance(tensor._base, torch.nn.Parameter)
            or tensor.numel() <= self._config.min_offload_elements
            or storage_key(tensor) in self._params
            or storage_key(tensor) in scope.keep
        )
        if keep:
            token = self._meter.track(tensor, scope.owner) if self._meter is not None else None
            return tensor if token is None else token
        key = storage_key(tensor)
        raw = tensor.untyped_storage()
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
            if scope.stream:
                self._stream_out(scope, storage)
            elif self._meter is not None:
                storage.token = self._meter.track(alias, scope.owner)
        return _Saved(scope, storage, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()),
                      tensor.storage_offset())

    def _unpack(self, packed: object) -> torch.Tensor:
        if isinstance(packed, ResidentToken):
            return packed.tensor
        if not isinstance(packed, _Saved):
            return packed  # type: ignore[return-value]
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
        if not self._cuda:
            target = host.clone()
        else:
            compute = torch.cuda.current_stream(self._device)
            with torch.cuda.stream(self._h2d):
                if storage.copied is not None:
                    self._h2d.wait_event(storage.copied)  # type: ignore[arg-type]
                target = torch.empty(storage.nbytes, dtype=torch.uint8, device=self._device)
                target.copy_(host, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._h2d)
            compute.wait_event(done)
            # Freed when autograd drops it, so the allocator must wait for the compute stream.
            target.record_stream(compute)
            storage.read = done
        self._fetched_bytes += storage.nbytes
        raw = target.untyped_storage()
        storage.fetched = weakref.ref(raw)
        return raw

    def _stream_out(self, scope: _Scope, storage: _Storage) -> None:
        """Start copying one storage to host during the forward."""
        storage.host = self._pool.take(storage.nbytes)
        if not self._cuda:
            storage.host.copy_(storage.on_device)  # type: ignore[arg-type]
            if self._meter is not None:
                self._meter.note(storage.on_device, scope.owner)  # type: ignore[arg-type]
            self._release_device(storage)
            return
        if self._meter is not None:
            storage.token = self._meter.track(storage.on_device, scope.owner)  # type: ignore[arg-type]
        self._copy_out([storage])

    def _copy_out(self, storages: list[_Storage]) -> None:
        """CUDA: copy on the D2H stream after what the compute stream has queued so far."""
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self._device))
        self._d2h.wait_event(produced)
        with torch.cuda.stream(self._d2h):
            for storage in storages:
                storage.host.copy_(storage.on_device, non_blocking=True)  # type: ignore[union-attr]
        copied = torch.cuda.Event()
        copied.record(self._d2h)
        for storage in storages:
            storage.copied = copied
        self._pending.append((copied, storages))

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
        if not self._cuda:
            for storage in storages:
                storage.host.copy_(storage.on_device)  # type: ignore[union-attr]
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
        if not self._cuda:
            for storage in scope.storages.values():
                self._to_device(scope, storage, storage.host.clone())  # type: ignore[union-attr]
                self._pool.give_back(storage.host)  # type: ignore[arg-type]
                storage.host = None
            return
        compute = torch.cuda.current_stream(self._device)
        allowed = torch.cuda.Event()
        allowed.record(compute)
        self._h2d.wait_event(allowed)
        for storage in scope.storages.values():
            if storage.on_device is not None:
                # The D2H copy has not been seen to finish: the device bytes are still there.
                self._pool.give_back(storage.host, storage.copied)  # type: ignore[arg-type]
                storage.host = None
                continue
            target = torch.empty(storage.nbytes, dtype=torch.uint8, device=self._device)
            with torch.cuda.stream(self._h2d):
                target.copy_(storage.host, non_blocking=True)  # type: ignore[arg-type]
            target.record_stream(self._h2d)
            self._to_device(scope, storage, target)
        done = torch.cuda.Event()
        done.record(self._h2d)
        for storage in scope.storages.values():
            if storage.host is not None:
                self._pool.give_back(storage.host, done)
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
        if not self._cuda:
            return
        compute = torch.cuda.current_stream(self._device)
        mine = {id(storage) for storage in scope.storages.values()}

        def waited(event: object, storages: list[_Storage]) -> bool:
            if not any(id(storage) in mine for storage in storages):
                return False
            compute.wait_event(event)  # type: ignore[arg-type]
            return True

        self._release_where(waited)

    def wait_reloaded(self, key: Hashable) -> None:
        """Make the compute stream (never the host) wait for ``key``'s RELOAD copies."""
        scope = self._scopes.get(key)
        if scope is None or scope.reload_event is None:
            return
        torch.cuda.current_stream(self._device).wait_event(scope.reload_event)  # type: ignore[arg-type]

    def discard(self, key: Hashable) -> None:
        """Forget ``key`` after its backward: its storages are no longer needed."""
        scope = self._scopes.pop(key, None)
        if scope is None:
            return
        for storage in scope.storages.values():
            if storage.host is not None:
                # A read waited for the copy out, so the last read is the buffer's last use.
                ready = storage.read if storage.read is not None else storage.copied
                self._pool.give_back(storage.host, ready)
                storage.host = None
            storage.on_device = None
            storage.token = None
            storage.fetched = None

    def poll(self) -> None:
        """Release device memory of offloads whose copy has completed (never blocks)."""
        self._release_where(lambda event, _: event.query())  # type: ignore[attr-defined]

    def _release_where(self, finished: Callable[[object, list[_Storage]], bool]) -> None:
        """Release the device copies of the pending offloads for which ``finished`` holds."""
        still = []
        for event, storages in self._pending:
            if finished(event, storages):
                for storage in storages:
                    if storage.host is not None:
                        self._release_device(storage)
            else:
                still.append((event, storages))
        self._pending = still

    def finish(self) -> None:
        """End of a step: every scope must have been discarded by its backward.

        Copies still in flight then only matter to the host pool, whose buffers carry their
        events, so nothing here waits for them.
        """
        self._pending = []
        if self._scopes:
            left = ", ".join(str(k) for k in self._scopes)
            self._scopes.clear()
            raise PipelineRuntimeError(f"activations of {left} were never freed by a backward")

    def abandon(self) -> None:
        """Forget a failed step's scopes; host buffers return to the pool when their copies end."""
        for key in list(self._scopes):
            self.discard(key)
        self._pending = []

    def _release_device(self, storage: _Storage) -> None:
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
