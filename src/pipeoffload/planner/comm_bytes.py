"""Bytes that tensor, pipeline and data parallelism send: ring collectives (Thakur et al. 2005),
tensor + sequence parallelism's per-layer collectives (Korthikanti et al. 2022, section 4.2.2) and
the pipeline's boundary activation. Which of them cost time is layer_time.py's question."""

from __future__ import annotations

from dataclasses import dataclass

from pipeoffload.planner.transformer import TransformerSpec, check_run


def ring_collective_bytes(elements: float, group: int, bytes_per_element: int) -> float:
    """Bytes one GPU sends in a ring all-gather or reduce-scatter of a tensor of ``elements``
    over ``group`` GPUs: (group - 1) / group of it (Thakur et al. 2005, ring algorithms)."""
    return (group - 1) / group * elements * bytes_per_element


@dataclass(frozen=True)
class CommBytes:
    """Bytes one GPU sends for tensor-parallel collectives in the forward and in the backward."""

    forward: float
    backward: float

    def __add__(self, other: CommBytes) -> CommBytes:
        return CommBytes(self.forward + other.forward, self.backward + other.backward)


def layer_tp_comm_bytes(spec: TransformerSpec, micro_batch: int, *, tp: int,
                        sequence_parallel: bool = True) -> CommBytes:
    """Tensor + sequence parallelism (Korthikanti et al. 2022 s4.2.2): per layer, two all-gathers
    and two reduce-scatters of b s h elements in F; in the backward their four conjugates plus
    Megatron's re-gather of the two column-parallel inputs for the weight gradients (six; which
    of them overlap is layer_time.py's Note [exposed TP communication]). Without sequence
    parallelism (Shoeybi et al. 2019): two all-reduces in F and two in the backward, each an
    all-gather's and a reduce-scatter's bytes (four and four)."""
    check_run(micro_batch, tp)
    bsh = micro_batch * spec.seq_len * spec.hidden
    one = ring_collective_bytes(bsh, tp, spec.activation_bytes)
    return CommBytes(4 * one, (6 if sequence_parallel else 4) * one)


def end_tp_comm_bytes(spec: TransformerSpec, micro_batch: int, *, tp: int) -> CommBytes:
    """The embedding: a reduce-scatter of its output in F, an all-gather of its gradient in B."""
    check_run(micro_batch, tp)
    bsh = micro_batch * spec.seq_len * spec.hidden
    one = ring_collective_bytes(bsh, tp, spec.activation_bytes)
    return CommBytes(one, one)


def head_tp_comm_bytes(spec: TransformerSpec, micro_batch: int, *, tp: int) -> CommBytes:
    """The head (column-parallel): an all-gather of its input in F; in B the input's re-gather
    for the weight gradient and the reduce-scatter of the input gradient."""
    one = end_tp_comm_bytes(spec, micro_batch, tp=tp).forward
    return CommBytes(one, 2 * one)


def p2p_bytes(spec: TransformerSpec, micro_batch: int, *, tp: int = 1) -> float:
    """Bytes one GPU sends to the next pipeline stage per microbatch (and the same gradient back):
    the b s h boundary activation, split over tp by sequence parallelism."""
    check_run(micro_batch, tp)
    return micro_batch * spec.seq_len * spec.hidden * spec.activation_bytes / tp

