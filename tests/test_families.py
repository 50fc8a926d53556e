"""Schedule families: every generator validates and shows its paper's bubble and memory.

Expected values come from the papers' formulas and the authors' measured numbers
(docs/method.md sections 3 and 6), simulated with T_F = T_I = T_W = 1 and free P2P.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from functools import cache

import pytest

from pipeoffload.core.actions import Kind
from pipeoffload.core.families.block import order_by_slot, order_peaks, tighten
from pipeoffload.core.registry import FAMILIES, build_schedule
from pipeoffload.core.schedule import Placement, Schedule
from pipeoffload.core.validate import validate
from pipeoffload.errors import ConfigError
from pipeoffload.sim.simulator import SimResult, simulate

PPS = (2, 3, 4, 5, 8, 16)
GRID = [(p, m) for p in PPS for m in sorted({p, 2 * p + 1, 4 * p})]
AUTHORS = ((4, 8), (8, 16))  # where docs/method.md quotes the authors' measured bubbles


@cache
def run(name: str, pp: int, microbatches: int, **options: int) -> tuple[Schedule, SimResult]:
    schedule = build_schedule(name, pp, microbatches, **options)
    return schedule, simulate(schedule)


def one_f_one_b_bubble(p: int, m: int) -> float:
    return (p - 1) / (m + p - 1)


def gaps(result: SimResult, rank: int) -> float:
    """Idle time between rank's first action start and last action end."""
    timeline = sorted(result.timeline[rank], key=lambda t: t.start)
    return sum(b.start - a.end for a, b in itertools.pairwise(timeline))


