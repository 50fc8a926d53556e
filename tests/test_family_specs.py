"""What each schedule family declares (FamilySpec) is what its schedules do, and the
declarations' own checks; PipeOffload's presets are data the api builds from."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeoffload.api import build_schedule as api_build_schedule
from pipeoffload.core import registry
from pipeoffload.core.actions import Kind
from pipeoffload.core.families.base import FamilySpec, GroupSize, PlannerHints, any_count
from pipeoffload.core.registry import FAMILIES, PRESETS, Registry
from pipeoffload.core.schedule import Placement, Schedule
from pipeoffload.errors import ConfigError

SETTINGS = settings(max_examples=40, deadline=None)


def _build(family: FamilySpec, pp: int, microbatches: int, chunks: int) -> Schedule:
    options = {"chunks": chunks} if family.fixed_chunks is None else {}
    return registry.build_schedule(family.name, pp, microbatches, **options)


def _shapes(family: FamilySpec) -> st.SearchStrategy[tuple[int, int, int]]:
    """(pp, microbatches, chunks) the family builds: even pp and m >= 2p cover DualPipe's
    rules, multiples of pp the interleaved ones'."""
    return st.tuples(st.sampled_from([2, 4, 6]), st.integers(2, 4), st.integers(2, 3)).map(
        lambda t: (t[0], t[0] * t[1], family.fixed_chunks or t[2]))


def _i_apart_from_w(schedule: Schedule) -> int:
    """How many I actions are not followed at once, on their rank, by their own W."""
    apart = 0
    for row in schedule.ranks:
        compute = [a for a in row if a.kind in (Kind.F, Kind.I, Kind.W, Kind.B)]
        for here, after in zip(compute, [*compute[1:], None]):
            if here.kind is Kind.I and (after is None or (after.kind, after.stage,
                                                         after.microbatch) !=
                                        (Kind.W, here.stage, here.microbatch)):
                apart += 1
    return apart


@pytest.mark.parametrize("name", list(FAMILIES))
@SETTINGS
@given(data=st.data())
def test_every_schedule_has_its_familys_declared_shape(name: str, data: st.DataObject) -> None:
    """Placement, stages per rank and split backward, as declared, over many shapes; a family
    that does not defer W runs each W right after its I."""
    family = FAMILIES[name]
    pp, microbatches, chunks = data.draw(_shapes(family))
    schedule = _build(family, pp, microbatches, chunks)
    assert schedule.placement is family.placement
    assert schedule.stage_to_rank == family.stage_to_rank(pp, chunks)
    assert schedule.num_stages == pp * chunks
    assert schedule.has_kind(Kind.W) == family.split_backward
    if not family.w_deferred:
        assert _i_apart_from_w(schedule) == 0


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.w_deferred])
def test_families_that_defer_w_run_some_w_apart_from_its_i(name: str) -> None:
    assert _i_apart_from_w(_build(FAMILIES[name], 4, 8, 2)) > 0


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items()
                                  if f.planner.microbatches is not any_count])
@SETTINGS
@given(pp=st.integers(1, 8), microbatches=st.integers(1, 40))
def test_a_planner_microbatch_rule_admits_only_counts_the_family_builds(
        name: str, pp: int, microbatches: int) -> None:
    family = FAMILIES[name]
    if family.planner.microbatches(pp, microbatches):
        _build(family, pp, microbatches, 2)


def test_the_library_searches_its_families_as_before() -> None:
    """The planner's defaults and its one-rank family, read from the declarations."""
    assert [n for n, f in FAMILIES.items() if f.planner.by_default] == [
        "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "v-half", "v-min", "grouped-interleaved"]
    assert [n for n, f in FAMILIES.items() if f.planner.at_one_rank] == ["1f1b"]
    assert [n for n, f in FAMILIES.items() if f.weight_copies != 1] == ["dualpipe"]
    assert FAMILIES["dualpipe"].one_copy_variant == "dualpipev"


@pytest.mark.parametrize(("change", "message"), [
    ({"options": ("chunks",), "fixed_chunks": 1}, "either a chunks option or fixed_chunks"),
    ({"options": (), "fixed_chunks": None}, "either a chunks option or fixed_chunks"),
    ({"placement": Placement.EXPLICIT}, "LOOP or V"),
    ({"placement": Placement.V}, "fixed_chunks=2"),
    ({"split_backward": False, "w_deferred": True}, "only a split backward"),
    ({"weight_copies": 0}, "weight_copies"),
])
def test_a_declaration_that_contradicts_itself_is_refused(change: dict[str, object],
                                                         message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(FAMILIES["1f1b"], **change)  # type: ignore[arg-type]


def test_a_registry_refuses_a_name_or_spelling_twice() -> None:
    copy = dataclasses.replace(FAMILIES["1f1b"], name="other")
    with pytest.raises(ConfigError, match="claimed twice"):
        Registry((FAMILIES["1f1b"], copy))
    with pytest.raises(ConfigError, match="registered twice"):
        Registry((FAMILIES["1f1b"], dataclasses.replace(FAMILIES["gpipe"], name="1f1b")))


@pytest.mark.parametrize("pp", [2, 3, 4, 7])
def test_presets_build_their_family_at_their_options(pp: int) -> None:
    for preset in PRESETS.values():
        assert registry.preset(preset.name.upper().replace("-", "_")) is preset
        options = preset.options(pp)
        assert options == {"chunks": 2, "group_size": GroupSize.MIN.of(pp)}
        built = api_build_schedule(preset.name, pp, 4 * pp)
        plain = registry.build_schedule(preset.family, pp, 4 * pp, **options)
        assert built.name == preset.name
        assert [[a for a in row if a.kind in (Kind.F, Kind.I, Kind.W)]
                for row in built.ranks] == [list(row) for row in plain.ranks]
    assert registry.preset("grouped-interleaved") is None


def test_a_new_family_states_only_what_differs() -> None:
    spec = FamilySpec(name="mine", description="d", build=FAMILIES["1f1b"].build,
                      fixed_chunks=1)
    assert (spec.placement, spec.split_backward, spec.w_deferred, spec.weight_copies,
            spec.planner) == (Placement.LOOP, False, False, 1, PlannerHints())
