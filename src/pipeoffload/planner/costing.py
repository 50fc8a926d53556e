"""From a model, a GPU and a parallel layout to what the simulator and the memory check need.

A layout is DP x TP x PP GPUs with v chunks (stages) per pipeline rank, a microbatch size and a
recompute option. This module turns it into
- per-stage costs (``ratio.stage_cost``): the model's layers split over the p*v stages in
  model order, the embedding in front of the first stage and the head behind the last;
- the simulator's ``CostModel`` (seconds, bytes, host links) - see Note [rank order];
- per-rank model-state memory (weights, gradients, optimizer) and the DP exchange time;
- the model FLOPs of a step and the peak FLOP/s that MFU is quoted against.

Note [rank order]: GPUs are numbered TP fastest, then PP, then DP (global rank
= tp_rank + tp * (pp_rank + pp * dp_rank)). So a TP group sits inside a node, neighbouring
pipeline ranks are ``tp`` GPUs apart, and a DP group is ``tp * pp`` apart. GPUs that share a
host link (``Hardware.gpus_per_host_link``, two A100s on one PCIe switch) are neighbours: with
tp >= that count they are in one TP group and copy their shards at the same moments, so each
gets 1/share of the link; with tp below it, ``share / tp`` pipeline ranks share one link and
the simulator queues their copies (``HostLink.ranks_per_link``), each copy of a rank's shard
getting 1/tp of the link.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeoffload.checks import check_number
from pipeoffload.errors import ConfigError
from pipeoffload.planner.hardware import Hardware
from pipeoffload.planner.ratio import (
    OptimizerSpec,
    PieceCost,
    RunConfig,
    StateBytes,
    dp_s,
    dp_traffic,
    p2p_s,
    stage_cost,
    state_bytes,
)
from pipeoffload.planner.transformer import FlopCount, TransformerSpec, head_flops, layer_flops
from pipeoffload.sim.costs import CostModel, Duplex, HostLink

GIB = 2**30

#: Dense bf16 datasheet peaks (no sparsity) that MFU is quoted against, as the papers do:
#: A100 312 TFLOP/s; H100 SXM and H200 989 TFLOP/s (NVIDIA datasheets). Hardware not listed
#: (e.g. a probed JSON preset) falls back to its achievable ``bf16_flops_per_s``.
DATASHEET_PEAK_FLOPS: dict[str, float] = {
    "a100-80gb": 312e12,
    "h100-80gb": 989e12,
    "h200": 989e12,
}


@dataclass(frozen=True)
class Layout:
    """How the job is split: ``dp`` x ``tp`` x ``pp`` GPUs, ``chunks`` stages per pipeline
    rank, ``micro_batch`` sequences per microbatch, and what the layers recompute."""

    dp: int
    tp: int
    pp: int
    chunks: int = 1
    run: RunConfig = RunConfig()

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def stages(self) -> int:
        return self.pp * self.chunks


@dataclass(frozen=True)
class MemoryConfig:
    """What device memory holds besides activations, and how much must stay free.

    ``reserve_bytes`` is a fixed allowance per GPU for what the model does not count: the CUDA
    context (~0.5 GiB), NCCL communicators and buffers (~1 GiB), cuBLAS / flash-attention
    workspaces and the backward's temporary buffers, and caching-allocator fragmentation
    (together ~2.5 GiB on large models). 4 GiB; raise it for safety, lower it to squeeze.
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


def stage_costs(spec: TransformerSpec, hw: Hardware, layout: Layout) -> tuple[PieceCost, ...]:
    """One microbatch through each stage, in stage order (see the module docstring)."""
    counts = split_layers(spec.num_layers, layout.stages)
    last = len(counts) - 1
    shapes = [(n, s == 0, s == last) for s, n in enumerate(counts)]
    # Most stages have the same shape: price each shape once (a search prices ~10^3 layouts).
    priced = {shape: stage_cost(spec, hw, layout.run, layers=shape[0], embedding=shape[1],
                                head=shape[2]) for shape in set(shapes)}
    return tuple(priced[shape] for shape in shapes)


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
        p2p_time=p2p_s(spec, hw, layout.run,
                       cross_node=_cross_node(hw, layout.tp * layout.pp)),
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
    return [state_bytes(spec, n, memory.optimizer, dp=layout.dp)
            for n in rank_params(pieces, stage_to_rank)]


def dp_seconds(spec: TransformerSpec, hw: Hardware, pieces: tuple[PieceCost, ...],
               stage_to_rank: tuple[int, ...], layout: Layout, memory: MemoryConfig) -> float:
    """The DP gradient exchange of the rank with the most parameters, run after the pipeline
    drains (not overlapped with it: a conservative choice, Megatron overlaps part of it)."""
    if layout.dp == 1:
        return 0.0
    cross = _cross_node(hw, layout.gpus)
    return max(dp_s(dp_traffic(spec, n, memory.optimizer, dp=layout.dp), hw, cross_node=cross)
               for n in rank_params(pieces, stage_to_rank))


def step_model_flops(spec: TransformerSpec, sequences: int) -> float:
    """Model FLOPs of one training step over ``sequences`` sequences (FlopCount.MODEL: the
    math counted once, no recompute; the MFU convention)."""
    per_sequence = spec.num_layers * layer_flops(spec, 1, tp=1, count=FlopCount.MODEL).total \
        + head_flops(spec, 1, tp=1).total
    return per_sequence * sequences


def peak_flops(hw: Hardware) -> tuple[float, bool]:
    """The FLOP/s MFU divides by, and whether it is a datasheet peak (else the achievable rate
    of the preset, which gives higher MFU figures)."""
    if hw.name in DATASHEET_PEAK_FLOPS:
        return DATASHEET_PEAK_FLOPS[hw.name], True
    return hw.bf16_flops_per_s, False