def buildable(name: str, p: int, m: int) -> bool:
    return not ((name == "zb-h2" and m < 2 * p - 1)
                or (name in ("interleaved-1f1b", "interleaved-zb") and m % max(1, m // p))
                or (name == "dualpipev" and m < 2 * p)
                or (name == "dualpipe" and (p % 2 or m % 2 or m < 2 * p)))


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize(("p", "m"), GRID)
def test_every_schedule_validates_with_its_name_and_placement(name: str, p: int, m: int) -> None:
    if not buildable(name, p, m):
        with pytest.raises(ConfigError):
            build_schedule(name, p, m)
        return
    schedule, result = run(name, p, m)
    assert validate(schedule) is schedule
    assert schedule.name == name
    assert (schedule.num_ranks, schedule.microbatches) == (p, m)
    v_shaped = ("zbv", "v-half", "v-min", "dualpipe", "dualpipev", "torch-zbv")
    expected = Placement.V if name in v_shaped else Placement.LOOP
    assert schedule.placement is expected
    split = name in ("zb-h1", "zb-h2", "zbv", "v-half", "v-min", "grouped-interleaved",
                     "interleaved-zb", "torch-zbv")
    kinds = {a.kind for acts in schedule.ranks for a in acts}
    if name in ("dualpipe", "dualpipev"):  # full backwards in the middle, split at both ends
        assert kinds == {Kind.F, Kind.B, Kind.I, Kind.W}
    else:
        assert kinds == ({Kind.F, Kind.I, Kind.W} if split else {Kind.F, Kind.B})
    assert result.peak_activation == pytest.approx(
        [peak / len(schedule.stages_on_rank(r))
         for r, peak in enumerate(order_peaks(schedule.ranks))]
    )


@pytest.mark.parametrize(("p", "m"), GRID)
def test_1f1b_bubble_and_peaks(p: int, m: int) -> None:
    _, result = run("1f1b", p, m)
    assert result.bubble_rate == pytest.approx(one_f_one_b_bubble(p, m), abs=1e-9)
    assert result.peak_activation == tuple(float(p - i) for i in range(p))


@pytest.mark.parametrize(("p", "m"), GRID)
def test_gpipe_holds_every_microbatch(p: int, m: int) -> None:
    _, result = run("gpipe", p, m)
    assert result.peak_activation == (float(m),) * p
    assert result.bubble_rate == pytest.approx(one_f_one_b_bubble(p, m), abs=1e-9)


@pytest.mark.parametrize(("p", "m"), GRID)
def test_zb_h1_makespan_and_peak(p: int, m: int) -> None:
    _, result = run("zb-h1", p, m)
    # the paper's bubble (p-1)(T_F + T_B - T_W) = p - 1 slots on top of 3m of work
    assert result.makespan == 3 * m + p - 1
    assert max(result.peak_activation) <= p
    if m >= 2 * p:
        assert result.bubble_rate <= 0.45 * one_f_one_b_bubble(p, m)


@pytest.mark.parametrize(("p", "m"), GRID)
def test_zb_h2_no_gap_inside_any_rank(p: int, m: int) -> None:
    if m < 2 * p - 1:
        with pytest.raises(ConfigError, match="microbatches"):
            build_schedule("zb-h2", p, m)
        return
    _, result = run("zb-h2", p, m)
    assert all(gaps(result, r) == 0 for r in range(p))
    assert max(result.peak_activation) <= 2 * p
    assert result.makespan == run("zb-h1", p, m)[1].makespan


@pytest.mark.parametrize(("p", "m"), GRID)
def test_zbv_bubble_is_only_the_fill(p: int, m: int) -> None:
    _, result = run("zbv", p, m)
    assert result.makespan == 6 * m + p - 1
    assert max(result.peak_activation) <= p
    if m >= 2 * p:
        assert result.bubble_rate <= one_f_one_b_bubble(p, m) / 4


@pytest.mark.parametrize("p", PPS)
def test_v_half_and_v_min_peaks(p: int) -> None:
    m = 3 * p
    assert max(run("v-half", p, m)[1].peak_activation) <= p / 2 + 1
    assert max(run("v-min", p, m)[1].peak_activation) <= math.ceil(p / 3) + 1


@pytest.mark.parametrize(
    ("name", "expected"),
    [("1f1b", (0.273, 0.304)), ("zb-h1", (0.111, 0.127)), ("zb-h2", (0.111, 0.127)),
     ("zbv", (0.059, 0.068)), ("v-half", (0.094, 0.150)), ("v-min", (0.186, 0.220))],
)
def test_bubbles_match_the_authors_measurements(name: str, expected: tuple[float, ...]) -> None:
    for (p, m), authors in zip(AUTHORS, expected):
        assert run(name, p, m)[1].bubble_rate == pytest.approx(authors, abs=0.0015), (p, m)


def test_v_peaks_match_the_authors_measurements() -> None:
    assert [max(run("v-half", p, m)[1].peak_activation) for p, m in AUTHORS] == [3, 5]
    assert [max(run("v-min", p, m)[1].peak_activation) for p, m in AUTHORS] == [2, 4]
    assert [max(run("zb-h2", p, m)[1].peak_activation) for p, m in AUTHORS] <= [8, 16]


@pytest.mark.parametrize("p", (2, 3, 4, 8))
@pytest.mark.parametrize("v", (2, 3, 4))
def test_interleaved_1f1b_is_megatrons_order(p: int, v: int) -> None:
    for m in (p, 2 * p, 4 * p):
        schedule, result = run("interleaved-1f1b", p, m, chunks=v)
        for r, actions in enumerate(schedule.ranks):
            first_backward = next(i for i, a in enumerate(actions) if a.kind is Kind.B)
            # Megatron's warm-up, then the steady state's first forward, then the backward
            assert first_backward == min(2 * (p - r - 1) + (v - 1) * p, v * m - 1) + 1
        # Narayanan et al.: the fill shrinks by v, (p-1)/v of a microbatch's time
        assert result.bubble_rate == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-9)


def test_interleaved_1f1b_rejects_microbatches_that_do_not_group() -> None:
    with pytest.raises(ConfigError, match=r"microbatches=9.*\(8, 10\)"):
        build_schedule("interleaved-1f1b", 4, 9)
    schedule, _ = run("interleaved-1f1b", 4, 10)  # torch's rounds: two groups of 5
    assert schedule.microbatches == 10


@pytest.mark.parametrize(("p", "v"), [(p, v) for p in (2, 3, 4, 5, 8, 16) for v in (2, 3, 4)])
def test_grouped_interleaved_rank0_peak(p: int, v: int) -> None:
    for g in range(math.ceil(p / 2), p + 1):
        if p == 16 and g not in (8, 12, 16):
            continue
        schedule, result = run("grouped-interleaved", p, 4 * p, chunks=v, group_size=g)
        assert order_peaks(schedule.ranks)[0] == p + (v - 1) * g, g
        assert result.peak_activation[0] == pytest.approx((p + (v - 1) * g) / v)
        assert max(result.peak_activation) == result.peak_activation[0]


@pytest.mark.parametrize(("p", "v", "g", "units"), [(8, 2, 4, 12), (8, 3, 4, 16), (16, 4, 8, 40)])
def test_grouped_interleaved_authors_peaks(p: int, v: int, g: int, units: int) -> None:
    _, result = run("grouped-interleaved", p, 4 * p, chunks=v, group_size=g)
    assert result.peak_activation[0] * v == pytest.approx(units)


@pytest.mark.parametrize("p", (4, 8, 16))
@pytest.mark.parametrize("v", (2, 3, 4))
def test_grouped_interleaved_bubble_close_to_interleaved(p: int, v: int) -> None:
    m = 4 * p
    interleaved = run("interleaved-1f1b", p, m, chunks=v)[1].bubble_rate
    for g in (math.ceil(p / 2), p):
        bubble = run("grouped-interleaved", p, m, chunks=v, group_size=g)[1].bubble_rate
        assert bubble <= interleaved + 0.03
        assert bubble < one_f_one_b_bubble(p, m)
    assert run("grouped-interleaved", p, m, chunks=v)[0] == \
        run("grouped-interleaved", p, m, chunks=v, group_size=math.ceil(p / 2))[0]


@pytest.mark.parametrize(
    ("name", "pp", "m", "options", "match"),
    [
        ("1f1b", 0, 4, {}, "pp must be >= 1"),
        ("zbv", 4, 0, {}, "microbatches must be >= 1"),
        ("gpipe", 2.5, 4, {}, "pp must be an integer"),
        ("v-min", True, 4, {}, "pp must be an integer"),
        ("interleaved-1f1b", 4, 8, {"chunks": 0}, "chunks must be >= 1"),
        ("interleaved-zb", 4, 9, {}, "does not split into equal groups"),
        ("looped-bfs", 4, 8, {"chunks": 0}, "chunks must be >= 1"),
        ("torch-zbv", 4, 8, {"chunks": 1}, "exactly 2 stage"),
        ("grouped-interleaved", 8, 16, {"group_size": 3}, r"group_size=3.*4\.\.8"),
        ("grouped-interleaved", 8, 16, {"group_size": 9}, r"group_size=9.*4\.\.8"),
        ("grouped-interleaved", 4, 8, {"chunks": 1}, "chunks must be >= 2"),
        ("zbv", 4, 8, {"chunks": 3}, "exactly 2 stage"),
        ("v-half", 4, 8, {"group_size": 2}, "no option group_size"),
        ("1f1b", 4, 8, {"chunks": 2}, "interleaved-1f1b"),
        ("zb-h1", 4, 8, {"warmup": 2}, "no option warmup"),
        ("zb-h2", 4, 6, {}, r"microbatches >= 7"),
    ],
)
def test_impossible_settings_raise_config_error(
    name: str, pp: object, m: object, options: dict[str, object], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        build_schedule(name, pp, m, **options)  # type: ignore[arg-type]


def test_consistent_fixed_chunks_are_accepted() -> None:
    assert build_schedule("1f1b", 4, 8, chunks=1) == build_schedule("1f1b", 4, 8)
    assert build_schedule("zbv", 4, 8, chunks=2) == build_schedule("zbv", 4, 8)


@pytest.mark.parametrize(("name", "p", "m"), [("zb-h1", 4, 8), ("zb-h2", 8, 17), ("1f1b", 5, 11),
                                              ("v-min", 4, 12)])
def test_tighten_never_raises_a_peak_or_the_makespan(name: str, p: int, m: int) -> None:
    schedule, result = run(name, p, m)
    tightened = validate(tighten(schedule, f_cap=order_peaks(schedule.ranks)))
    assert all(a <= b for a, b in zip(order_peaks(tightened.ranks), order_peaks(schedule.ranks)))
    assert simulate(tightened).makespan <= result.makespan
    assert sorted(map(str, tightened.ranks[0])) == sorted(map(str, schedule.ranks[0]))


def test_block_orders_are_unchanged() -> None:
    """Slot order and the replay behind ZB-V / V-Half / V-Min (``order_by_slot``, ``tighten``)
    are tuned for speed; every order they made before (recorded then, over this grid) must
    stay."""
    digest = hashlib.sha256()
    for name, options in (("zbv", {}), ("v-half", {}), ("v-min", {}), ("1f1b", {}),
                          ("zb-h1", {}), ("zb-h2", {}), ("grouped-interleaved", {"chunks": 3})):
        for p, m in itertools.product((1, 2, 3, 4, 5, 6, 7, 8, 12), (1, 2, 3, 5, 8, 13, 24)):
            try:
                ranks = build_schedule(name, p, m, **options).ranks
            except ConfigError:
                continue
            digest.update(repr([[str(a) for a in actions] for actions in ranks]).encode())
    assert digest.hexdigest() == BLOCK_DIGEST


def test_slot_shifts_must_rise_from_zero() -> None:
    with pytest.raises(ValueError, match="strictly increasing"):
        order_by_slot([0, 1], 3, (Kind.F, Kind.B), lambda stage, kind: stage, [0, 3, 3])
    with pytest.raises(ValueError, match="no integer"):
        order_by_slot([0, 1], 2, (Kind.F, Kind.B), lambda stage, kind: 0.5, [0, 3])


BLOCK_DIGEST = "cfcef4e8cb8263dc41fc17c18faed1a8c50e6611c778761091f8410566ec2951"
