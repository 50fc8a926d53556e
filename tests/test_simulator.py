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


def fetch(stage, mb):
    return Action(stage, Kind.FETCH, mb)


def reads(res, rank=0):
    """(start, end) of the FETCH reads on a rank's H2D lane."""
    return [(t.start, t.end) for t in res.timeline[rank] if t.action.kind is Kind.FETCH]


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


def test_offload_streams_during_its_forward_and_reload_holds_from_copy_start():
    # Two microbatches on one stage, the first offloaded while the second runs.
    sched = Schedule(((F(0, 0), off(0, 0), F(0, 1), rel(0, 0), B(0, 1), B(0, 0)),), (0,), 2)
    costs = CostModel(f_time=1, i_time=1, w_time=1, offload_ratio=0.25)  # copy = 0.75
    res = simulate(sched, costs)
    # The copy streams out from F's start and cannot end before F does.
    assert (res.timed(off(0, 0)).start, res.timed(off(0, 0)).end) == (0.0, 1.0)
    # RELOAD is reached when F(0,1) ends at 2, B(0,1) runs [2,4], the copy [2, 2.75]
    assert res.timed(rel(0, 0)).start == 2.0
    assert res.timed(B(0, 0)).start == 4.0
    curve = res.memory[0]
    assert (1.0, 1.0) in curve  # the copy kept up with F(0,0): only microbatch 1 resident
    assert res.peak_activation == (2.0,)
    assert res.stall_time == (0.0,)


@pytest.mark.parametrize("ratio,expected", [(0.25, 0.0), (1.0, 2 / 3)])
def test_streaming_offload_keeps_only_what_the_copy_has_not_drained(ratio, expected):
    sched = Schedule(((F(0, 0), off(0, 0), F(0, 1), rel(0, 0), B(0, 1), B(0, 0)),), (0,), 2)
    res = simulate(sched, CostModel(offload_ratio=ratio))  # F takes 1, the copy 3 * ratio
    assert res.memory[0][1] == pytest.approx((0.0, expected))  # made at 1/F, drained at 1/copy


def test_a_copy_queued_past_its_forward_counts_it_whole():
    # Half duplex: mb 0's copy holds the link [0, 3]; mb 1's starts after F(0,1) ended.
    sched = Schedule(((F(0, 0), off(0, 0), F(0, 1), off(0, 1), rel(0, 0), rel(0, 1), B(0, 1),
                       B(0, 0)),), (0,), 2)
    res = simulate(sched, CostModel(offload_ratio=1.0, host_link=HostLink(Duplex.HALF)))
    assert res.timed(off(0, 1)).start == 3.0
    assert res.memory[0][2] == pytest.approx((1.0, 2 / 3 + 1.0))


def test_reload_too_late_stalls_and_is_reported():
    sched = Schedule(((F(0, 0), off(0, 0), rel(0, 0), B(0, 0)),), (0,), 1)
    res = simulate(sched, CostModel(offload_ratio=1.0))  # each copy takes 3
    # OFFLOAD [0,3]; RELOAD waits for it [3,6]; B could start at 1, waits until 6
    assert res.timed(B(0, 0)).start == 6.0
    assert res.timed(B(0, 0)).stall == 5.0
    assert res.stall_time == (5.0,)


@pytest.mark.parametrize("duplex,expected_reload_start", [(Duplex.FULL, 2.0), (Duplex.HALF, 4.0)])
def test_half_duplex_serialises_directions(duplex, expected_reload_start):
    sched = Schedule(
        ((F(0, 0), off(0, 0), F(0, 1), off(0, 1), rel(0, 0), B(0, 0), rel(0, 1), B(0, 1)),),
        (0,), 2)
    costs = CostModel(f_time=1, i_time=0.5, w_time=0.5, offload_ratio=1.0,  # copy = 2
                      host_link=HostLink(duplex=duplex))
    res = simulate(sched, costs)
    assert res.timed(off(0, 1)).start == 2.0  # the D2H queue held microbatch 0 until 2
    # RELOAD(0,0) needs OFFLOAD(0,0) done at 2; half duplex also waits for OFFLOAD(0,1) [2,4],
    # which became ready first.
    assert res.timed(rel(0, 0)).start == expected_reload_start


def test_shared_link_queues_two_ranks():
    sched = Schedule(
        ((F(0, 0), off(0, 0), rel(0, 0), B(0, 0)), (F(1, 0), off(1, 0), rel(1, 0), B(1, 0))),
        (0, 1), 1)
    alone = simulate(sched, CostModel(offload_ratio=2 / 3))  # copy = 2
    shared = simulate(sched, CostModel(offload_ratio=2 / 3, host_link=HostLink(ranks_per_link=2)))
    assert alone.timed(off(1, 0)).start == 1.0  # with F(1,0) = [1,2]
    assert shared.timed(off(0, 0)).end == 2.0
    assert shared.timed(off(1, 0)).start == 2.0  # the link was busy with rank 0 until 2
    assert alone.makespan == 9.0 and shared.makespan == 10.0


