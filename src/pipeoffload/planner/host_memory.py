"""Pinned host memory that activation offload needs, per GPU and per node.

The runtime copies offloaded activations into pinned host buffers from a pool that reuses a
buffer once its copy back has completed (runtime/pool.py), so a rank needs, at most, the peak
of the activations it holds in host memory at one time. An offloaded (stage, microbatch) is held
from the start of its OFFLOAD (the buffer is taken when the copy starts) to the end of its
RELOAD, or, fetched on use, to the end of its last backward pass. Read off the simulated
timeline with the same byte sizes as the device memory (``CostModel.stage_activation_bytes``).
A node's need is the sum over its GPUs, in the planner's rank order (TP fastest, then PP,
then DP: costing.py, Note [rank order]); every TP rank holds its own shard of a stage.
"""

from __future__ import annotations

import math

from pipeoffload.core.actions import Kind
from pipeoffload.sim.simulator import SimResult


def host_peak_bytes(result: SimResult) -> tuple[float, ...]:
    """Per rank, the peak bytes of activations held in host memory."""
    sizes = result.costs.stage_activation_bytes
    default = result.costs.activation_bytes or 0.0
    peaks = []
    for timeline in result.timeline:
        held: dict[tuple[int, int], float] = {}  # (stage, microbatch) -> start
        released: dict[tuple[int, int], float] = {}
        fetched: set[tuple[int, int]] = set()
        for timed in timeline:
            stage, kind, mb = timed.action
            key = (stage, mb)
            if kind is Kind.OFFLOAD:
                held[key] = timed.start
            elif kind is Kind.RELOAD:
                released[key] = timed.end
            elif kind is Kind.FETCH:
                fetched.add(key)
            elif key in fetched and kind in (Kind.I, Kind.W, Kind.B):
                released[key] = max(released.get(key, timed.end), timed.end)
        events = []
        for key, start in held.items():
            size = sizes[key[0]] if key[0] < len(sizes) else default
            events.append((start, 1, size))
            events.append((released.get(key, start), 0, -size))
        level = peak = 0.0
        for _, _, delta in sorted(events):  # at a tie, frees (0) before allocations (1)
            level += delta
            peak = max(peak, level)
        peaks.append(peak)
    return tuple(peaks)


def node_host_bytes(per_rank: list[float] | tuple[float, ...], tp: int, pp: int,
                    gpus_per_node: int) -> float:
    """The fullest node's pinned host bytes, given each pipeline rank's peak per GPU: node n
    holds GPUs [n g, (n + 1) g), GPU i of pipeline rank (i // tp) % pp; data-parallel replicas
    repeat the pattern every lcm(tp pp, g) GPUs."""
    patterns = math.lcm(tp * pp, gpus_per_node) // gpus_per_node  # nodes before they repeat
    return max(sum(per_rank[(gpu // tp) % pp]
                   for gpu in range(node * gpus_per_node, (node + 1) * gpus_per_node))
               for node in range(patterns))
