"""The simulator on hand-made schedules whose timings and memory are worked out by hand."""

import pytest

from pipeoffload.core.actions import Action, B, F, I, Kind, W
from pipeoffload.core.schedule import Schedule
from pipeoffload.errors import ConfigError, ScheduleError
from pipeoffload.sim.costs import CostModel, Duplex, HostLink
from pipeoffload.sim.simulator import simulate


def off(stage, mb):
    return Action(stage, Kind.OFFLOAD, mb)


def rel(stage, mb):
    return Action(stage, Kind.RELOAD, mb)


def two_stage(actions0, actions1, microbatches=1):
    return Schedule((tuple(actions0), tuple(actions1)), (0, 1), microbatches)


def test_chain_times_and_p2p_latency():
    sched = two_stage([F(0, 0), I(0, 0), W(0, 0)], [F(1, 0), I(1, 0), W(1, 0)])
    res = simulate(sched, CostModel(f_time=1, i_time=2, w_time=3, p2p_time=0.5))
    # F0 [0,1]; F1 waits 0.5 -> [1.5,2.5]; I1 [2.5,4.5]; I0 needs I1 + 0.5 -> [5,7]; W0 [7,10]
    assert res.timed(F(1, 0)).start == 1.5
    assert res.timed(I(0, 0)).start == 5.0
    assert res.timed(W(1, 0)).end == 7.5
    assert res.makespan == 10.0
    assert res.compute_time == (6.0, 6.0)
    assert res.bubble_rate == pytest.approx(1 - 12 / 20)


def test_full_backward_takes_i_plus_w_and_frees_at_its_end():
    sched = Schedule(((F(0, 0), F(0, 1), B(0, 0), B(0, 1)),), (0,), 2)
    res = simulate(sched, CostModel(f_time=1, i_time=1, w_time=2))
    assert res.timed(B(0, 0)).end == 2 + 3
    assert res.peak_activation == (2.0,)
    assert res.memory[0][-1] == (8.0, 0.0)


def test_units_follow_bytes_of_the_ranks_stages():
    # rank 0 holds stages 0 and 2 with 1 and 3 bytes: stage 0 is 1/4 M_a, stage 2 is 3/4.
    sched = Schedule(
        ((F(0, 0), F(2, 0), B(2, 0), B(0, 0)), (F(1, 0), B(1, 0))), (0, 1, 0), 1)
    res = simulate(sched, CostModel(stage_activation_bytes=(1.0, 5.0, 3.0)))
    assert res.peak_activation == (1.0, 1.0)
    assert res.peak_bytes == (4.0, 5.0)
    points = dict(res.memory[0])
    assert points[0.0] == 0.25  # F(0,0) allocated at its start


def test_offload_frees_at_copy_end_and_reload_holds_from_copy_start():
    # Two microbatches on one stage, the first offloaded while the second runs.
    sched = Schedule(((F(0, 0), off(0, 0), F(0, 1), rel(0, 0), B(0, 1), B(0, 0)),), (0,), 2)
    costs = CostModel(f_time=1, i_time=1, w_time=1, offload_ratio=0.25)  # copy = 0.75
    res = simulate(sched, costs)
    assert res.timed(off(0, 0)).start == 1.0
    assert res.timed(off(0, 0)).end == 1.75
    # RELOAD is reached when F(0,1) ends at 2, B(0,1) runs [2,4], the copy [2, 2.75]
    assert res.timed(rel(0, 0)).start == 2.0
    assert res.timed(B(0, 0)).start == 4.0
    curve = res.memory[0]
    assert (1.75, 1.0) in curve  # offloaded: only microbatch 1 resident
    assert res.peak_activation == (2.0,)
    assert res.stall_time == (0.0,)


def test_reload_too_late_stalls_and_is_reported():
    sched = Schedule(((F(0, 0), off(0, 0), rel(0, 0), B(0, 0)),), (0,), 1)
    res = simulate(sched, CostModel(offload_ratio=1.0))  # each copy takes 3
    # OFFLOAD [1,4]; RELOAD waits for it [4,7]; B could start at 1, waits until 7
    assert res.timed(B(0, 0)).start == 7.0
    assert res.timed(B(0, 0)).stall == 6.0
    assert res.stall_time == (6.0,)


@pytest.mark.parametrize("duplex,expected_reload_start", [(Duplex.FULL, 3.0), (Duplex.HALF, 5.0)])
def test_half_duplex_serialises_directions(duplex, expected_reload_start):
    # Stage 0 offloads mb 1 while it reloads mb 0 (already offloaded in a first phase).
    sched = Schedule(
        ((F(0, 0), off(0, 0), F(0, 1), off(0, 1), rel(0, 0), B(0, 0), rel(0, 1), B(0, 1)),),
        (0,), 2)
    costs = CostModel(f_time=1, i_time=0.5, w_time=0.5, offload_ratio=1.0,  # copy = 2
                      host_link=HostLink(duplex=duplex))
    res = simulate(sched, costs)
    assert res.timed(off(0, 1)).start == 3.0  # the D2H queue held microbatch 0 until 3
    # RELOAD(0,0) needs OFFLOAD(0,0) done at 3; half duplex also waits for OFFLOAD(0,1) [3,5],
    # which became ready first.
    assert res.timed(rel(0, 0)).start == expected_reload_start


def test_shared_link_queues_two_ranks():
    sched = Schedule(
        ((F(0, 0), off(0, 0), rel(0, 0), B(0, 0)), (F(1, 0), off(1, 0), rel(1, 0), B(1, 0))),
        (0, 1), 1)
    alone = simulate(sched, CostModel(offload_ratio=2 / 3))  # copy = 2
    shared = simulate(sched, CostModel(offload_ratio=2 / 3, host_link=HostLink(ranks_per_link=2)))
    assert alone.timed(off(1, 0)).start == 2.0  # after F(1,0) = [1,2]
    assert shared.timed(off(0, 0)).end == 3.0
    assert shared.timed(off(1, 0)).start == 3.0  # the link was busy with rank 0 until 3
    assert alone.makespan == 10.0 and shared.makespan == 11.0
    # rank 0's backward waits on rank 1's, which now starts later
    assert shared.makespan > alone.makespan


def test_deadlock_raises_schedule_error_naming_the_rank():
    sched = two_stage([F(0, 0), B(0, 0)], [B(1, 0), F(1, 0)])
    with pytest.raises(ScheduleError, match="rank 1"):
        simulate(sched)


def test_negative_costs_rejected():
    with pytest.raises(ConfigError, match="f_time"):
        CostModel(f_time=-1)
    with pytest.raises(ConfigError, match="ranks_per_link"):
        HostLink(ranks_per_link=0)
