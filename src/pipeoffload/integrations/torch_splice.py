"""Our schedule's actions in torch's terms: compute actions for torch's lowering, and our
transfer actions spliced back into what torch lowered (Note: [torch splice]).

Private torch API used: ``_Action`` and the computation types of torch's schedules module (the
version pin is the adapter's, integrations/torch_versions.py).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from enum import Enum
from typing import Any, cast

from torch.distributed.pipelining.schedules import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    RECV_F,
    RESHARD,
    SEND_F,
    UNSHARD,
    _Action,
)

from pipeoffload.core.actions import Action, Kind


class TransferKind(str, Enum):
    """The computation types this schedule adds to torch's (text form as ours: ``0OFFLOAD3``)."""

    OFFLOAD = "OFFLOAD"
    RELOAD = "RELOAD"
    FETCH = "FETCH"
    OFFLOAD_WAIT = "OFFLOAD_WAIT"
    SCOPE_BEGIN = "SCOPE_BEGIN"  # hidden: open the offloader's saved-tensor scope before F
    SCOPE_END = "SCOPE_END"  # hidden: close it after F (which includes the loss on the last stage)
    BACKWARD_READY = "BACKWARD_READY"  # hidden: before I / B, wait for the RELOAD copy
    FREE = "FREE"  # hidden: after the last backward pass (W, or B), drop the host copies
    UNSHARD_AGAIN = "UNSHARD_AGAIN"  # hidden: before I / W on an FSDP stage (Note: [split FSDP])


TO_TORCH = {Kind.F: FORWARD, Kind.I: BACKWARD_INPUT, Kind.W: BACKWARD_WEIGHT,
            Kind.B: FULL_BACKWARD}
_TRANSFER = {Kind.OFFLOAD: TransferKind.OFFLOAD, Kind.RELOAD: TransferKind.RELOAD,
             Kind.FETCH: TransferKind.FETCH, Kind.OFFLOAD_WAIT: TransferKind.OFFLOAD_WAIT}


def _ours(stage: int, kind: TransferKind, microbatch: int) -> _Action:
    """One of our transfer actions as a torch ``_Action``: torch's runtime finds an action's
    function by looking its computation type up in a dict (where we register ours), so our
    kinds ride in torch's action type, which declares its own enum only."""
    return _Action(stage, cast(Any, kind), microbatch)


def compute_row(row: Sequence[Action], overlapped: Collection[Action] = ()) -> list[Any]:
    """One rank's compute actions as torch's ``_Action``s; a forward in ``overlapped`` and the
    backward after it become one ``OVERLAP_F_B`` action with the two as its sub-actions, as
    torch's ScheduleDualPipeV writes DeepSeek's overlapped pairs."""
    compute = [a for a in row if a.kind in TO_TORCH]
    out: list[Any] = []
    k = 0
    while k < len(compute):
        action = compute[k]
        ours = _Action(action.stage, TO_TORCH[action.kind], action.microbatch)
        if action in overlapped and k + 1 < len(compute) and compute[k + 1].kind is Kind.B:
            after = compute[k + 1]
            pair = (ours, _Action(after.stage, FULL_BACKWARD, after.microbatch))
            out.append(_Action(-1, OVERLAP_F_B, None, pair))
            k += 2
            continue
        out.append(ours)
        k += 1
    return out


