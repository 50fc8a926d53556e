"""The NCCL rendezvous model (runtime/rendezvous.py) over the real lowering: with the runtime's
four channels no zoo schedule deadlocks, with or without offload, on the first step or later;
the layouts that do deadlock on NCCL deadlock in the model too, so the model can fail."""

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
from pipeoffload.runtime.rendezvous import posts_of, simulate

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
            outcome = simulate(schedule, channel_of, per_pair=per_pair, first_step=first_step)
            assert outcome.ok, "\n".join(outcome.deadlock)
    assert order_conflicts(with_comms(schedule), lane=channel_of) == []


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
