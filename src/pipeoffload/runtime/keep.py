"""Which saved tensors the offloader leaves on the device, and why (offloader.py Note: [kept on
device]): parameters and what is derived from them, tensors it cannot rebuild, what the caller
keeps, tensors on another device, and small ones."""

from __future__ import annotations

from typing import Any

import torch

from pipeoffload.runtime.meter import is_plain, storage_key
from pipeoffload.runtime.shards import local_shards

_VIEW_NODES = frozenset({"TBackward0", "ViewBackward0", "TransposeBackward0",
                         "PermuteBackward0", "ExpandBackward0", "UnsqueezeBackward0"})


def _only_next(node: Any) -> Any:
    nexts = [n for n, _ in node.next_functions if n is not None]
    return nexts[0] if len(nexts) == 1 else None


class KeepRule:
    """The reasons of the offloader's ``kept_bytes``, for one device and set of parameters."""

    def __init__(self, device: torch.device, parameters: list[torch.Tensor],
                 min_offload_elements: int) -> None:
        self._device = device
        self._params = {storage_key(p) for p in local_shards(parameters)
                        if p.untyped_storage().nbytes()}
        self._param_ids = {id(p) for p in parameters}
        self._min_elements = min_offload_elements

    def reason(self, tensor: torch.Tensor, kept: frozenset[tuple[str, int]]) -> str | None:
        """Why a saved tensor stays on the device, None to move it; ``kept``: the storages the
        caller keeps (``scope(keep=)``)."""
        if (isinstance(tensor, torch.nn.Parameter)
                # a view of a parameter made in the step (FSDP's unsharded parameters)
                or isinstance(tensor._base, torch.nn.Parameter)
                or (is_plain(tensor) and storage_key(tensor) in self._params)
                or self._derived_from_parameter(tensor)):
            return "parameter"
        if not is_plain(tensor):
            return "not dense"
        if storage_key(tensor) in kept:
            return "kept by the caller"
        if tensor.device.type != self._device.type or tensor.device.index != self._device.index:
            return "other device"
        if tensor.numel() <= self._min_elements:
            return "small"
        return None

    def _derived_from_parameter(self, tensor: torch.Tensor) -> bool:
        """A cast of a parameter, or a view of one (autocast's cached low-precision weight): it is
        not an activation, and offloading it would copy the weight out and back per
        microbatch. Only casts and views count: an embedding lookup is an activation."""
        node = tensor.grad_fn
        while node is not None and type(node).__name__ in _VIEW_NODES:
            node = _only_next(node)
        if node is None or type(node).__name__ != "ToCopyBackward0":
            return False
        source = _only_next(node)
        return id(getattr(source, "variable", None)) in self._param_ids
