"""Seconds of a layer's F, I and W on one GPU: matmuls priced by their shape (gemm.py), tensor
parallel collectives by what Megatron's sequence-parallel pattern leaves exposed.

Note [exposed TP communication]: with tensor + sequence parallelism (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", section 4.2.2) a layer runs
two column-parallel linears (QKV, the first MLP matmul), each behind an all-gather (AG) of the
sequence-sharded input, and two row-parallel ones (output projection, last MLP matmul), each
followed by a reduce-scatter (RS) back to sequence shards. Every collective moves b s h
elements. What overlaps follows Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``
(the 2022 code their measurements used, without Transformer Engine's userbuffer overlap):
- forward: the 2 AG and 2 RS sit between dependent matmuls; all 4 are exposed (F).
- backward of a row-parallel linear: the AG of the output gradient (the RS's conjugate) is
  needed before its input-gradient matmul; 2 exposed (I).
- backward of a column-parallel linear: the input is all-gathered again for the weight
  gradient, overlapped with the input-gradient matmul (I); the input gradient's RS is overlapped
  with the weight-gradient matmul (W). Only the part of each collective longer than its matmul
  is exposed. This assumes W runs right after I, as Megatron does; zero-bubble schedules that
  defer W would expose the RS instead (not modelled).
- full recompute re-runs the forward, its 4 exposed collectives included, before I.
- embedding: an RS of its output in F and an AG of its gradient in the backward, exposed. Head
  (column-parallel): an AG in F, exposed; its backward AG and RS hide behind its b s h V / t
  matmuls like any column-parallel linear.
Collectives run at NCCL's achieved bus bandwidth (``Hardware.link_bytes_per_s``); compute
slowed by collectives sharing the SMs is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeoffload.planner.gemm import head_gemm, layer_gemms
from pipeoffload.planner.hardware import Hardware
from pipeoffload.planner.transformer import (
    FlopCount,
    Recompute,
    TransformerSpec,
    as_flop_count,
    as_recompute,
    layer_flops,
    ring_collective_bytes,
)


@dataclass(frozen=True)
class PassSeconds:
    """Seconds of the forward F, input-gradient I and weight-gradient W of one piece."""

    f_s: float
    i_s: float
    w_s: float

    def __add__(self, other: PassSeconds) -> PassSeconds:
        return PassSeconds(self.f_s + other.f_s, self.i_s + other.i_s, self.w_s + other.w_s)


def collective_s(spec: TransformerSpec, hw: Hardware, micro_batch: int, tp: int) -> float:
    """One ring all-gather or reduce-scatter of b s h elements over ``tp`` GPUs (0 at tp = 1)."""
    elements = micro_batch * spec.seq_len * spec.hidden
    nbytes = ring_collective_bytes(elements, tp, spec.activation_bytes)
    return nbytes / hw.link_bytes_per_s(tp) if tp > 1 else 0.0


def _exposed(comm_s: float, behind_s: float) -> float:
    """What sticks out of a collective overlapped with a matmul of ``behind_s`` seconds."""
    return max(0.0, comm_s - behind_s)


def layer_compute_s(spec: TransformerSpec, hw: Hardware, micro_batch: int, tp: int,
                    count: FlopCount | str) -> PassSeconds:
    """Matmul seconds of one layer: the linear layers by shape, the attention core (flash
    kernels, whose per-head shape does not change with tp) at the preset's rate."""
    gemms = layer_gemms(spec, micro_batch, tp).all()
    linear_s = sum(hw.gemm_s(gemm) for gemm in gemms)
    linear_flops = sum(gemm.flops for gemm in gemms)
    flops = layer_flops(spec, micro_batch, tp=tp, count=as_flop_count(count))
    return PassSeconds(
        linear_s + hw.compute_s(max(0.0, flops.f - linear_flops)),
        linear_s + hw.compute_s(max(0.0, flops.i - linear_flops)),
        linear_s,
    )


def layer_seconds(spec: TransformerSpec, hw: Hardware, micro_batch: int, tp: int,
                  recompute: Recompute | str, count: FlopCount | str) -> PassSeconds:
    """F / I / W seconds of one layer, exposed TP collectives included (Note [exposed TP
    communication]); under full recompute (HARDWARE count) I re-runs the whole forward."""
    compute = layer_compute_s(spec, hw, micro_batch, tp, count)
    one = collective_s(spec, hw, micro_batch, tp)
    gemms = layer_gemms(spec, micro_batch, tp)
    column = (hw.gemm_s(gemms.qkv), hw.gemm_s(gemms.mlp_in))
    forward = compute.f_s + 4 * one
    seconds = PassSeconds(
        forward,
        compute.i_s + 2 * one + sum(_exposed(one, matmul) for matmul in column),
        compute.w_s + sum(_exposed(one, matmul) for matmul in column),
    )
    full = as_recompute(recompute) is Recompute.FULL
    if full and as_flop_count(count) is FlopCount.HARDWARE:
        seconds = seconds + PassSeconds(0.0, forward, 0.0)
    return seconds


def embedding_seconds(spec: TransformerSpec, hw: Hardware, micro_batch: int,
                      tp: int) -> PassSeconds:
    """No matmul: its RS in F and the AG of its gradient in the backward (charged to I)."""
    one = collective_s(spec, hw, micro_batch, tp)
    return PassSeconds(one, one, 0.0)


def head_seconds(spec: TransformerSpec, hw: Hardware, micro_batch: int, tp: int) -> PassSeconds:
    """The output projection by shape in each pass; its F all-gather exposed, its backward
    collectives behind its own matmuls."""
    one = collective_s(spec, hw, micro_batch, tp)
    matmul = hw.gemm_s(head_gemm(spec, micro_batch, tp))
    hidden = _exposed(one, matmul)
    return PassSeconds(matmul + one, matmul + hidden, matmul + hidden)
