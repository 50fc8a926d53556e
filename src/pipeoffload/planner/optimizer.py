"""Model state and the step's work outside the pipeline: bytes per parameter of mixed-precision
Adam, the data-parallel gradient exchange, and the optimizer step.

Note [step outside the pipeline]: after the last microbatch's backward a rank reduces its
gradients over data parallelism and runs the optimizer step. The exchange runs at NCCL's achieved
bus bandwidth of the DP group's slowest hop (``dp_bytes_per_s``); it is added after the pipeline,
or, where the framework reduces gradients while the last backward runs (PyTorch DDP's buckets,
Megatron's overlapped gradient reduction; ``OptimizerSpec.overlap_grad_reduce``), only what sticks
out of that backward is. The optimizer step is memory-bound (a few bytes read and written per
parameter, no matmul): ``optimizer_step_bytes`` lists them for Megatron's mixed-precision
optimizer with apex's fused multi-tensor Adam, plus the copies the DP implementation makes
around its exchange (``DP_COPY_BYTES``; timed with the step, as they run on the same GPU).

Note [zero 3 terms]: ``pipeoffload train --zero 3`` wraps each stage with FSDP2's
``fully_shard`` (torch.distributed.fsdp; parallel/fsdp.py, runtime/sharding.py Note: [sharded
stages]). It is priced as ZeRO-1 (``sharded``), term by term, because that is what the trainer
runs at the step's peak:
- parameters: the Pipeline unshards a stage (an all-gather, in the compute dtype under FSDP's
  mixed-precision policy) before its first F and reshards it after its last B or W, so inside
  the step every stage of a rank is whole: ``param_bytes`` per parameter, as zero 1;
- gradients: accumulated whole in float32 (``accumulate_in_reduce_dtype``) until the stage's
  last backward, then reduce-scattered: ``grad_bytes`` (4) per parameter, as zero 1's fp32
  main grads;
- masters and AdamW moments: FSDP's float32 shards are the masters, and AdamW's moments
  follow them: (``master_bytes`` + ``state_bytes``) / dp, as zero 1 (Megatron's distributed
  optimizer, Rajbhandari et al. 2020 s5.1 P_os);
- traffic: one all-gather of the stage's parameters (``param_bytes``) and one reduce-scatter of
  its gradients (``grad_bytes``) per step over the dp group, (d-1)/d of each: zero 1's bytes
  (``dp_traffic``). Neither overlaps compute in train (the all-gather blocks the stage's first
  F; the reduce-scatter is waited for after its last backward), as zero 1 is priced for the
  ``current`` framework (after the pipeline);
- optimizer step: AdamW over the 1/dp shard, as zero 1 (``optimizer_step_bytes``).
So zero 3's predicted peak equals zero 1's; what it saves is between steps (parameters and
gradients at 1/dp), which no peak the planner prices sees. Where train would release a
stage's parameters between its last forward and its first backward (``reshard_after_forward``,
ZeRO-3 proper) the peak would be lower; train does not, so the planner does not count it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeoffload.errors import ConfigError
from pipeoffload.planner.comm_bytes import ring_collective_bytes
from pipeoffload.planner.hardware import Hardware
from pipeoffload.planner.transformer import TransformerSpec


@dataclass(frozen=True)
class OptimizerSpec:
    """Bytes per parameter of mixed-precision Adam (Megatron: 2 + 4 + 4 + 4 + 4 = 18), and how
    gradients reach it.

    ``grad_bytes``: the gradient buffer, which is also what DP reduces (4: fp32 main grads; 2:
    16-bit gradients, as PyTorch DDP over a 16-bit model and Megatron's fp16 runs of 2021 keep).
    ``master_bytes``: the fp32 copy of the weights. ``state_bytes``: Adam's two fp32 moments.
    ``sharded``: ZeRO-1 / Megatron's distributed optimizer splits master weights and moments
    over the data-parallel group. ``fsdp``: ``--zero 3`` (FSDP2 stages, Note [zero 3 terms]);
    it implies ``sharded`` and is priced as it, term by term. ``overlap_grad_reduce``: DP
    reduces gradients while the last microbatch's backward runs (Note [step outside the
    pipeline]); False: after the pipeline drains, as ``pipeoffload train`` does.
    ``dp_copy_bytes``: device-memory bytes per parameter per step that the data-parallel
    implementation moves around its exchange (``DP_COPY_BYTES``).
    """

    grad_bytes: int = 4
    master_bytes: int = 4
    state_bytes: int = 8
    sharded: bool = False
    overlap_grad_reduce: bool = False
    dp_copy_bytes: float = 0.0
    fsdp: bool = False

    def __post_init__(self) -> None:
        if self.fsdp and not self.sharded:
            raise ConfigError("OptimizerSpec.fsdp (--zero 3) shards the optimizer state too; "
                              "set sharded=True with it")
        value = self.dp_copy_bytes
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ConfigError(f"OptimizerSpec.dp_copy_bytes must be >= 0, got {value!r}")


@dataclass(frozen=True)
class StateBytes:
    """Model-state memory of one GPU: weights, gradients, optimizer (master copy + moments)."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def state_bytes(
    spec: TransformerSpec, params: float, optimizer: OptimizerSpec, *, dp: int = 1
) -> StateBytes:
    """Memory for ``params`` parameters on one GPU (Rajbhandari et al. 2020, ZeRO, s3.1)."""
    return StateBytes(
        params * spec.param_bytes,
        params * optimizer.grad_bytes,
        optimizer_bytes(params, optimizer, dp=dp),
    )