def test_fetched_activation_is_read_during_its_backward_and_never_held_whole():
    # As the RELOAD test above, but microbatch 0 comes back by FETCH: nothing of it is resident
    # after its copy out, so the peak is microbatch 1 alone (RELOAD: 2).
    sched = Schedule(((F(0, 0), off(0, 0), F(0, 1), B(0, 1), fetch(0, 0), B(0, 0)),), (0,), 2)
    res = simulate(sched, CostModel(f_time=1, i_time=1, w_time=1, offload_ratio=0.25))
    assert reads(res) == [(4.0, 4.75)]  # queued when B(0,0) could start; read 0.75
    assert (res.timed(B(0, 0)).start, res.timed(B(0, 0)).end) == (4.0, 6.0)
    assert res.peak_activation == (1.0,)
    assert res.memory[0][-1][1] == 0.0
    assert res.stall_time == (0.0,)


def test_a_read_slower_than_its_pass_stretches_it_and_counts_as_stall():
    sched = Schedule(((F(0, 0), off(0, 0), F(0, 1), B(0, 1), fetch(0, 0), B(0, 0)),), (0,), 2)
    res = simulate(sched, CostModel(offload_ratio=1.0))  # copies take 3, B takes 2
    assert reads(res) == [(4.0, 7.0)]
    # The pass cannot end before its read: B(0,0) ends at 7, as if it began at 5.
    assert res.timed(B(0, 0)).end == 7.0
    assert res.stall_time == (1.0,)


def test_split_backward_reads_in_each_pass():
    sched = Schedule(((F(0, 0), off(0, 0), fetch(0, 0), I(0, 0), W(0, 0)),), (0,), 1)
    res = simulate(sched, CostModel(offload_ratio=0.25))  # copies 0.75, passes 1
    assert reads(res) == [(1.0, 1.75), (2.0, 2.75)]
    assert res.timed(W(0, 0)).end == 3.0
    assert res.peak_activation == (0.0,)  # streamed out as made, read back as used


def test_reads_of_two_ranks_queue_on_a_shared_link():
    sched = two_stage(
        [F(0, 0), off(0, 0), F(0, 1), fetch(0, 0), B(0, 0), B(0, 1)],
        [F(1, 0), F(1, 1), off(1, 1), B(1, 0), fetch(1, 1), B(1, 1)], microbatches=2)
    costs = CostModel(offload_ratio=0.5)  # copies 1.5, B 2
    alone = simulate(sched, costs)
    shared = simulate(sched, CostModel(offload_ratio=0.5, host_link=HostLink(ranks_per_link=2)))
    # B(1,0) ends at 5; then B(0,0) and B(1,1) both want to read for 1.5.
    assert reads(alone, 0) == reads(alone, 1) == [(5.0, 6.5)]
    assert alone.stall_time == (0.0, 0.0)
    both = sorted(reads(shared, 0) + reads(shared, 1))
    assert both == [(5.0, 6.5), (6.5, 8.0)]  # one at a time on the shared link
    assert sum(shared.stall_time) == pytest.approx(1.0)  # the second pass ends at 8, not 7


def test_deadlock_raises_schedule_error_naming_the_rank():
    sched = two_stage([F(0, 0), B(0, 0)], [B(1, 0), F(1, 0)])
    with pytest.raises(ScheduleError, match="rank 1"):
        simulate(sched)


def test_negative_costs_rejected():
    with pytest.raises(ConfigError, match="f_time"):
        CostModel(f_time=-1)
    with pytest.raises(ConfigError, match="ranks_per_link"):
        HostLink(ranks_per_link=0)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv",
                                  "v-half", "v-min", "grouped-interleaved"])
def test_memory_follows_the_program_when_every_time_ties(name):
    # With all-zero costs every event happens at time 0; without offload a rank's memory
    # depends only on the order of its own compute actions, so the peaks are those of unit
    # costs (1f1b's rank 0 holds p microbatches, not 0).
    from pipeoffload.core.registry import build_schedule

    schedule = build_schedule(name, 4, 8)
    zero = simulate(schedule, CostModel(f_time=0, i_time=0, w_time=0))
    assert zero.makespan == 0
    assert zero.peak_activation == simulate(schedule).peak_activation
    assert max(zero.peak_activation) > 0


def test_nonfinite_costs_are_refused_naming_the_field():
    for field in ("f_time", "i_time", "w_time", "p2p_time", "offload_ratio"):
        for value in (float("nan"), float("inf")):
            with pytest.raises(ConfigError, match=f"CostModel.{field}"):
                CostModel(**{field: value})
