"""The B/W split: an input-gradient backward (I) and a weight-gradient backward (W) that together
do the work of one plain backward, without recomputing the input-gradient path.

Note: [B/W split]
Call N_in the autograd nodes from which a stage input is reachable: I runs exactly those (via
``torch.autograd.grad(..., inputs=<stage inputs>)``), and the engine asks each of them only for
the gradients on edges that lead to an input, so a Linear's node computes dX but not dW.
A "boundary" node is a node of N_in with an edge to a node outside N_in that leads to a
parameter (the AddmmBackward of a Linear: its weight edge leads to the weight's accumulator).
During I a pre-hook captures each boundary node's incoming gradients. W then runs, for each
boundary node u, ``torch.autograd.backward`` from (u, captured gradients) with ``inputs`` = the
parameters reachable from u without passing through N_in (autograd accumulates into their
``.grad``): the engine runs u again for those edges only (dW) and the weight-only nodes below
it, never another node of N_in, since none of them leads to those parameters. Outputs whose
node is outside N_in are roots of W with their output gradients. A stage with no input
gradient at all (a first stage) needs no analysis: its I does nothing and its W is one plain
backward from the outputs.
This is exact when no parameter is reachable from two boundary nodes (a parameter used on two
input-gradient paths, e.g. a module applied twice or tied weights inside one stage): W would then
count a contribution twice. Such a stage falls back to a full backward in I and an empty W, which
is still correct and costs the same total FLOPs; ``SplitPlan.fallback`` says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.autograd.graph import GradientEdge, Node


@dataclass(frozen=True)
class SplitPlan:
    """For one (stage, microbatch): which nodes feed W, and with which parameters."""

    boundary: tuple[tuple[Node, tuple[int, ...]], ...]  # (node, indices of its params)
    roots: tuple[tuple[int, tuple[int, ...]], ...]  # (output index, indices of its params)
    fallback: bool


def plan_split(
    outputs: Sequence[GradientEdge],
    input_nodes: Sequence[Node],
    params: Sequence[torch.Tensor],
) -> SplitPlan:
    """Analyse the graph below ``outputs``; see Note: [B/W split].

    Runs once per I on graphs of hundreds of nodes, so it walks each node once, finds parameter
    accumulators by their type (no per-parameter graph lookups) and keeps parameter sets as
    bit masks.
    """
    index_of = {id(p): i for i, p in enumerate(params)}
    order, children = _post_order([edge.node for edge in outputs])
    inputs = set(input_nodes)
    reaches_input: dict[Node, bool] = {}
    below: dict[Node, int] = {}  # bit mask of params reachable through nodes outside N_in
    boundary = []
    for node in order:  # children come first, so their entries exist
        reaches = node in inputs
        group = 0
        for child in children[node]:
            if reaches_input[child]:
                reaches = True
            else:
                group |= below[child]
        reaches_input[node] = reaches
        if type(node) is _ACCUMULATE_GRAD:
            index = index_of.get(id(cast(Any, node).variable))  # AccumulateGrad's leaf
            below[node] = 0 if index is None else 1 << index
        else:
            below[node] = group
        if reaches and group and node not in inputs:
            boundary.append((node, _indices(group)))
    roots = []
    for index, edge in enumerate(outputs):
        if not reaches_input[edge.node] and below[edge.node]:
            roots.append((index, _indices(below[edge.node])))
    seen = 0
    fallback = False
    for _, indices in [*boundary, *roots]:
        mask = sum(1 << i for i in indices)
        if seen & mask:
            fallback = True
        seen |= mask
    return SplitPlan(tuple(boundary), tuple(roots), fallback)


# The node type of a leaf's gradient sink; torch's stubs do not declare it.
_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]


def _indices(mask: int) -> tuple[int, ...]:
    """The set bits of ``mask``, in increasing order."""
    return tuple(i for i in range(mask.bit_length()) if mask >> i & 1)


def _post_order(roots: Sequence[Node]) -> tuple[list[Node], dict[Node, list[Node]]]:
    """Every node below ``roots``, children before parents (iterative: graphs can be deep), and
    each node's children."""
    order: list[Node] = []
    children: dict[Node, list[Node]] = {}
    for root in roots:
        if root in children:
            continue
        children[root] = [c for c, _ in root.next_functions if c is not None]
        stack = [(root, iter(children[root]))]
        while stack:
            node, pending = stack[-1]
            child = next(pending, None)
            if child is None:
                stack.pop()
                order.append(node)
            elif child not in children:
                children[child] = [c for c, _ in child.next_functions if c is not None]
                stack.append((child, iter(children[child])))
    return order, children


