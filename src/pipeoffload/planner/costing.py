"""From a model, a GPU and a parallel layout to what the simulator and the memory check need.

A layout is DP x TP x PP GPUs with v chunks (stages) per pipeline rank, a microbatch size and a
recompute option. This module turns it into
- per-stage costs (``ratio.stage_cost``): the model's layers split over the p*v stages in
  model order, the embedding in front of the first stage and the head behind the last;
- the simulator's ``CostModel`` (seconds, bytes, host links) - see Note [rank order];
- per-rank model-state memory (weights, gradients, optimizer) and the DP exchange time;
- the model FLOPs of a step and the peak FLOP/s that MFU is quoted against.

Note [rank order]: GPUs are numbered TP fastest, then CP, then PP, then DP (global rank
= tp_rank + tp * (cp_rank + cp * (pp_rank + pp * dp_rank))). So a TP group sits inside a
node, then its context-parallel peers (``tp`` GPUs apart; context.py), neighbouring pipeline
ranks are ``tp * cp`` GPUs apart, and a DP group is ``tp * cp * pp`` apart: ``pipeoffload
train --rank-order dp,pp,cp,tp`` (parallel/rank_order.py, outermost first; train's default,
pp,dp,cp,tp, puts the replicas inside the pipeline instead). GPUs that share a
host link (``Hardware.gpus_per_host_link``, two A100s on one PCIe switch) are neighbours: with
tp >= that count they are in one TP group and copy their shards at the same moments, so each
gets 1/share of the link; with tp below it, ``share / tp`` pipeline ranks share one link and
the simulator queues their copies (``HostLink.ranks_per_link``), each copy of a rank's shard
getting 1/tp of the link.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeoffload.checks import check_number
from pipeoffload.errors import ConfigError
from pipeoffload.planner.comm_bytes import ring_collective_bytes
from pipeoffload.planner.context import context_spec
from pipeoffload.planner.hardware import Hardware
from pipeoffload.planner.layer_time import CAUSAL_FRACTION, collective_s
from pipeoffload.planner.layer_work import NormKernel
from pipeoffload.planner.optimizer import (
    OptimizerSpec,
    StateBytes,
    dp_s,
    dp_traffic,
    optimizer_step_s,
    state_bytes,
)
from pipeoffload.planner.ratio import (
    PieceCost,
    RunConfig,
    embedding_cost,
    head_cost,
    layer_cost,
    p2p_s,
)
from pipeoffload.planner.transformer import (
    FlopCount,
    ParamCount,
    Recompute,
    TransformerSpec,
    attention_core_flops,
    head_flops,
    layer_flops,
)
from pipeoffload.sim.costs import CostModel, Duplex, HostLink

GIB = 2**30

@dataclass(frozen=True)
class Layout:
    """How the job is split: ``dp`` x ``tp`` x ``pp`` x ``cp`` GPUs (``cp``: ``run.cp``,
    context.py), ``chunks`` stages per pipeline rank, ``micro_batch`` sequences per
    microbatch, and what the layers recompute."""

    dp: int
    tp: int
    pp: int
    chunks: int = 1
    run: RunConfig = RunConfig()

    @property
    def cp(self) -> int:
        return self.run.cp

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def grad_replicas(self) -> int:
        """The ranks that average each gradient (and share a distributed optimizer's state):
        data-parallel x context-parallel (Megatron-LM's data-parallel group with CP)."""
        return self.dp * self.cp

    @property
    def stages(self) -> int:
        return self.pp * self.chunks


@dataclass(frozen=True)
class Framework:
    """How the training framework runs a layout (layer_time.py, Note [exposed TP
    communication]); the planner's defaults are what ``pipeoffload train`` and current Megatron
    do. ``sequence_parallel``: TP shards norms and dropouts over the sequence (Korthikanti et al.
    2022). ``tp_overlap``: backward TP collectives overlap their matmuls (Megatron's
    asynchronous communication, 2022 on). ``grad_accumulation_bytes``: bytes per parameter per
    microbatch of accumulating weight gradients beyond the GEMM's output (layer_time.py).
    ``p2p_blocking``: stages wait for their pipeline transfers (Note [blocking P2P]).
    ``norm_kernel``: the LayerNorm kernels (layer_work.py, Note [norm kernels]).
    ``userbuffers``: Transformer Engine overlaps every TP collective with a matmul
    (layer_time.py, Note [userbuffer overlap]). ``attention_speedup``: the framework's flash
    attention kernel's rate over the hardware preset's (FlashAttention-2's, calibrated;
    frameworks.py ``CUDNN_ATTENTION_SPEEDUP``)."""

    sequence_parallel: bool = True
    tp_overlap: bool = True
    grad_accumulation_bytes: float = 6.0
    p2p_blocking: bool = False
    norm_kernel: NormKernel = NormKernel.PERSISTENT
    userbuffers: bool = False
    attention_speedup: float = 1.0

    def run(self, micro_batch: int, tp: int, recompute: Recompute, *,
            w_deferred: bool = False, cp: int = 1) -> RunConfig:
        """The RunConfig of one layout under this framework."""
        return RunConfig(micro_batch=micro_batch, tp=tp, recompute=recompute, cp=cp,
                         sequence_parallel=self.sequence_parallel, tp_overlap=self.tp_overlap,
                         w_deferred=w_deferred, p2p_blocking=self.p2p_blocking,
                         grad_accumulation_bytes=self.grad_accumulation_bytes,
                         norm_kernel=self.norm_kernel, userbuffers=self.userbuffers,
                         attention_speedup=self.attention_speedup)


#: What ``pipeoffload train`` and current Megatron do (Framework's defaults).
DEFAULT_FRAMEWORK = Framework()


@dataclass(frozen=True)
class MemoryConfig:
    """What device memory holds besides activations, and how much must stay free.

    ``reserve_bytes`` is a fixed allowance per GPU for what the model does not count: the CUDA
    context (~0.5 GiB), NCCL communicators and buffers (~1 GiB), cuBLAS / flash-attention
    workspaces and the backward's temporary buffers, and caching-allocator fragmentation
    (together ~2.5 GiB on large models). 4 GiB; raise it for safety, lower it to squeeze.
    Of the NCCL part, the pipeline's channel communicators (runtime/groups.py) hold, per
    connection a rank receives on and per P2P channel, NCCL's LL, LL128 and SIMPLE buffers:
    512 KiB + 4.69 MiB + 4 MiB = 9.19 MiB by default (NVIDIA/nccl src/init.cc
    ``computeBuffSizes``, src/transport/p2p.cc), times ``p2pnChannelsPerPeer`` (set from the
    topology, e.g. 2), for at most four receiving connections: ~74 MiB per rank at 2 channels
    per peer. The headroom that keeps the allocator off its out-of-memory path (whose cudaFree
    synchronises the device and can deadlock NCCL) is in the reserve too (docs/runtime.md,
    GPU rules).
    ``optimizer``: bytes per parameter of mixed-precision Adam; ``sharded=True`` is ZeRO-1.
    """

    reserve_bytes: float = 4 * GIB
    optimizer: OptimizerSpec = OptimizerSpec()

    def __post_init__(self) -> None:
        check_number("MemoryConfig.reserve_bytes", self.reserve_bytes, minimum=0)


def split_layers(num_layers: int, stages: int) -> tuple[int, ...]:
    """Layers per stage in model order: as even as possible, the spare layers on the middle
    stages so that the first (embedding) and last (head) stages are not the heaviest."""
    if stages < 1 or num_layers < stages:
        raise ConfigError(
            f"{num_layers} layers cannot fill {stages} pipeline stages (each needs at least "
            f"one layer); use fewer stages (pp x chunks <= {num_layers})"
        )
    base, spare = divmod(num_layers, stages)
    counts = [base] * stages
    middle = list(range(1, stages - 1)) or list(range(stages))
    # Spread the spare layers evenly over the middle stages.
    for n in range(spare):
        counts[middle[(n * len(middle)) // spare]] += 1
    return tuple(counts)


def run_parts(spec: TransformerSpec, hw: Hardware, run: RunConfig
              ) -> tuple[PieceCost, PieceCost, PieceCost]:
    """The layer, the embedding and the head of one microbatch under ``run``: what
    ``stage_costs`` sums, the same for every layout with this run (a search keeps them)."""
    return layer_cost(spec, hw, run), embedding_cost(spec, hw, run), head_cost(spec, hw, run)


def stage_costs(spec: TransformerSpec, hw: Hardware, layout: Layout,
                parts: tuple[PieceCost, PieceCost, PieceCost] | None = None
                ) -> tuple[PieceCost, ...]:
    """One microbatch through each stage, in stage order (see the module docstring); the layer,
    embedding and head are priced once and summed (``ratio.stage_cost`` for one stage).
    ``parts``: ``run_parts`` of ``layout.run``, when the caller has them."""
    counts = split_layers(spec.num_layers, layout.stages)
    last = len(counts) - 1
    layer, embedding, head = parts or run_parts(spec, hw, layout.run)
    by_count = {n: layer.times(n) for n in set(counts)}
    first = embedding + by_count[counts[0]]
    stages = [first if s == 0 else by_count[n] for s, n in enumerate(counts)]
    if spec.tied_embeddings and layout.pp == 1:  # one rank: the head uses the embedding itself
        head = dataclasses.replace(head, params=ParamCount(
            head.params.sharded - tied_embedding_params(spec, layout.tp), head.params.replicated))
    stages[last] = stages[last] + head
    exchange = blocking_p2p_s(spec, hw, layout)
    if exchange:
        stages = [dataclasses.replace(piece, f_s=piece.f_s + exchange, i_s=piece.i_s + exchange)
                  for piece in stages]
    return tuple(stages)


def blocking_p2p_s(spec: TransformerSpec, hw: Hardware, layout: Layout) -> float:
    """Note [blocking P2P]: Megatron-LM's schedules before its 2023 P2P overlap send and receive
    the boundary activation (and its gradient) with batched isend / irecv and wait for them
    between computes (megatron/p2p_communication.py), so after each F and each backward a stage
    waits one transfer; without sequence parallelism each TP rank sends 1 / t of it and the
    receivers all-gather it over NVLink (Narayanan et al. 2021, section 4.1, scatter / gather).
    0 for runtimes that post transfers ahead (``pipeoffload train``): the simulator then adds
    the transfer's latency to each cross-rank dependency instead."""
    if not layout.run.p2p_blocking or layout.pp == 1:
        return 0.0
    cross = _cross_node(hw, layout.tp * layout.cp * layout.pp)
    gather = 0.0 if layout.run.sequence_parallel else \
        collective_s(context_spec(spec, layout.cp), hw, layout.run.micro_batch, layout.tp)
    return p2p_s(spec, hw, layout.run, cross_node=cross) + gather


def _cross_node(hw: Hardware, span: int) -> bool:
    return span > hw.gpus_per_node


def host_link(hw: Hardware, layout: Layout) -> tuple[HostLink, float]:
    """The simulator's host link and each rank's share of its bandwidth (Note [rank order])."""
    share = hw.gpus_per_host_link
    duplex = Duplex.FULL if hw.full_duplex else Duplex.HALF
    if layout.tp >= share:
        return HostLink(duplex, 1), 1.0 / share
    return HostLink(duplex, max(1, share // layout.tp)), 1.0 / layout.tp


def cost_model(pieces: tuple[PieceCost, ...], spec: TransformerSpec, hw: Hardware,
               layout: Layout) -> CostModel:
    """The simulator's costs in seconds and bytes.

    The simulator scales a stage's F, I and W together (``stage_time_scale``), so each stage
    keeps the F : I : W split of the heaviest plain-layer stage while its F + I + W total is
    exact; the head's real split (2 b s h V each) differs a little.
    """
    reference = max(pieces[1:-1] or pieces, key=lambda piece: piece.chunk_s)
    link, fraction = host_link(hw, layout)
    return CostModel(
        f_time=reference.f_s,
        i_time=reference.i_s,
        w_time=reference.w_s,
        p2p_time=0.0 if layout.run.p2p_blocking else p2p_s(
            spec, hw, layout.run, cross_node=_cross_node(hw, layout.tp * layout.cp * layout.pp)),
        stage_activation_bytes=tuple(piece.activation_bytes for piece in pieces),
        stage_time_scale=tuple(piece.chunk_s / reference.chunk_s for piece in pieces),
        d2h_bytes_per_s=hw.d2h_bytes_per_s * fraction,
        h2d_bytes_per_s=hw.h2d_bytes_per_s * fraction,
        host_link=link,
    )


def rank_params(pieces: tuple[PieceCost, ...], stage_to_rank: tuple[int, ...]) -> list[float]:
    """Parameters each pipeline rank holds (one TP shard)."""
    params = [0.0] * (max(stage_to_rank) + 1)
    for stage, piece in enumerate(pieces):
        params[stage_to_rank[stage]] += piece.params.total
    return params


def rank_state(spec: TransformerSpec, pieces: tuple[PieceCost, ...],
               stage_to_rank: tuple[int, ...], layout: Layout,
               memory: MemoryConfig) -> list[StateBytes]:
    """Weights, gradients and optimizer state per pipeline rank."""
    return [state_bytes(spec, n, memory.optimizer, dp=layout.grad_replicas)
            for n in rank_params(pieces, stage_to_rank)]


def dp_seconds(spec: TransformerSpec, hw: Hardware, pieces: tuple[PieceCost, ...],
               stage_to_rank: tuple[int, ...], layout: Layout, memory: MemoryConfig) -> float:
    """The exposed DP gradient exchange of the slowest rank (optimizer.py, Note [step outside
    the pipeline]): all of it after the pipeline drains, or with ``overlap_grad_reduce`` what
    sticks out of one microbatch's backward through the rank's stages. DP groups are ``tp x
    pp`` GPUs apart (Note [rank order]); those of a group in one node share its NICs. With tied
    embeddings the all-reduce of their gradient follows (``embedding_sync_s``). With context
    parallelism the group is dp x cp (``Layout.grad_replicas``): cp ranks ``tp`` apart, dp
    ``tp * cp * pp`` apart."""
    if layout.grad_replicas == 1:
        return embedding_sync_s(spec, hw, stage_to_rank, layout, memory.optimizer)
    cross = _cross_node(hw, layout.gpus)
    node = hw.gpus_per_node
    per_node = (min(layout.cp, max(1, node // layout.tp))
                * min(layout.dp, max(1, node // (layout.tp * layout.cp * layout.pp))))
    backward = [0.0] * (max(stage_to_rank) + 1)
    for stage, piece in enumerate(pieces):
        backward[stage_to_rank[stage]] += piece.i_s + piece.w_s
    exposed = 0.0
    for rank, params in enumerate(rank_params(pieces, stage_to_rank)):
        seconds = dp_s(dp_traffic(spec, params, memory.optimizer, dp=layout.grad_replicas), hw,
                       cross_node=cross, gpus_per_node=per_node)
        if memory.optimizer.overlap_grad_reduce:
            seconds = max(0.0, seconds - backward[rank])
        exposed = max(exposed, seconds)
    return exposed + embedding_sync_s(spec, hw, stage_to_rank, layout, memory.optimizer)


def tied_embedding_params(spec: TransformerSpec, tp: int) -> float:
    """Weights the output layer shares with the input embedding (0 when they are untied)."""
    return spec.vocab * spec.hidden / tp if spec.tied_embeddings else 0.0


def embedding_sync_s(spec: TransformerSpec, hw: Hardware, stage_to_rank: tuple[int, ...],
                     layout: Layout, optimizer: OptimizerSpec) -> float:
    """Tied embeddings on two pipeline ranks: after the DP exchange and before the optimizer
    step, Megatron-LM all-reduces the embedding's gradient between the first and the last
    stage (``train_step``, 2021 and 2022: ``all_reduce(grad, group=get_embedding_group())``,
    not overlapped; every rank then waits for it at the optimizer's gradient-norm all-reduce).
    A ring all-reduce over 2 GPUs sends each one the whole gradient, V h / t x ``grad_bytes``,
    over NVLink when both ranks are in one node, else one GPU per node over the NICs."""
    if not spec.tied_embeddings or stage_to_rank[0] == stage_to_rank[-1]:
        return 0.0
    nbytes = 2 * ring_collective_bytes(tied_embedding_params(spec, layout.tp), 2,
                                       optimizer.grad_bytes)
    cross = _cross_node(hw, layout.tp * layout.cp * layout.pp)
    return nbytes / hw.achieved_bytes_per_s(cross_node=cross, one_gpu_per_node=True)


def optimizer_seconds(hw: Hardware, pieces: tuple[PieceCost, ...],
                      stage_to_rank: tuple[int, ...], layout: Layout,
                      memory: MemoryConfig) -> float:
    """The optimizer step of the rank with the most parameters (memory-bound; optimizer.py)."""
    return max(optimizer_step_s(params, memory.optimizer, hw, dp=layout.grad_replicas)
               for params in rank_params(pieces, stage_to_rank))


def step_model_flops(spec: TransformerSpec, sequences: int, *, causal: bool = False) -> float:
    """Model FLOPs of one training step over ``sequences`` sequences (FlopCount.MODEL: the
    math counted once, no recompute). ``causal``: the attention core's share counted as a
    causal kernel runs it, half the s x s square (``CAUSAL_FRACTION``); else the whole square,
    Megatron's convention (docs/planner-model.md, "MFU conventions")."""
    layer = layer_flops(spec, 1, tp=1, count=FlopCount.MODEL).total
    if causal:  # F's core once, I's twice (layer_flops): three cores, of which half is skipped
        layer -= 3 * (1 - CAUSAL_FRACTION) * attention_core_flops(spec, 1)
    return (spec.num_layers * layer + head_flops(spec, 1, tp=1).total) * sequences


def peak_flops(hw: Hardware) -> tuple[float, bool]:
    """The FLOP/s MFU divides by, and whether it is a datasheet peak (else the achievable rate
    of the preset, which gives higher MFU figures)."""
    return hw.mfu_peak_flops_per_s, bool(hw.peak_flops_per_s)