def splice(row: Sequence[Action], lowered: list[Any], fsdp_stages: set[int]) -> list[Any]:
    """``lowered`` (torch's compute, comm and FSDP actions for one rank) with our transfer
    actions put back.

    Note: [torch splice] each transfer action goes right after the compute action it followed
    in ``row`` (before any, at the head). Around an offloaded (stage, microbatch) we add hidden
    actions: SCOPE_BEGIN / SCOPE_END around its F (the saved-tensor scope covers the stage's
    forward and the loss torch computes inside F), BACKWARD_READY before its I / B, and FREE
    after its last backward pass (W after I, or B). Before each I and W of a stage in
    ``fsdp_stages`` goes an UNSHARD_AGAIN (Note: [split FSDP]). An ``OVERLAP_F_B`` runs its F
    and B as one action (a callback registered for it runs both), so what goes before either of
    them goes before the pair, and so do the transfers between them other than the F's own (the
    B's RELOAD); what goes after either goes after it: an offloaded F's scope stays open while
    the pair's B runs. Autograd saves nothing during a backward pass, except a
    stage that recomputes there (reentrant activation checkpointing): what that saves would be
    held with the F's activation until the F's own backward.
    """
    offloaded = {(a.stage, a.microbatch) for a in row if a.kind is Kind.OFFLOAD}
    last_backward = {(a.stage, a.microbatch): TO_TORCH[a.kind] for a in row
                     if a.kind in (Kind.B, Kind.W)}
    after: dict[tuple[int, Any, int], list[Any]] = {}
    head: list[Any] = []
    anchor: tuple[int, Any, int] | None = None
    for action in row:
        if action.kind in TO_TORCH:
            anchor = (action.stage, TO_TORCH[action.kind], action.microbatch)
        elif action.kind in _TRANSFER:
            moved = _ours(action.stage, _TRANSFER[action.kind], action.microbatch)
            (head if anchor is None else after.setdefault(anchor, [])).append(moved)
    out = list(head)
    for t in lowered:
        subs = t.sub_actions if t.computation_type == OVERLAP_F_B else (t,)
        if len(subs) > 1:
            # What ran between the pair's F and B (the B's RELOAD) goes before the pair; only
            # the F's own transfers (its OFFLOAD) must wait for it.
            f = subs[0]
            between = after.pop((f.stage_index, f.computation_type, f.microbatch_index), [])
            own = [a for a in between if (a.stage_index, a.microbatch_index)
                   == (f.stage_index, f.microbatch_index)]
            out.extend(a for a in between if a not in own)
            if own:
                after[f.stage_index, f.computation_type, f.microbatch_index] = own
        closing: list[Any] = []
        for sub in subs:
            key = (sub.stage_index, sub.microbatch_index)
            kind = sub.computation_type
            hit = key in offloaded
            if hit and kind == FORWARD:
                out.append(_ours(key[0], TransferKind.SCOPE_BEGIN, key[1]))
                closing.append(_ours(key[0], TransferKind.SCOPE_END, key[1]))
            if hit and kind in (BACKWARD_INPUT, FULL_BACKWARD):
                out.append(_ours(key[0], TransferKind.BACKWARD_READY, key[1]))
            if key[0] in fsdp_stages and kind in (BACKWARD_INPUT, BACKWARD_WEIGHT):
                out.append(_ours(key[0], TransferKind.UNSHARD_AGAIN, key[1]))
            if hit and kind in (FULL_BACKWARD, BACKWARD_WEIGHT) and last_backward.get(key) == kind:
                closing.append(_ours(key[0], TransferKind.FREE, key[1]))
            closing.extend(after.pop((sub.stage_index, kind, sub.microbatch_index), []))
        out.append(t)
        out.extend(closing)
    assert not after, f"transfer actions without their compute action: {after}"
    return out


_FORWARD_WORK = {FORWARD.value, SEND_F.value, RECV_F.value, UNSHARD.value, RESHARD.value,
                 "WAIT_SEND_F"}  # the last: torch >= 2.15


def forwards_only(lowered: list[Any]) -> list[Any]:
    """One rank's lowered list without its backward work.

    Note: [forwards only] torch runs ``eval()`` and schedules without a loss over the whole
    list, its stages skipping backward passes; but a backward handed to a stage on the same rank
    (a V schedule's turn, Note: [V-schedule special case] in torch) asks that stage for a
    gradient it never made and fails. We run the forwards, their sends and receives and FSDP's
    unshard / reshard in their order, and the forward of each overlapped pair: no backward, no
    gradient reduction (which would rescale gradients of earlier steps), no offload.
    """
    out = []
    for action in lowered:
        if action.computation_type == OVERLAP_F_B:
            out.append(action.sub_actions[0])
        elif str(action.computation_type.value) in _FORWARD_WORK:
            out.append(action)
    return out