class WeightGradState:
    """What I leaves for W: captured gradients at boundary nodes and the output gradients.

    ``plan`` None: the stage has no input gradient to compute (a first stage), so I did nothing
    and W runs the whole backward from the outputs, with no split analysis.
    """

    def __init__(self, plan: SplitPlan | None, output_grads: Sequence[torch.Tensor | None]) -> None:
        self.plan = plan
        self.output_grads = list(output_grads)
        # Filled by pre-hooks; holds only tensors, never nodes, so no reference cycle forms.
        self.captured: list[tuple[torch.Tensor | None, ...] | None] = (
            [None] * len(plan.boundary) if plan is not None else [])


def input_backward(
    outputs: Sequence[GradientEdge],
    output_grads: Sequence[torch.Tensor],
    input_edges: Sequence[GradientEdge],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightGradState | None]:
    """I: gradients of the stage inputs, and what W needs (None when I already did it all)."""
    if not input_edges:
        return [], WeightGradState(None, output_grads)
    plan = plan_split(outputs, [e.node for e in input_edges], params)
    if plan.fallback:
        return full_backward(outputs, output_grads, input_edges), None
    state = WeightGradState(plan, output_grads)
    handles = []
    for index, (node, _) in enumerate(plan.boundary):
        def capture(grads: tuple[torch.Tensor | None, ...], index: int = index) -> None:
            state.captured[index] = tuple(grads)

        handles.append(node.register_prehook(capture))
    try:
        grads = torch.autograd.grad(
            list(outputs), list(input_edges), grad_outputs=list(output_grads),
            retain_graph=True, allow_unused=True,
        )
    finally:
        for handle in handles:
            handle.remove()
    return list(grads), state


def weight_backward(
    state: WeightGradState,
    outputs: Sequence[GradientEdge],
    params: Sequence[torch.Tensor],
) -> None:
    """W: accumulate parameter gradients from what I captured (see Note: [B/W split])."""
    if state.plan is None:
        roots = [(e, g) for e, g in zip(outputs, state.output_grads) if g is not None]
        if roots:
            plain_backward([e for e, _ in roots], [g for _, g in roots])
        return
    starts: list[tuple[list[GradientEdge], list[torch.Tensor], tuple[int, ...]]] = []
    for (node, group), grads in zip(state.plan.boundary, state.captured):
        if grads is None:
            continue  # the engine never reached this node: no gradient flows through it
        edges = [GradientEdge(node, i) for i, g in enumerate(grads) if g is not None]
        values = [g for g in grads if g is not None]
        if edges:
            starts.append((edges, values, group))
    for index, group in state.plan.roots:
        grad = state.output_grads[index]
        if grad is not None:
            starts.append(([outputs[index]], [grad], group))
    for edges, values, group in starts:
        _accumulate_from(edges, values, [params[i] for i in group])


def _accumulate_from(edges: Sequence[GradientEdge], grads: Sequence[torch.Tensor],
                     params: Sequence[torch.Tensor]) -> None:
    """Backward from ``edges`` into ``params``' ``.grad``, accumulated by autograd's own
    AccumulateGrad (what ``loss.backward()`` does: the first gradient is taken without a copy
    when nothing else holds it, later ones are added in place), with no Python loop."""
    torch.autograd.backward(list(edges), grad_tensors=list(grads), inputs=list(params),
                            retain_graph=False)


def plain_backward(outputs: Sequence[GradientEdge], output_grads: Sequence[torch.Tensor]) -> None:
    """B's engine call: one plain ``autograd.backward`` from the outputs, as ``loss.backward()``
    runs it; every leaf below them that requires a gradient (the stage's parameters) has it
    accumulated by autograd's AccumulateGrad, and the graph is freed as it goes. Naming inputs
    instead (``autograd.grad`` or ``inputs=``) makes the engine first mark the nodes they need,
    which costs 10-15 % of a small stage's B (benchmarks/stage_backward.py)."""
    torch.autograd.backward(list(outputs), grad_tensors=list(output_grads))


def full_backward(
    outputs: Sequence[GradientEdge],
    output_grads: Sequence[torch.Tensor],
    input_edges: Sequence[GradientEdge],
) -> list[torch.Tensor | None]:
    """B for any input edges: ``plain_backward``, with the input gradients read by a pre-hook on
    each input edge's node (the gradient ``autograd.grad`` would return for that edge). The
    stage runner's own inputs report theirs more cheaply (runtime/stage.py, _StageInput)."""
    received: list[torch.Tensor | None] = [None] * len(input_edges)
    handles = []
    for index, edge in enumerate(input_edges):
        def capture(grads: tuple[torch.Tensor | None, ...], index: int = index,
                    slot: int = edge.output_nr) -> None:
            received[index] = grads[slot]

        handles.append(edge.node.register_prehook(capture))
    try:
        plain_backward(outputs, output_grads)
    finally:
        for handle in handles:
            handle.remove()
    return received
