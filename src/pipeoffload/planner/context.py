"""Context parallelism (CP) in the analytic model: what changes when each of ``cp`` GPUs holds
1/cp of every sequence (the runtime's parallel/context.py and runtime/sequence.py).

Note [context parallelism]: a CP rank holds chunks i and 2 cp - 1 - i of 2 cp (Megatron-LM's and
Llama 3's causal load balancing; Dubey et al. 2024, section 3.3.2), so
- every per-token term (linear matmuls, memory-bound work, TP collectives, the pipeline's
  boundary activation, saved activations) is the model's at s / cp: ``context_spec``;
- the attention core of a rank's queries against the whole sequence's keys is 1/cp of the whole
  sequence's (the split balances the causal square), i.e. cp times the core of an s / cp
  sequence: ``layer_context`` adds the other cp - 1;
- K and V are all-gathered over the CP group in F (Llama 3: "all-gather K and V, then compute
  attention for the local query chunk") and dK, dV reduce-scattered in the backward: ring
  collectives (Thakur et al. 2005, the bytes the TP terms use, ``comm_bytes.ring_collective_bytes``)
  of 2 b s h_kv / t elements over cp GPUs, at NCCL's achieved bandwidth of the link the group
  sits on (NVLink while tp x cp GPUs fit in a node). Each overlaps the attention of the pass
  (Transformer Engine's ring runs each KV chunk's transfer beside the previous chunk's
  attention; with an all-gather the local chunk's diagonal blocks need no remote K/V) and is
  priced like every overlapped collective (layer_time.py, Note [collectives share the SMs]):
  the part longer than the attention, or the SMs it holds;
- the attention keeps the gathered K and V for its backward: 2 e b s h_kv / t bytes per layer,
  of which the local (cp - 1)/cp part is added to the s / cp layer's (not under full recompute,
  which keeps only the layer input);
- gradients are averaged, and a distributed optimizer sharded, over dp x cp ranks (Megatron's
  data-parallel-with-CP group): costing.Layout.grad_replicas.
"""

from __future__ import annotations

import dataclasses

from pipeoffload.errors import ConfigError
from pipeoffload.planner.comm_bytes import ring_collective_bytes
from pipeoffload.planner.hardware import Hardware
from pipeoffload.planner.transformer import Recompute, TransformerSpec


def check_context(spec: TransformerSpec, cp: int) -> None:
    """ConfigError unless ``cp`` >= 1 cuts the sequence into 2 cp equal chunks."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ConfigError(f"cp must be a positive integer, got {cp!r}")
    if cp > 1 and spec.seq_len % (2 * cp):
        raise ConfigError(f"cp {cp}: sequence length {spec.seq_len} must be a multiple of "
                          f"2 * cp = {2 * cp} (each sequence is cut into 2 * cp chunks)")


def context_spec(spec: TransformerSpec, cp: int) -> TransformerSpec:
    """The model as one CP rank's per-token work sees it: sequences of s / cp tokens."""
    if cp == 1:
        return spec
    check_context(spec, cp)
    return dataclasses.replace(spec, seq_len=spec.seq_len // cp)


def kv_elements(local: TransformerSpec, micro_batch: int, tp: int, cp: int) -> float:
    """Elements of the whole sequence's K and V of one layer on one TP rank (the gathered
    tensors); ``local`` is ``context_spec``'s model."""
    return 2 * micro_batch * local.seq_len * cp * local.kv_heads * local.head_dim / tp


def kv_gather_bytes(local: TransformerSpec, micro_batch: int, tp: int, cp: int) -> float:
    """Bytes one GPU sends in the K/V all-gather of one layer (and again in the dK/dV
    reduce-scatter): a ring over cp GPUs."""
    return ring_collective_bytes(kv_elements(local, micro_batch, tp, cp), cp,
                                 local.activation_bytes)


def kv_gather_s(local: TransformerSpec, hw: Hardware, micro_batch: int, tp: int,
                cp: int) -> float:
    """Seconds of that ring on the CP group's link: CP ranks are ``tp`` GPUs apart (costing.py,
    Note [rank order]), inside a node while tp x cp GPUs fit in one."""
    if cp == 1:
        return 0.0
    link = hw.achieved_bytes_per_s(cross_node=tp * cp > hw.gpus_per_node)
    return kv_gather_bytes(local, micro_batch, tp, cp) / link


def gathered_kv_bytes(local: TransformerSpec, micro_batch: int, tp: int, cp: int,
                      recompute: Recompute) -> float:
    """Saved bytes the attention adds to the s / cp layer's: the other ranks' K and V."""
    if cp == 1 or recompute is Recompute.FULL:
        return 0.0
    return kv_elements(local, micro_batch, tp, cp) * (cp - 1) / cp * local.activation_bytes
