"""Explicit communication for the runtime: where SEND / RECV go, and message order per pair."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from pipeoffload.core.actions import Kind, parse_action
from pipeoffload.core.registry import FAMILIES, build_schedule
from pipeoffload.core.schedule import Schedule
from pipeoffload.core.validate import validate
from pipeoffload.runtime.lowering import early_receives, message_of, order_conflicts, with_comms
from pipeoffload.sim.simulator import simulate

OPTIONS = {"interleaved-1f1b": {"chunks": 2}, "grouped-interleaved": {"chunks": 2, "group_size": 2}}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_comms_cross_ranks_only_and_keep_the_schedule_valid(name: str) -> None:
    sched = build_schedule(name, pp=4, microbatches=8, **OPTIONS.get(name, {}))
    lowered = validate(with_comms(sched))
    sends = {message_of(a) for _, _, a in lowered.actions if a.kind in (Kind.SEND_F, Kind.SEND_B)}
    recvs = {message_of(a) for _, _, a in lowered.actions if a.kind in (Kind.RECV_F, Kind.RECV_B)}
    assert sends == recvs
    hops = {(s, m) for m in range(sched.microbatches) for s in sched.route_of(m)[:-1]
            if sched.rank_of(s) != sched.rank_of(s + 1)}
    expected = {("F", s + 1, m) for s, m in hops} | {("B", s, m) for s, m in hops}
    assert sends == expected
    assert lowered.without(Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B).ranks == sched.ranks
    assert with_comms(lowered) is lowered


def test_v_schedules_mix_directions_but_each_direction_is_ordered() -> None:
    lowered = with_comms(build_schedule("zbv", pp=4, microbatches=8))
    assert order_conflicts(lowered)  # one communicator for both directions would mismatch
    assert order_conflicts(lowered, per_direction=True) == []
    assert order_conflicts(with_comms(build_schedule("1f1b", pp=4, microbatches=8))) == []


@pytest.mark.parametrize(("name", "pp", "m"), [("dualpipe", 4, 8), ("dualpipe", 8, 32),
                                               ("dualpipev", 4, 8), ("dualpipev", 8, 32)])
def test_dualpipe_orders_messages_per_direction(name: str, pp: int, m: int) -> None:
    """NCCL-ready with a backward_group, as ZB-V: each direction's messages in one order."""
    assert order_conflicts(with_comms(build_schedule(name, pp=pp, microbatches=m)),
                           per_direction=True) == []


def _posting_order(actions: list, early: dict) -> list:
    """The rank's list as the executor posts it: early RECVs before their target, none in place."""
    moved = {r for recvs in early.values() for r in recvs}
    order = []
    for action in actions:
        order.extend(early.get(action, ()))
        if action not in moved:
            order.append(action)
    return order


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("lookahead", [0, 1, 2, 3])
def test_early_receives_move_back_over_at_most_lookahead_computes(name: str,
                                                                  lookahead: int) -> None:
    sched = build_schedule(name, pp=4, microbatches=8, **OPTIONS.get(name, {}))
    lowered = with_comms(sched)
    total_moved = 0
    for actions in lowered.ranks:
        actions = list(actions)
        early = early_receives(actions, lookahead)
        order = _posting_order(actions, early)
        assert sorted(order, key=str) == sorted(actions, key=str)  # each action exactly once
        moved = 0
        for recv in (a for a in actions if a.kind in (Kind.RECV_F, Kind.RECV_B)):
            old, new = actions.index(recv), order.index(recv)
            # the computes it now runs ahead of: those between its new and its old place
            jumped = [a for a in order[new + 1:] if a.kind.is_compute
                      and actions.index(a) < old]
            earlier = actions[:old]
            if recv.kind is Kind.RECV_B:  # its gradient's shapes come from its own F
                forward = recv._replace(kind=Kind.F)
                assert forward not in order or order.index(forward) < new
                if forward in earlier:
                    earlier = earlier[earlier.index(forward) + 1:]
            available = sum(a.kind.is_compute for a in earlier)
            assert len(jumped) == min(lookahead, available)
            moved += bool(jumped)
        total_moved += moved
        if lookahead == 0:
            assert early == {}
    assert (total_moved > 0) == (lookahead > 0)


def _routes_turning_across_ranks() -> Schedule:
    """Two routes whose boundary crosses ranks: microbatch 0 runs stages 0 (rank 0) and 1
    (rank 1), microbatch 1 stages 2 (rank 0) and 3 (rank 1); stage 1's output goes nowhere and
    stage 2 takes the input. No family builds such a route (DualPipe's turns on one rank)."""
    rows = [[parse_action(t) for t in "0F0 2F1 0B0 2B1".split()],
            [parse_action(t) for t in "1F0 3F1 1B0 3B1".split()]]
    return validate(Schedule(rows, (0, 1, 0, 1), 2, "routes", routes=((0, 1), (2, 3))))


def test_comms_follow_routes_where_a_route_ends_on_another_rank() -> None:
    """Between the end of one route and the start of the next nothing is sent, though stage
    s and s + 1 live on different ranks; along each route every hop is."""
    sched = _routes_turning_across_ranks()
    lowered = validate(with_comms(sched))
    comms = {str(a) for _, _, a in lowered.actions if a.kind.is_comm}
    assert comms == {"1RECV_F0", "0SEND_F0", "1SEND_B0", "0RECV_B0",
                     "3RECV_F1", "2SEND_F1", "3SEND_B1", "2RECV_B1"}
    assert order_conflicts(lowered, per_direction=True) == []
    assert simulate(lowered).makespan == simulate(sched).makespan


def test_a_pipeline_runs_routes_that_turn_across_ranks_like_autograd() -> None:
    torch = pytest.importorskip("torch")
    from pipeoffload.runtime.pipeline import Pipeline

    torch.manual_seed(0)
    stages = {s: torch.nn.Linear(3, 3, dtype=torch.float64) for s in range(4)}
    x = torch.randn(2, 3, dtype=torch.float64)

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return (out ** 2).sum()

    loss = Pipeline(stages, _routes_turning_across_ranks(), loss_fn).step(x)
    got = {name: p.grad.clone() for s, m in stages.items() for name, p in
           ((f"{s}.{n}", p) for n, p in m.named_parameters())}
    for module in stages.values():
        module.zero_grad()
    expected = (loss_fn(stages[1](stages[0](x[:1]))) + loss_fn(stages[3](stages[2](x[1:])))) / 2
    expected.backward()
    assert float(loss) == float(expected.detach())
    for s, module in stages.items():
        for n, p in module.named_parameters():
            assert torch.equal(got[f"{s}.{n}"], p.grad), f"{s}.{n}"
