"""Seconds from the analytic model and a hardware preset, per-GPU model state, and the ratio k.

k = (D2H + H2D time of a layer's saved activations) / (F + I + W time of that layer)
(PipeOffload, Wan et al. 2025, section 2; docs/method.md section 2): at k <= 1 every activation
can be offloaded with (almost) no slowdown. ``offload_ratio`` computes it from the per-layer FLOPs
and bytes of ``transformer``; ``paper_k`` is the paper's closed form for a GPT layer. Run
``python -m pipeoffload.planner.ratio`` for the table in docs/planner-model.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeoffload.errors import ConfigError
from pipeoffload.planner.comm_bytes import (
    CommBytes,
    end_tp_comm_bytes,
    head_tp_comm_bytes,
    layer_tp_comm_bytes,
    p2p_bytes,
)
from pipeoffload.planner.context import context_spec, gathered_kv_bytes
from pipeoffload.planner.hardware import Hardware, hardware_preset
from pipeoffload.planner.layer_time import (
    PassSeconds,
    RunConfig,
    embedding_seconds,
    head_seconds,
    layer_seconds,
)
from pipeoffload.planner.transformer import (
    FlopCount,
    MlpKind,
    ParamCount,
    PassFlops,
    Recompute,
    TransformerSpec,
    embedding_activation_bytes,
    embedding_flops,
    embedding_params,
    head_activation_bytes,
    head_flops,
    head_params,
    layer_activation_bytes,
    layer_flops,
    layer_params,
    recompute_flops,
)

#: The default per-GPU run (microbatch 1, no TP, LGD recompute, sequence parallelism).
DEFAULT_RUN = RunConfig()


@dataclass(frozen=True)
class PieceCost:
    """One microbatch through a piece of the model (layers, embedding, head) on one GPU.

    ``f_s`` = F compute + exposed forward TP collectives; ``i_s`` = I compute + recomputed
    forward + exposed backward TP collectives; ``w_s`` = W compute + what the input gradient's
    reduce-scatter leaves exposed (layer_time.py, Note [exposed TP communication]). ``flops``,
    ``recompute_flops`` and ``tp_comm`` (bytes sent, hidden or not) are the inputs.
    """

    flops: PassFlops
    recompute_flops: float
    tp_comm: CommBytes
    f_s: float
    i_s: float
    w_s: float
    activation_bytes: float
    params: ParamCount

    @property
    def chunk_s(self) -> float:
        """F + I + W seconds."""
        return self.f_s + self.i_s + self.w_s

    def __add__(self, other: PieceCost) -> PieceCost:
        return PieceCost(
            self.flops + other.flops,
            self.recompute_flops + other.recompute_flops,
            self.tp_comm + other.tp_comm,
            self.f_s + other.f_s,
            self.i_s + other.i_s,
            self.w_s + other.w_s,
            self.activation_bytes + other.activation_bytes,
            self.params + other.params,
        )

    def times(self, n: int) -> PieceCost:
        """``n`` copies of this piece in a row (``n`` identical layers)."""
        return PieceCost(
            self.flops.scaled(n),
            self.recompute_flops * n,
            CommBytes(self.tp_comm.forward * n, self.tp_comm.backward * n),
            self.f_s * n,
            self.i_s * n,
            self.w_s * n,
            self.activation_bytes * n,
            ParamCount(self.params.sharded * n, self.params.replicated * n),
        )


def _piece(
    seconds: PassSeconds,
    flops: PassFlops,
    recomputed: float,
    comm: CommBytes,
    activation_bytes: float,
    params: ParamCount,
) -> PieceCost:
    return PieceCost(
        flops=flops,
        recompute_flops=recomputed,
        tp_comm=comm,
        f_s=seconds.f_s,
        i_s=seconds.i_s,
        w_s=seconds.w_s,
        activation_bytes=activation_bytes,
        params=params,
    )


def layer_cost(spec: TransformerSpec, hw: Hardware, run: RunConfig = DEFAULT_RUN) -> PieceCost:
    """One transformer layer: matmuls by shape, exposed TP collectives (layer_time.py, Note
    [exposed TP communication]). Under full recompute (HARDWARE count) the backward also re-runs
    the forward and its collectives."""
    b, tp, sp, cp = run.micro_batch, run.tp, run.sequence_parallel, run.cp
    local = context_spec(spec, cp)  # one CP rank's tokens (context.py)
    # FLOPs scale with the tokens and the balanced causal square alike: 1/cp of the whole
    recomputed = recompute_flops(spec, b, run.recompute, tp=tp, count=run.flop_count) / cp
    comm = layer_tp_comm_bytes(local, b, tp=tp, sequence_parallel=sp)
    if run.recompute is Recompute.FULL and run.flop_count is FlopCount.HARDWARE:
        comm = CommBytes(comm.forward, comm.backward + comm.forward)
    return _piece(
        layer_seconds(spec, hw, run),
        layer_flops(spec, b, tp=tp, count=run.flop_count).scaled(1 / cp),
        recomputed,
        comm,
        layer_activation_bytes(local, b, run.recompute, tp=tp, sequence_parallel=sp)
        + gathered_kv_bytes(local, b, tp, cp, run.recompute),
        layer_params(spec, tp=tp),
    )


def embedding_cost(spec: TransformerSpec, hw: Hardware, run: RunConfig = DEFAULT_RUN) -> PieceCost:
    """The input embedding (no matmul FLOPs: its time is its TP collectives only)."""
    b, tp = run.micro_batch, run.tp
    seconds, spec = embedding_seconds(spec, hw, run), context_spec(spec, run.cp)
    return _piece(
        seconds,
        embedding_flops(spec, b, tp=tp),
        0.0,
        end_tp_comm_bytes(spec, b, tp=tp),
        embedding_activation_bytes(spec, b, tp=tp, sequence_parallel=run.sequence_parallel),
        embedding_params(spec, tp=tp),
    )


def head_cost(spec: TransformerSpec, hw: Hardware, run: RunConfig = DEFAULT_RUN) -> PieceCost:
    """Final norm, output projection and loss."""
    b, tp = run.micro_batch, run.tp
    seconds, spec = head_seconds(spec, hw, run), context_spec(spec, run.cp)
    return _piece(
        seconds,
        head_flops(spec, b, tp=tp),
        0.0,
        head_tp_comm_bytes(spec, b, tp=tp),
        head_activation_bytes(spec, b, run.recompute, tp=tp,
                              sequence_parallel=run.sequence_parallel),
        head_params(spec, tp=tp),
    )


def stage_cost(
    spec: TransformerSpec,
    hw: Hardware,
    run: RunConfig = DEFAULT_RUN,
    *,
    layers: int,
    embedding: bool = False,
    head: bool = False,
) -> PieceCost:
    """A pipeline stage of ``layers`` transformer layers, with the embedding in front and/or the
    head behind it. ``layers`` may be 0 for a stage that holds only the embedding or the head."""
    if layers < 0 or (layers == 0 and not (embedding or head)):
        raise ConfigError(
            f"a stage needs at least one layer, the embedding or the head; got layers={layers}"
        )
    cost = layer_cost(spec, hw, run).times(layers)
    if embedding:
        cost = embedding_cost(spec, hw, run) + cost
    if head:
        cost = cost + head_cost(spec, hw, run)
    return cost


def p2p_s(
    spec: TransformerSpec, hw: Hardware, run: RunConfig = DEFAULT_RUN, *, cross_node: bool
) -> float:
    """Seconds to send one microbatch's boundary activation (or its gradient) to the next stage
    (across nodes, one GPU of each node talks to one of the other)."""
    link = hw.achieved_bytes_per_s(cross_node=cross_node, one_gpu_per_node=True)
    return p2p_bytes(context_spec(spec, run.cp), run.micro_batch, tp=run.tp) / link


@dataclass(frozen=True)
class OffloadRatio:
    """The ratio k of one layer and the numbers that produced it (seconds, bytes per layer)."""

    model: str
    hardware: str
    run: RunConfig
    saved_bytes: float
    d2h_s: float
    h2d_s: float
    f_s: float
    i_s: float
    w_s: float

    @property
    def k(self) -> float:
        return (self.d2h_s + self.h2d_s) / (self.f_s + self.i_s + self.w_s)

    def __str__(self) -> str:
        ms = 1e3
        return (
            f"k = {self.k:.3f} for {self.model} on {self.hardware} "
            f"(b={self.run.micro_batch}, tp={self.run.tp}, recompute={self.run.recompute.value}, "
            f"{self.run.flop_count.value} FLOPs): {self.saved_bytes / 2**20:.1f} MiB saved per "
            f"layer, D2H {self.d2h_s * ms:.3f} ms + H2D {self.h2d_s * ms:.3f} ms over "
            f"F {self.f_s * ms:.3f} + I {self.i_s * ms:.3f} + W {self.w_s * ms:.3f} ms"
        )


def offload_ratio(
    spec: TransformerSpec, hw: Hardware, run: RunConfig = DEFAULT_RUN
) -> OffloadRatio:
    """k of one transformer layer of ``spec`` on ``hw``: the round trip of its saved activations
    over the host link against its F + I + W time (TP collectives included). Host-link sharing
    between GPUs is left to the simulator (``Hardware.host_link``)."""
    cost = layer_cost(spec, hw, run)
    return OffloadRatio(
        model=spec.name,
        hardware=hw.name,
        run=run,
        saved_bytes=cost.activation_bytes,
        d2h_s=hw.d2h_s(cost.activation_bytes),
        h2d_s=hw.h2d_s(cost.activation_bytes),
        f_s=cost.f_s,
        i_s=cost.i_s,
        w_s=cost.w_s,
    )


def paper_k(hidden: int, seq_len: int, flops_per_s: float, host_bytes_per_s: float) -> float:
    """The paper's closed form for a GPT layer: 20 b s h bytes each way over 12 b s h (6h + s)
    FLOPs gives k = 10 / (3 (6h + s)) * FLOP/s / (bytes/s)."""
    return 10 / (3 * (6 * hidden + seq_len)) * flops_per_s / host_bytes_per_s


#: Head width of the GPT layers the paper's k assumes (GPT-3 and Llama use 128).
PAPER_HEAD_DIM = 128


def paper_layer(hidden: int, seq_len: int) -> tuple[TransformerSpec, RunConfig]:
    """A layer under the paper's k assumptions: GPT (multi-head attention, GeLU, f = 4h),
    flash attention, 16-bit, LGD recompute, the model FLOP count 12 b s h (6h + s)."""
    heads = max(1, hidden // PAPER_HEAD_DIM)
    spec = TransformerSpec(
        num_layers=1, hidden=hidden, heads=heads, kv_heads=heads, ffn_hidden=4 * hidden,
        vocab=1, seq_len=seq_len, mlp=MlpKind.GELU, flash_attention=True, activation_bytes=2,
        param_bytes=2, dropout=True, name=f"gpt-h{hidden}-s{seq_len}",
    )
    return spec, RunConfig(micro_batch=1, tp=1, recompute=Recompute.LGD,
                           flop_count=FlopCount.MODEL)


#: The PipeOffload authors' whole-layer rate for an A100 (docs/method.md section 2).
PAPER_A100_FLOPS_PER_S = 220e12


def paper_hardware() -> Hardware:
    """An A100 under the paper's assumptions: every FLOP at the authors' whole-layer 220
    TFLOP/s, memory-bound work not timed, one rate for every matmul shape and size; its 15 GB/s
    host link."""
    return dataclasses.replace(
        hardware_preset("a100-80gb"), name="a100-80gb (paper's k)",
        bf16_flops_per_s=PAPER_A100_FLOPS_PER_S, peak_flops_per_s=0.0, hbm_bytes_per_s=0.0,
        attention_flops_per_s=0.0, kernel_launch_s=0.0, gemm_ridge_flops_per_byte=0.0,
        sm_count=0)


def k_table(
    hw: Hardware, hiddens: tuple[int, ...], seq_lens: tuple[int, ...]
) -> list[tuple[int, int, float, float]]:
    """Rows (hidden, seq_len, general k, closed-form k) under the paper's assumptions."""
    rows = []
    for hidden in hiddens:
        for seq_len in seq_lens:
            spec, run = paper_layer(hidden, seq_len)
            general = offload_ratio(spec, hw, run).k
            closed = paper_k(hidden, seq_len, hw.bf16_flops_per_s, hw.d2h_bytes_per_s)
            rows.append((hidden, seq_len, general, closed))
    return rows


def _main() -> None:
    hw = paper_hardware()
    print(f"k on {hw.name} ({hw.bf16_flops_per_s / 1e12:.0f} TFLOP/s, "
          f"{hw.d2h_bytes_per_s / 1e9:.0f} GB/s), LGD recompute, flash attention, 16-bit")
    print("| h | s | k (per-layer model) | k (closed form) |")
    print("|---|---|---|---|")
    for hidden, seq_len, general, closed in k_table(
        hw, (4096, 8192, 16384), (4096, 8192, 16384, 32768)
    ):
        print(f"| {hidden} | {seq_len} | {general:.3f} | {closed:.3f} |")


if __name__ == "__main__":
    _main()
