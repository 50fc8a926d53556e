"""The memory meter: resident activation bytes per rank, measured on real tensors.

What is measured (Note: [meter definition]): the bytes of distinct device storages that hold
saved tensors (what autograd keeps for the backward) and that are still held, excluding the
storages of parameters and views of parameters (``_is_parameter``: FSDP2's gathered parameters
are views of its all-gather buffer, which is no parameter's storage). A storage is counted
while at least one "resident token" for it lives; a token lives exactly as long as whoever
keeps the saved tensor on the device keeps it:
- without the offloader, the meter's own pass-through saved_tensors_hooks hand autograd a token
  that holds the tensor, so it dies when autograd frees the saved tensor (end of W or B);
- with the offloader (whose hooks are innermost and therefore the only ones called), the
  offloader asks the meter for a token per saved storage and drops it when its device reference
  is released (copy to host completed, or end of the backward); RELOAD asks for a fresh token.
  A storage whose copy completes as it is saved (streamed offload with synchronous copies, on
  CPU) is never counted resident, only added to its scope's size (``note``), which is what the
  simulator's streaming accounting gives for a copy that keeps up with the forward.
  The device copies that a fetched (stage, microbatch)'s backward reads from host (the
  offloader's Note: [fetch on use]) are never counted either: each lives only while autograd
  uses it, and the simulator counts a fetched activation 0 bytes until its backward ends.
Counting is event driven: the peak is the maximum over every moment a storage starts to be
counted. No storage becomes resident during a backward, so this equals sampling after every
action and at the end of every F, which is what the simulator's accounting sees (an activation is
resident from its F to the end of its W or B, minus offloaded periods).

The meter also records the bytes of the storages saved inside each ``scope(owner, key)`` (the
runtime uses key = (stage, microbatch)), so those sizes can be given to the simulator
(``CostModel(stage_activation_bytes=...)``) and the peaks compared.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from contextlib import contextmanager
from typing import cast

import torch

from pipeoffload.errors import ConfigError
from pipeoffload.runtime.shards import local_shard

_StorageKey = tuple[str, int]


def storage_key(tensor: torch.Tensor) -> _StorageKey:
    """(device, data pointer) of the storage behind ``tensor``."""
    return str(tensor.device), tensor.untyped_storage().data_ptr()


def is_plain(tensor: torch.Tensor) -> bool:
    """A dense strided tensor with a real storage (not sparse, meta or a tensor subclass)."""
    return (
        type(tensor) in (torch.Tensor, torch.nn.Parameter)
        and tensor.layout is torch.strided
        and tensor.device.type != "meta"
    )


def _is_parameter(tensor: torch.Tensor) -> bool:
    """A parameter, or a view of one made in the step (as the offloader's KeepRule keeps them:
    a weight's transpose saved for the backward; FSDP2's gathered parameters, whose storage is
    its all-gather buffer, not a parameter's)."""
    return (isinstance(tensor, torch.nn.Parameter)
            or isinstance(tensor._base, torch.nn.Parameter))


class ResidentToken:
    """Keeps one saved tensor's storage counted as resident while this object lives."""

    __slots__ = ("_key", "_meter", "_owner", "tensor")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter, owner: Hashable,
                 key: _StorageKey) -> None:
        self.tensor = tensor
        self._meter = meter
        self._owner = owner
        self._key = key

    def __del__(self) -> None:
        self._meter._release(self._owner, self._key)