def optimizer_bytes(params: float, optimizer: OptimizerSpec, *, dp: int = 1) -> float:
    """Master weights and moments of ``params`` parameters on one GPU: 1/dp of them sharded."""
    if dp < 1:
        raise ConfigError(f"dp (data-parallel degree) must be >= 1, got {dp}")
    shards = dp if optimizer.sharded else 1
    return params * (optimizer.master_bytes + optimizer.state_bytes) / shards


@dataclass(frozen=True)
class DpTraffic:
    """Bytes one GPU sends per step for data parallelism: gradient reduction, and with a sharded
    optimizer the all-gather of the updated 16-bit weights."""

    grad_reduce: float
    param_gather: float

    @property
    def total(self) -> float:
        return self.grad_reduce + self.param_gather


def dp_traffic(
    spec: TransformerSpec, params: float, optimizer: OptimizerSpec, *, dp: int
) -> DpTraffic:
    """Ring all-reduce of the gradients, 2 (d-1)/d of their bytes; sharded: a reduce-scatter of
    the gradients plus an all-gather of the weights, (d-1)/d of each (Megatron's distributed
    optimizer)."""
    if dp < 1:
        raise ConfigError(f"dp (data-parallel degree) must be >= 1, got {dp}")
    grads = ring_collective_bytes(params, dp, optimizer.grad_bytes)
    if optimizer.sharded:
        return DpTraffic(grads, ring_collective_bytes(params, dp, spec.param_bytes))
    return DpTraffic(2 * grads, 0.0)


def dp_s(traffic: DpTraffic, hw: Hardware, *, cross_node: bool,
         gpus_per_node: int = 1) -> float:
    """Seconds of the data-parallel exchange of one step at NCCL's achieved bus bandwidth of
    the group's slowest hop (``dp_bytes_per_s``)."""
    return traffic.total / dp_bytes_per_s(hw, cross_node=cross_node, gpus_per_node=gpus_per_node)


def dp_bytes_per_s(hw: Hardware, *, cross_node: bool, gpus_per_node: int = 1) -> float:
    """Per-GPU bus bandwidth of a ring over a group with ``gpus_per_node`` of its members in each
    node: NVLink inside one node; across nodes the members of a node leave it through their own
    NICs (one per GPU in DGX designs) and NCCL spreads its rings over them, so the node-to-node
    hop carries ``gpus_per_node`` NICs' worth, at most NVLink's [derived from the ring
    algorithm: each ring crosses each node boundary once, with 1 / rings of the data]. With one
    member per node NCCL reaches a smaller share of the NIC (``Hardware.achieved_bytes_per_s``)."""
    intra = hw.achieved_bytes_per_s(cross_node=False)
    if not cross_node:
        return intra
    per_node = max(1, gpus_per_node)
    nic = hw.achieved_bytes_per_s(cross_node=True, one_gpu_per_node=per_node == 1)
    return min(intra, per_node * nic)


#: Bytes per parameter of Megatron's mixed-precision optimizer step with apex's multi-tensor
#: kernels (megatron/optimizer/optimizer.py, Float16OptimizerWithFloat16Params.step): unscale and
#: check the fp32 gradients for inf (read + write 4 + 4), their norm for clipping (read 4), Adam
#: (read weight, gradient and two moments, write weight and moments: 7 x 4), the copy of the
#: fp32 weights to the 16-bit model (4 + 2); 16-bit gradients are first copied to fp32 (2 + 4).
#: Zeroing the gradient buffer writes it once (``grad_bytes``).
UNSCALE_BYTES, NORM_BYTES, ADAM_BYTES, COPY_BACK_BYTES, TO_FP32_BYTES = 8, 4, 28, 6, 6

#: Bytes per parameter per step the data-parallel implementations copy around the exchange
#: (``OptimizerSpec.dp_copy_bytes``), from their code:
#: - PyTorch DDP without ``gradient_as_bucket_view`` (its default): each 16-bit gradient is
#:   copied into its bucket (dividing by the group size as it copies) and back out after the
#:   all-reduce, 2 x (2 + 2) (PyTorch's DistributedDataParallel documentation: bucket views
#:   avoid "the overhead of copying between gradients and allreduce communication buckets");
#: - Megatron-LM 2021's local DDP without contiguous buffers (``allreduce_gradients``):
#:   flatten the 16-bit gradients, divide in place, copy each back, 3 x (2 + 2);
#: - Megatron-LM 2022's local DDP with contiguous fp32 buffers: divide the buffer in place,
#:   4 + 4, also at data parallelism 1 (``train_step`` calls it whatever the group's size).
DP_COPY_BYTES = {"torch-ddp-fp16": 8.0, "megatron-local-2021": 12.0,
                 "megatron-local-2022": 8.0}


def optimizer_step_bytes(params: float, optimizer: OptimizerSpec, *, dp: int = 1) -> float:
    """Device-memory bytes the optimizer step of one GPU holding ``params`` parameters moves
    (a sharded optimizer updates 1 / dp of them)."""
    if dp < 1:
        raise ConfigError(f"dp (data-parallel degree) must be >= 1, got {dp}")
    updated = params / (dp if optimizer.sharded else 1)
    to_fp32 = TO_FP32_BYTES if optimizer.grad_bytes < 4 else 0
    per_update = to_fp32 + UNSCALE_BYTES + NORM_BYTES + ADAM_BYTES + COPY_BACK_BYTES
    return updated * per_update + params * (optimizer.grad_bytes + optimizer.dp_copy_bytes)


def optimizer_step_s(params: float, optimizer: OptimizerSpec, hw: Hardware, *,
                     dp: int = 1) -> float:
    """Seconds of one GPU's optimizer step (0 when the preset does not time memory-bound
    work)."""
    return hw.memory_s(optimizer_step_bytes(params, optimizer, dp=dp))
