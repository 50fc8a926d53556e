"""The NCCL rendezvous model (runtime/rendezvous.py) over the real lowering: with the runtime's
four channels and its connection warm-up no zoo schedule deadlocks, with or without offload, on
the first step or later; the layouts, the lazy connection set-up and the device-wide syncs that
do deadlock on NCCL deadlock in the model too, so the model can fail."""

from __future__ import annotations

import pytest

from pipeoffload.api import build_schedule
from pipeoffload.core.actions import Kind
from pipeoffload.core.registry import FAMILIES
from pipeoffload.runtime.lowering import (
    channel_of,
    forward_only,
    one_group,
    order_conflicts,
    two_groups,
    with_comms,
)
from pipeoffload.runtime.rendezvous import posts_of, simulate, sync_deadlocks, sync_positions

ZOO = [*FAMILIES, "po-h", "po-f"]


def _build(name: str, pp: int, offload: str | None):
    return build_schedule(name, pp=pp, microbatches=2 * pp, offload=offload, offload_ratio=0.5)


@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("offload", [None, "all"])
@pytest.mark.parametrize("name", ZOO)
def test_no_zoo_schedule_deadlocks_on_four_channels(name: str, offload: str | None,
                                                    pp: int) -> None:
    schedule = _build(name, pp, offload)
    if offload is not None:
        assert schedule.has_kind(Kind.OFFLOAD)
    for first_step in (True, False):
        for per_pair in (False, True):
            for warm_up in (False, True):
                outcome = simulate(schedule, channel_of, per_pair=per_pair,
                                   first_step=first_step, warm_up=warm_up)
                assert outcome.ok, "\n".join(outcome.deadlock)
    assert order_conflicts(with_comms(schedule), lane=channel_of) == []


# Issue 20: with NCCL's connection set-up on the first post per connection (and no warm-up),
# these deadlock on their first step, with and without offload.
FIRST_STEP_DEADLOCKS = {
    ("interleaved-1f1b", 4), ("interleaved-1f1b", 8), ("zb-h2", 4), ("zb-h2", 8), ("zbv", 4),
    ("zbv", 8), ("v-half", 4), ("v-half", 8), ("dualpipev", 4), ("dualpipev", 8),
    ("v-min", 8), ("dualpipe", 2), ("dualpipe", 4), ("dualpipe", 8), ("interleaved-zb", 2),
    ("interleaved-zb", 4), ("interleaved-zb", 8), ("torch-zbv", 4), ("torch-zbv", 8)}


def test_lazy_connection_setup_deadlocks_the_first_step_where_predicted() -> None:
    """Without ``Pipeline.connect_peers`` 38 of the 96 first steps deadlock (the code before
    issue 20); with it none does, on the first step or later ones."""
    stuck = set()
    for name in ZOO:
        for pp in (2, 4, 8):
            for offload in (None, "all"):
                schedule = _build(name, pp, offload)
                outcome = simulate(schedule, lazy_connect=True, first_step=True)
                if not outcome.ok:
                    stuck.add((name, pp, offload))
                    assert any("set up the connection" in line for line in outcome.deadlock)
                for first_step in (True, False):
                    assert simulate(schedule, warm_up=True, first_step=first_step).ok
    assert len(stuck) == 38
    assert stuck == {(n, p, o) for n, p in FIRST_STEP_DEADLOCKS for o in (None, "all")}


def test_zb_h2_first_step_waits_for_a_connection_that_needs_metadata() -> None:
    """The issue's example: rank 0 blocks setting up its first receive on the backward channel
    towards it while rank 1 sends there only after a forward that needs metadata from rank 0."""
    outcome = simulate(_build("zb-h2", 4, None), lazy_connect=True, first_step=True)
    assert any(line.startswith("rank 0") and "set up the connection 1 -> 0" in line
               for line in outcome.deadlock), outcome.deadlock


# One device-wide sync (allocator OOM retry, empty_cache, a pinned allocation) at one compute
# action of one rank, p = 4, m = 8, later steps: how many positions deadlock.
SYNC_DEADLOCKS = {"zbv": (15, 192), "v-half": (7, 192), "dualpipev": (9, 150), "v-min": (2, 192),
                  "1f1b": (0, 64), "interleaved-1f1b": (0, 128), "zb-h2": (0, 96),
                  "po-h": (0, 192)}


@pytest.mark.parametrize("name", sorted(SYNC_DEADLOCKS))
def test_a_device_wide_sync_inside_a_step_deadlocks_only_some_schedules(name: str) -> None:
    schedule = _build(name, 4, None)
    positions = sync_positions(schedule)
    stuck = sync_deadlocks(schedule)
    assert (len(stuck), len(positions)) == SYNC_DEADLOCKS[name]
    for at in [*stuck[:2], *positions[::40]]:  # the one-off entry point agrees
        outcome = simulate(schedule, warm_up=True, sync_at=at)
        assert outcome.ok is (at not in stuck)
        assert outcome.ok or any("device-wide sync" in line for line in outcome.deadlock)


@pytest.mark.parametrize("pp", [2, 4])
def test_a_device_wide_sync_between_steps_never_deadlocks(pp: int) -> None:
    """What the host pool does when it rebuilds after a step (runtime/pool.py)."""
    for name in ZOO:
        schedule = _build(name, pp, "all")
        lowered = with_comms(schedule)
        for rank in range(pp):
            end = (rank, len(lowered.ranks[rank]))
            assert simulate(schedule, warm_up=True, sync_at=end).ok, (name, rank)


@pytest.mark.parametrize(("name", "pp", "lane"), [
    ("1f1b", 2, one_group),  # both directions on one communicator: the classic 1F1B deadlock
    ("zbv", 2, two_groups),  # one F and one B communicator (the layout before issue 11)
    ("zbv", 4, two_groups),
    ("v-half", 2, two_groups),
    ("v-half", 4, two_groups),
    ("interleaved-1f1b", 2, two_groups),
])
def test_the_model_finds_the_known_deadlocks(name: str, pp: int, lane) -> None:
    outcome = simulate(_build(name, pp, None), lane)
    assert not outcome.ok
    assert any("waits for its match" in line for line in outcome.deadlock)


def test_first_step_posts_metadata_before_forward_data_only() -> None:
    from pipeoffload.core.actions import Action

    assert posts_of(Action(0, Kind.SEND_F, 0), first_step=True) == ("meta", "data")
    assert posts_of(Action(1, Kind.RECV_F, 0), first_step=True) == ("meta",)
    assert posts_of(Action(1, Kind.SEND_B, 0), first_step=True) == ("data",)
    assert posts_of(Action(0, Kind.RECV_F, 0), first_step=False) == ("data",)


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("name", ZOO)
def test_forward_only_evaluation_does_not_deadlock_either(name: str, pp: int) -> None:
    """Pipeline.evaluate runs the step's F actions and their messages in the step's order."""
    lowered = forward_only(with_comms(_build(name, pp, "all")))
    assert {a.kind for row in lowered.ranks for a in row} <= {Kind.F, Kind.SEND_F, Kind.RECV_F}
    for first_step in (True, False):
        outcome = simulate(lowered, channel_of, first_step=first_step)
        assert outcome.ok, "\n".join(outcome.deadlock)
    assert order_conflicts(lowered, lane=channel_of) == []