class ActivationMeter:
    """Per-owner (rank) resident and peak activation bytes; see Note: [meter definition]."""

    def __init__(self) -> None:
        self._excluded: set[_StorageKey] = set()
        self._holders: dict[tuple[Hashable, _StorageKey], int] = {}
        self._sizes: dict[tuple[Hashable, _StorageKey], int] = {}
        self._resident: dict[Hashable, int] = {}
        self._peak: dict[Hashable, int] = {}
        self._scope: tuple[Hashable, Hashable] | None = None
        self._scope_bytes: dict[Hashable, int] = {}
        self._scope_storages: dict[Hashable, set[_StorageKey]] = {}

    def exclude(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages (parameters, buffers)."""
        for tensor in map(local_shard, tensors):
            if is_plain(tensor) and tensor.untyped_storage().nbytes():
                self._excluded.add(storage_key(tensor))

    def track(self, tensor: torch.Tensor, owner: Hashable) -> ResidentToken | None:
        """Count ``tensor``'s storage for ``owner`` while the returned token lives.

        Returns None for what is not an activation (parameters and their views, empty or
        non-dense tensors).
        A DTensor counts its local shard's storage, an AsyncCollectiveTensor its waited result
        (runtime/shards.py); the token keeps the tensor as given.
        """
        if _is_parameter(tensor):
            return None
        counted = local_shard(tensor)
        if not is_plain(counted):
            return None
        nbytes = counted.untyped_storage().nbytes()
        key = storage_key(counted)
        if nbytes == 0 or key in self._excluded:
            return None
        self._attribute(owner, key, nbytes)
        slot = (owner, key)
        count = self._holders.get(slot, 0)
        self._holders[slot] = count + 1
        if count == 0:
            self._sizes[slot] = nbytes
            resident = self._resident.get(owner, 0) + nbytes
            self._resident[owner] = resident
            if resident > self._peak.get(owner, 0):
                self._peak[owner] = resident
        return ResidentToken(tensor.detach(), self, owner, key)

    def note(self, tensor: torch.Tensor, owner: Hashable) -> None:
        """Add ``tensor``'s storage to the current scope's size without counting it resident
        (a storage whose copy to host completed as it was saved: see the offloader's
        Note: [streaming offload]). The caller notes each storage once: its address may be
        reused as soon as it is freed, so the meter cannot tell repeats apart."""
        tensor = local_shard(tensor)
        if is_plain(tensor) and not _is_parameter(tensor):
            if storage_key(tensor) not in self._excluded:
                self._attribute(owner, None, tensor.untyped_storage().nbytes())

    def _attribute(self, owner: Hashable, key: _StorageKey | None, nbytes: int) -> None:
        """Add to the current scope's size; a tracked storage (alive while counted) once."""
        if self._scope is None or self._scope[0] != owner or nbytes == 0:
            return
        if key is not None:
            seen = self._scope_storages.setdefault(self._scope[1], set())
            if key in seen:
                return
            seen.add(key)
        self._scope_bytes[self._scope[1]] = self._scope_bytes.get(self._scope[1], 0) + nbytes

    def _release(self, owner: Hashable, key: _StorageKey) -> None:
        slot = (owner, key)
        count = self._holders.get(slot, 0) - 1
        if count > 0:
            self._holders[slot] = count
            return
        self._holders.pop(slot, None)
        self._resident[owner] = self._resident.get(owner, 0) - self._sizes.pop(slot, 0)
        if self._scope is not None and self._scope[0] == owner:
            # Released inside the scope (an offloader's release during the forward): a storage
            # at this address later is another one and counts again.
            self._scope_storages.get(self._scope[1], set()).discard(key)

    @contextmanager
    def scope(self, owner: Hashable, key: Hashable) -> Iterator[None]:
        """Attribute storages saved inside this block to ``key`` (e.g. (stage, mb)). Entering
        ``key`` again (the next step's forward, or a RECOMPUTE) starts its size afresh: a
        scope's size is one forward's activation, not a sum over steps."""
        self._scope_bytes.pop(key, None)
        self._scope_storages.pop(key, None)
        previous, self._scope = self._scope, (owner, key)
        try:
            yield
        finally:
            self._scope = previous

    @contextmanager
    def observe(self, owner: Hashable = 0) -> Iterator[None]:
        """Pass-through saved_tensors_hooks that count what autograd saves inside the block.

        Wrap any training step with it (for example a torch.distributed.pipelining step) to get
        the same quantity that Pipeline measures. Hooks installed inside the block (an
        offloader's) take precedence, as saved_tensors_hooks nest.
        """

        def pack(tensor: torch.Tensor) -> object:
            token = self.track(tensor, owner)
            return tensor if token is None else token

        def unpack(packed: object) -> torch.Tensor:
            if isinstance(packed, ResidentToken):
                return packed.tensor
            return cast(torch.Tensor, packed)  # a tensor track() did not count

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def resident_bytes(self, owner: Hashable = 0) -> int:
        return self._resident.get(owner, 0)

    def peak_bytes(self, owner: Hashable = 0) -> int:
        return self._peak.get(owner, 0)

    @property
    def peaks(self) -> dict[Hashable, int]:
        """Peak resident activation bytes of every owner seen since the last reset."""
        return dict(self._peak)

    def reset(self) -> None:
        """Start a new measurement: peaks restart from what is resident now; scope sizes clear."""
        self._peak = dict(self._resident)
        self._scope_bytes = {}
        self._scope_storages = {}

    @property
    def scope_bytes(self) -> dict[Hashable, int]:
        """Bytes of the distinct storages saved inside each scope's last forward (since the
        last reset)."""
        return dict(self._scope_bytes)

    @property
    def stage_scope_bytes(self) -> dict[tuple[int, int], int]:
        """``scope_bytes`` of the scopes keyed (stage, microbatch), as Pipeline keys them; other
        keys (a meter used by hand) are left out."""
        return {(key[0], key[1]): nbytes for key, nbytes in self._scope_bytes.items()
                if isinstance(key, tuple) and len(key) == 2}

    def stage_activation_bytes(self, num_stages: int) -> tuple[int, ...]:
        """Per-stage activation bytes of one microbatch, for CostModel(stage_activation_bytes=).

        Needs scopes keyed (stage, microbatch); raises if a stage's microbatches differ (the
        simulator takes one size per stage) or a stage was not measured.
        """
        sizes: dict[int, set[int]] = {}
        for (stage, _), nbytes in self.stage_scope_bytes.items():
            sizes.setdefault(stage, set()).add(nbytes)
        result = []
        for stage in range(num_stages):
            seen = sizes.get(stage)
            if not seen:
                raise ConfigError(
                    f"stage {stage} has no measured activation; run a step with this meter first"
                )
            if len(seen) > 1:
                raise ConfigError(
                    f"stage {stage}'s microbatches saved different byte counts {sorted(seen)}; "
                    "the simulator takes one size per stage (use equal microbatches)"
                )
            result.append(seen.pop())
        return tuple(result)
