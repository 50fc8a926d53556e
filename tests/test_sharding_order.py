"""The order the Pipeline drives FSDP2 stages in (runtime/sharding.py Note: [sharded stages]),
checked with a recording stand-in for ``FSDPModule``: no process group, no torch."""

from __future__ import annotations

from pipeoffload import build_schedule
from pipeoffload.core.actions import Action, Kind
from pipeoffload.runtime.sharding import StageShards


class Recording:
    """FSDPModule's calls the Pipeline makes, in order, as strings."""

    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def unshard(self) -> None:
        self.calls.append(f"{self.name}.unshard")

    def reshard(self) -> None:
        self.calls.append(f"{self.name}.reshard")

    def set_requires_gradient_sync(self, value: bool) -> None:
        self.calls.append(f"{self.name}.sync={value}")

    def set_reshard_after_backward(self, value: bool) -> None:
        self.calls.append(f"{self.name}.reshard_after={value}")

    def set_is_last_backward(self, value: bool) -> None:
        self.calls.append(f"{self.name}.last={value}")


def plain(stages: dict, actions: list[Action]) -> StageShards:
    """StageShards with no FSDP behind: nothing to cast, nothing to reduce by hand."""
    return StageShards(stages, actions, reduce=lambda stage: None,
                       unsharded=lambda stage: None)


def run(shards: StageShards, actions: list[Action], calls: list[str]) -> None:
    """Each action recorded between the ``before`` and ``after`` the Pipeline calls."""
    for action in actions:
        shards.before(action)
        calls.append(str(action))
        shards.after(action)


def drive(schedule_name: str, rank: int, **options: int) -> list[str]:
    """A step of ``rank``'s actions with every stage sharded: the recorded calls, each
    action's name in between."""
    schedule = build_schedule(schedule_name, pp=2, microbatches=4, **options)
    actions = list(schedule.ranks[rank])
    calls: list[str] = []
    shards = plain({s: Recording(f"s{s}", calls) for s in schedule.stages_on_rank(rank)},
                   actions)
    run(shards, actions, calls)
    shards.finish()
    return calls


def test_1f1b_unshards_before_the_first_f_and_syncs_and_reshards_at_the_last_b() -> None:
    calls = drive("1f1b", rank=0)
    assert calls[:2] == ["s0.unshard", "0F0"]
    assert calls.count("s0.unshard") == 1  # kept whole through the other forwards
    backwards = [i for i, c in enumerate(calls) if c.startswith("0B")]
    assert [c for c in calls if c.startswith("0B")] == ["0B0", "0B1", "0B2", "0B3"]
    for i in backwards[:-1]:  # every B but the last accumulates, unsynced and unsharded
        assert calls[i - 3:i] == ["s0.sync=False", "s0.reshard_after=False", "s0.last=False"]
    last = backwards[-1]
    assert calls[last - 3:last + 2] == ["s0.sync=True", "s0.reshard_after=True", "s0.last=True",
                                        "0B3", "s0.reshard"]
    assert calls[-1] == "s0.reshard"  # the end of the pass: resharded (again, a no-op)
    assert not any(c.endswith("=True") for c in calls[:last - 3])


def test_each_stage_of_an_interleaved_rank_has_its_own_first_f_and_last_b() -> None:
    calls = drive("interleaved", rank=1, chunks=2)
    for stage in (1, 3):
        mine = [c for c in calls if c.startswith((f"s{stage}.", f"{stage}F", f"{stage}B"))]
        assert mine[:2] == [f"s{stage}.unshard", f"{stage}F0"]
        assert mine.count(f"s{stage}.unshard") == 1
        assert mine.index(f"s{stage}.sync=True") == mine.index(f"{stage}B3") - 3
        assert mine.index(f"s{stage}.reshard") == mine.index(f"{stage}B3") + 1


def test_a_forward_only_pass_unshards_once_and_reshards_at_the_end() -> None:
    actions = [Action(0, Kind.F, mb) for mb in range(3)]
    calls: list[str] = []
    shards = plain({0: Recording("s0", calls)}, actions)
    run(shards, actions, calls)
    shards.finish()
    assert calls == ["s0.unshard", "0F0", "0F1", "0F2", "s0.reshard"]


def test_a_split_backward_runs_unsynced_and_reduces_by_hand_after_the_last_w() -> None:
    """zbv (I / W): no I, W or B asks FSDP to sync; after the stage's last W of the step its
    post-backward runs by hand (the reduce-scatter), then it reshards; the other stage of the
    rank (V placement: stages 0 and 3 on rank 0) likewise after its own last W."""
    schedule = build_schedule("zbv", pp=2, microbatches=4)
    actions = list(schedule.ranks[0])
    calls: list[str] = []
    stages = {s: Recording(f"s{s}", calls) for s in schedule.stages_on_rank(0)}
    shards = StageShards(stages, actions,
                         reduce=lambda stage: calls.append(f"{stage.name}.reduce"),
                         unsharded=lambda stage: calls.append(f"{stage.name}.float32"))
    run(shards, actions, calls)
    assert not any(c.endswith("=True") for c in calls)
    for stage in stages:
        mine = [c for c in calls if c.startswith((f"s{stage}.", f"{stage}"))]
        assert mine[:3] == [f"s{stage}.unshard", f"s{stage}.float32", f"{stage}F0"]
        weights = [i for i, c in enumerate(mine) if c[len(str(stage)):].startswith("W")]
        assert len(weights) == 4 and mine.count(f"s{stage}.reduce") == 1
        assert mine[weights[-1] + 1:weights[-1] + 3] == [f"s{stage}.reduce", f"s{stage}.reshard"]
        assert mine.index(f"s{stage}.reduce") > max(
            i for i, c in enumerate(mine) if c[len(str(stage)):][:1] in "BIW")


def test_offload_actions_pass_through_and_the_order_holds() -> None:
    actions = list(build_schedule("1f1b", pp=2, microbatches=4, offload="all").ranks[0])
    assert any(a.kind is Kind.OFFLOAD for a in actions)
    calls: list[str] = []
    shards = plain({0: Recording("s0", calls)}, actions)
    run(shards, actions, calls)
    assert calls[:2] == ["s0.unshard", "0F0"] and calls.count("s0.unshard") == 1
    assert calls[calls.index("0B3") - 3:calls.index("0B3") + 2] == [
        "s0.sync=True", "s0.reshard_after=True", "s0.last=True", "0B3", "s0.reshard"]
