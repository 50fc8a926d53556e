"""Seconds of a layer's F, I and W on one GPU: matmuls priced by their shape (gemm.py), the
attention core by its kernels, memory-bound work by the bytes it moves (layer_work.py), and
tensor-parallel collectives by what Megatron's pattern leaves exposed.

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
  is exposed. A zero-bubble schedule defers W (``RunConfig.w_deferred``): the next layer's
  input gradient needs that RS now, so it is exposed in I.
- without sequence parallelism (Shoeybi et al. 2019) F all-reduces after each row-parallel
  linear (2 exposed all-reduces, each an AG's and an RS's bytes) and the backward all-reduces
  each column-parallel input gradient: behind its weight-gradient matmul with Megatron's
  asynchronous all-reduce (2022), blocking before it (``RunConfig.tp_overlap=False``, the 2021
  code of Narayanan et al.).
- full recompute re-runs the forward, its collectives included, before I.
- embedding: an RS of its output in F and an AG of its gradient in I (an all-reduce in F
  without sequence parallelism). Head (column-parallel): an AG in F; its backward collectives
  hide behind its b s h V / t matmuls like any column-parallel linear's.
Collectives run at NCCL's achieved bus bandwidth (``Hardware.link_bytes_per_s``).

Note [collectives share the SMs]: an NCCL collective runs as a kernel with one thread block
per channel, each on its own SM, for as long as it lasts; Megatron launches it before the matmul
it overlaps ("to have gather scheduled first and have GPU resources allocated", the comment in
``LinearWithGradAccumulationAndAsyncCommunication.backward``), so the matmul runs on the other
SMs meanwhile. A collective of c seconds behind a matmul of g seconds therefore costs
max(c - g, c k / S) on top of the matmul, k = ``Hardware.collective_sms`` (NCCL's channels),
S = the GPU's SMs: the part of the collective longer than the matmul, or the matmul's slowdown
while it has S - k SMs (a matmul's rate taken as proportional to its SMs; a large matmul
register-file-fills its SMs, so it cannot share one with a collective's block). A blocking
collective takes nothing from a matmul: nothing runs beside it.

Note [userbuffer overlap]: Transformer Engine's comm-GEMM overlap (Megatron-Core's
``--tp-comm-overlap``, NeMo's ``ub_tp_comm_overlap``; ``RunConfig.userbuffers``) splits each
sequence-parallel collective into chunks pipelined with the matmul it feeds or follows: the
forward's all-gather before QKV and MLP-in runs beside those matmuls (ring exchange), its
reduce-scatter after the output projection and MLP-out beside them, and in the backward the
all-gather of the row-parallel linears' output gradient beside their input-gradient matmuls.
Each is priced as an overlapped collective (Note [collectives share the SMs]: the part longer
than its matmul, or the SMs it holds), with NCCL's channel count for the SMs [assumption: TE
sets its own SM counts per GEMM, which are not modelled]. Without sequence parallelism it
changes nothing here.

Note [attention core]: without flash attention Q K^T and P V are batched GEMMs over the b a / t
(sequence, head) pairs with k = d (Q K^T) or k = s (P V), two in F and four in I, priced by
shape like every GEMM; their s x s softmax and dropout are memory-bound work. Flash attention
(Dao et al. 2022) runs them in one kernel per pass at ``Hardware.attention_flops_per_s``; a causal
kernel skips the blocks above the diagonal, half of the s x s square (``CAUSAL_FRACTION``), and
its backward re-runs Q K^T (the HARDWARE count).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeoffload.errors import ConfigError
from pipeoffload.planner.comm_bytes import ring_collective_bytes
from pipeoffload.planner.context import context_spec, kv_gather_s
from pipeoffload.planner.gemm import Gemm, head_gemm, layer_gemms
from pipeoffload.planner.hardware import Hardware
from pipeoffload.planner.layer_work import (
    NormKernel,
    PassWork,
    as_norm_kernel,
    embedding_memory_work,
    head_memory_work,
    layer_memory_work,
)
from pipeoffload.planner.transformer import (
    FlopCount,
    Recompute,
    TransformerSpec,
    as_flop_count,
    as_recompute,
    layer_flops,
    layer_params,
)

#: Share of the s x s attention square a causal flash-attention kernel computes.
CAUSAL_FRACTION = 0.5
#: GEMM kernels per layer and pass: 4 linears in F, their 4 input-gradient matmuls in I and 4
#: weight-gradient matmuls in W.
LINEAR_KERNELS = 4


@dataclass(frozen=True)
class RunConfig:
    """How a model runs on each GPU.

    ``micro_batch`` sequences per microbatch; ``tp`` tensor-parallel degree with
    ``sequence_parallel`` (Korthikanti et al. 2022) or without; ``recompute``; which FLOPs count
    (transformer.FlopCount). How the framework overlaps (Note [exposed TP communication]):
    ``tp_overlap`` - backward collectives of column-parallel linears behind their matmuls;
    ``w_deferred`` - the schedule runs W apart from I (zero bubble); ``p2p_blocking`` - a stage
    waits for its pipeline sends and receives (Megatron before 2023: costing.py, Note [blocking
    P2P]). ``grad_accumulation_bytes``:
    bytes per parameter that adding one microbatch's weight gradients into the accumulated
    gradient moves beyond the GEMM's own 16-bit output: 6 both for an unfused add of 16-bit
    gradients (read the new one, read and write the sum: 2 + 2 + 2; Megatron 2021's
    main_grad.add_, PyTorch's .grad accumulation) and for Megatron's gradient-accumulation
    fusion (the GEMM reads and writes an fp32 sum instead of writing 16 bits: 4 + 4 - 2).
    ``norm_kernel``: which LayerNorm kernels run (layer_work.py, Note [norm kernels]).
    ``userbuffers``: Transformer Engine's userbuffer overlap (Note [userbuffer overlap]).
    ``cp``: context-parallel degree, each GPU holding 1/cp of every sequence (context.py, Note
    [context parallelism]); the functions here take the whole model and price one CP rank.
    ``attention_speedup``: the framework's flash-attention kernel against the one the
    hardware's ``attention_flops_per_s`` describes (Note [attention core]).
    """

    micro_batch: int = 1
    tp: int = 1
    recompute: Recompute = Recompute.LGD
    flop_count: FlopCount = FlopCount.HARDWARE
    sequence_parallel: bool = True
    tp_overlap: bool = True
    w_deferred: bool = False
    p2p_blocking: bool = False
    grad_accumulation_bytes: float = 6.0
    norm_kernel: NormKernel = NormKernel.PERSISTENT
    userbuffers: bool = False
    cp: int = 1
    attention_speedup: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", as_recompute(self.recompute))
        object.__setattr__(self, "norm_kernel", as_norm_kernel(self.norm_kernel))
        object.__setattr__(self, "flop_count", as_flop_count(self.flop_count))
        for field in ("micro_batch", "tp", "cp"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"RunConfig.{field} must be a positive integer, got {value!r}")
        for field in ("sequence_parallel", "tp_overlap", "w_deferred", "p2p_blocking",
                      "userbuffers"):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(f"RunConfig.{field} must be true or false, "
                                  f"got {getattr(self, field)!r}")
        value = self.grad_accumulation_bytes
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ConfigError(f"RunConfig.grad_accumulation_bytes must be >= 0, got {value!r}")
        value = self.attention_speedup
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"RunConfig.attention_speedup must be > 0, got {value!r}")


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


def _exposed(hw: Hardware, comm_s: float, behind_s: float) -> float:
    """What a collective of ``comm_s`` seconds overlapped with a matmul of ``behind_s`` seconds
    adds to it (Note [collectives share the SMs])."""
    return max(0.0, comm_s - behind_s, comm_s * hw.collective_sm_share)


def _memory(hw: Hardware, work: PassWork) -> PassSeconds:
    return PassSeconds(hw.memory_s(work.f.nbytes, work.f.kernels),
                       hw.memory_s(work.i.nbytes, work.i.kernels),
                       hw.memory_s(work.w.nbytes, work.w.kernels))


def attention_core_s(spec: TransformerSpec, hw: Hardware, micro_batch: int, tp: int,
                     count: FlopCount | str, speedup: float = 1.0) -> PassSeconds:
    """Q K^T and P V with their backward (Note [attention core]); their kernel launches
    included. ``speedup``: a flash kernel's rate over ``hw.attention_flops_per_s``."""
    launch = hw.kernel_launch_s if hw.hbm_bytes_per_s else 0.0
    s, d = spec.seq_len, spec.head_dim
    if not spec.flash_attention:
        pairs = micro_batch * spec.heads / tp
        scores = Gemm(s, s, d, spec.activation_bytes, pairs)  # Q K^T and dP = dO V^T
        context = Gemm(s, d, s, spec.activation_bytes, pairs)  # P V, dQ, dK, dV
        return PassSeconds(hw.gemm_s(scores) + hw.gemm_s(context) + 2 * launch,
                           hw.gemm_s(scores) + 3 * hw.gemm_s(context) + 4 * launch, 0.0)
    core = 4 * micro_batch * s * s * spec.hidden / tp  # forward FLOPs, full square
    rerun = 0.5 if as_flop_count(count) is FlopCount.HARDWARE else 0.0
    return PassSeconds(hw.attention_s(CAUSAL_FRACTION * core) / speedup + launch,
                       hw.attention_s(CAUSAL_FRACTION * core * (2 + rerun)) / speedup + launch,
                       0.0)


def layer_compute_s(spec: TransformerSpec, hw: Hardware, micro_batch: int, tp: int,
                    count: FlopCount | str, attention_speedup: float = 1.0) -> PassSeconds:
    """Matmul seconds of one layer: the linear layers by the shape each pass runs (F: Y = X W,
    I: dX = dY W^T, W: dW = X^T dY) and the attention core."""
    gemms = layer_gemms(spec, micro_batch, tp).all()
    linear = PassSeconds(sum(hw.gemm_s(g) for g in gemms),
                         sum(hw.gemm_s(g.input_gradient()) for g in gemms),
                         sum(hw.gemm_s(g.weight_gradient()) for g in gemms))
    if spec.flash_attention and not hw.attention_flops_per_s and not hw.hbm_bytes_per_s:
        # A preset that times neither flash kernels nor memory-bound work: the core's FLOPs
        # (this count) at the preset's matmul rate.
        flops = layer_flops(spec, micro_batch, tp=tp, count=as_flop_count(count))
        linear_flops = sum(gemm.flops for gemm in gemms)
        return linear + PassSeconds(hw.compute_s(max(0.0, flops.f - linear_flops)),
                                    hw.compute_s(max(0.0, flops.i - linear_flops)), 0.0)
    launches = LINEAR_KERNELS * hw.kernel_launch_s if hw.hbm_bytes_per_s else 0.0
    return linear + attention_core_s(spec, hw, micro_batch, tp, count, attention_speedup) \
        + PassSeconds(launches, launches, launches)


def _tp_seconds(spec: TransformerSpec, hw: Hardware, run: RunConfig) -> PassSeconds:
    """Exposed collectives of one layer (Note [exposed TP communication])."""
    one = collective_s(spec, hw, run.micro_batch, run.tp)
    if not one:
        return PassSeconds(0.0, 0.0, 0.0)
    gemms = layer_gemms(spec, run.micro_batch, run.tp)
    column = (gemms.qkv, gemms.mlp_in)
    dgrad = [hw.gemm_s(g.input_gradient()) for g in column]
    wgrad = [hw.gemm_s(g.weight_gradient()) for g in column]
    if run.sequence_parallel:
        gathers = sum(_exposed(hw, one, matmul) for matmul in dgrad) if run.tp_overlap \
            else 2 * one
        scatter = sum(_exposed(hw, one, matmul) for matmul in wgrad)
        forward, output_gathers = 4 * one, 2 * one
        if run.userbuffers:  # Note [userbuffer overlap]
            forward = sum(_exposed(hw, one, hw.gemm_s(g)) for g in gemms.all())
            output_gathers = sum(_exposed(hw, one, hw.gemm_s(g.input_gradient()))
                                 for g in (gemms.proj, gemms.mlp_out))
        if run.w_deferred or not run.tp_overlap:
            return PassSeconds(forward, output_gathers + gathers + 2 * one, 0.0)
        return PassSeconds(forward, output_gathers + gathers, scatter)
    reduces = sum(_exposed(hw, 2 * one, matmul) for matmul in wgrad)
    if not run.tp_overlap:
        return PassSeconds(4 * one, 4 * one, 0.0)
    if run.w_deferred:
        return PassSeconds(4 * one, 4 * one, 0.0)
    return PassSeconds(4 * one, 0.0, reduces)


def context_seconds(local: TransformerSpec, hw: Hardware, run: RunConfig) -> PassSeconds:
    """What context parallelism adds to a layer of ``local`` (s / cp tokens; context.py, Note
    [context parallelism]): the attention core's other cp - 1 shares (the rank's queries
    against the whole sequence's keys) and the exposed part of the K/V all-gather in F and of
    the dK/dV reduce-scatter in I, each overlapped with that pass's attention."""
    cp = run.cp
    core = attention_core_s(local, hw, run.micro_batch, run.tp, run.flop_count,
                            run.attention_speedup)
    launch = hw.kernel_launch_s if hw.hbm_bytes_per_s else 0.0
    extra = PassSeconds((core.f_s - launch) * (cp - 1), (core.i_s - launch) * (cp - 1), 0.0)
    comm = kv_gather_s(local, hw, run.micro_batch, run.tp, cp)
    return extra + PassSeconds(_exposed(hw, comm, core.f_s + extra.f_s),
                               _exposed(hw, comm, core.i_s + extra.i_s), 0.0)


def layer_seconds(spec: TransformerSpec, hw: Hardware, run: RunConfig) -> PassSeconds:
    """F / I / W seconds of one layer on one GPU: matmuls, attention core, memory-bound work
    and exposed TP collectives, with context parallelism's share and K/V exchange; under full
    recompute I re-runs the whole forward (HARDWARE count)."""
    spec = context_spec(spec, run.cp)
    b, tp = run.micro_batch, run.tp
    compute = layer_compute_s(spec, hw, b, tp, run.flop_count, run.attention_speedup)
    hardware = run.flop_count is FlopCount.HARDWARE
    recompute = run.recompute if hardware else Recompute.NONE
    memory = _memory(hw, layer_memory_work(spec, b, tp, sequence_parallel=run.sequence_parallel,
                                           recompute=recompute, norm_kernel=run.norm_kernel))
    comm = _tp_seconds(spec, hw, run)
    if run.cp > 1:  # with the attention: full recompute re-runs its F part too
        compute = compute + context_seconds(spec, hw, run)
    seconds = compute + memory + comm
    if recompute is Recompute.FULL:
        # The re-run forward: its matmuls and collectives (its memory-bound work is in memory).
        seconds = seconds + PassSeconds(0.0, compute.f_s + comm.f_s, 0.0)
    elif recompute is Recompute.SELECTIVE and not spec.flash_attention:
        core = attention_core_s(spec, hw, b, tp, run.flop_count, run.attention_speedup)
        seconds = seconds + PassSeconds(0.0, core.f_s, 0.0)
    if run.grad_accumulation_bytes and hw.hbm_bytes_per_s:
        params = layer_params(spec, tp=tp).sharded
        seconds = seconds + PassSeconds(
            0.0, 0.0, hw.memory_s(params * run.grad_accumulation_bytes, LINEAR_KERNELS))
    return seconds


def embedding_seconds(spec: TransformerSpec, hw: Hardware, run: RunConfig) -> PassSeconds:
    """No matmul: its lookup, dropout and gradient scatter (memory-bound), and its RS in F and
    AG in I (one all-reduce in F without sequence parallelism)."""
    spec = context_spec(spec, run.cp)
    one = collective_s(spec, hw, run.micro_batch, run.tp)
    work = embedding_memory_work(spec, run.micro_batch, run.tp,
                                 sequence_parallel=run.sequence_parallel)
    comm = PassSeconds(one, one, 0.0) if run.sequence_parallel else PassSeconds(2 * one, 0.0, 0.0)
    return _memory(hw, work) + comm


def head_seconds(spec: TransformerSpec, hw: Hardware, run: RunConfig) -> PassSeconds:
    """The output projection by shape in each pass, the final norm and the loss (memory-bound);
    its F all-gather exposed, its backward collectives behind its own matmuls, or blocking in I
    without ``tp_overlap`` (Megatron 2021's ``copy_to_tensor_model_parallel_region`` before
    ``parallel_lm_logits``: a synchronous all-reduce of the input gradient)."""
    spec = context_spec(spec, run.cp)
    one = collective_s(spec, hw, run.micro_batch, run.tp)
    gemm = head_gemm(spec, run.micro_batch, run.tp)
    f, i, w = (hw.gemm_s(g) for g in (gemm, gemm.input_gradient(), gemm.weight_gradient()))
    launch = hw.kernel_launch_s if hw.hbm_bytes_per_s else 0.0
    work = head_memory_work(spec, run.micro_batch, run.tp,
                            sequence_parallel=run.sequence_parallel, norm_kernel=run.norm_kernel)
    gather = one if run.sequence_parallel else 0.0
    if not run.tp_overlap:
        comm = PassSeconds(gather, 2 * one, 0.0)
    elif run.sequence_parallel:
        comm = PassSeconds(one, _exposed(hw, one, i), _exposed(hw, one, w))
    else:
        comm = PassSeconds(0.0, 0.0, _exposed(hw, 2 * one, w))
    return PassSeconds(f + launch, i + launch, w + launch) + comm + _memory(hw, work)
