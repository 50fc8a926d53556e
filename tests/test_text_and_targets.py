"""Action text form, CSV reading errors, and offload target parsing."""

import json

import pytest

from pipeoffload.core.actions import Action, Kind, parse_action
from pipeoffload.core.text import parse_rows, read_csv, schedule_from_rows, to_csv_text
from pipeoffload.errors import ConfigError, ParseError, ScheduleError
from pipeoffload.offload.targets import TargetKind, parse_target


@pytest.mark.parametrize("kind", list(Kind))
def test_every_kind_round_trips_through_text(kind):
    action = Action(12, kind, 345)
    assert parse_action(str(action)) == action


@pytest.mark.parametrize("token", ["F0", "0F", "0X1", "0F1x", "0 F 1", "-1F0", "0UNSHARDx", "0F-1",
                                   "0OFFLOAD", "0SEND_F"])
def test_bad_tokens_are_rejected_whole(token):
    with pytest.raises(ParseError, match="invalid action"):
        parse_action(token)


def test_unsupported_torch_kinds_get_a_specific_hint():
    with pytest.raises(ParseError, match="OVERLAP_F_B"):
        parse_action("0OVERLAP_F_B1")


@pytest.mark.parametrize("token", ["0UNSHARD", "3RESHARD", "1REDUCE_GRAD", "2REDUCE_GRAD5"])
def test_torch_markers_parse_with_or_without_a_microbatch(token):
    action = parse_action(token)
    assert action.kind.is_marker
    assert str(action) == token


def test_parse_error_names_file_row_and_column(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0\n1F0,1Q0,1B0\n")
    with pytest.raises(ParseError, match=r"bad.csv:2:2: invalid action '1Q0'"):
        read_csv(path)


def test_missing_file_is_a_parse_error(tmp_path):
    with pytest.raises(ParseError, match="cannot read"):
        read_csv(tmp_path / "nope.csv")


def test_empty_cells_are_spacing_and_placement_is_inferred():
    rows = parse_rows("0F0,,0F1,0B0,0B1\n,1F0,1B0,1F1,1B1\n")
    sched = schedule_from_rows(rows)
    assert sched.stage_to_rank == (0, 1)
    assert sched.microbatches == 2
    assert to_csv_text(sched) == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"


def test_stage_on_two_ranks_is_rejected():
    with pytest.raises(ScheduleError, match="stage 0 appears on rank 0 and on rank 1"):
        schedule_from_rows(parse_rows("0F0,0B0\n0F1,0B1\n"))


def test_compute_only_strips_our_own_kinds():
    rows = parse_rows("0F0,0OFFLOAD0,0RELOAD0,0B0\n")
    assert to_csv_text(schedule_from_rows(rows), compute_only=True) == "0F0,0B0\n"


@pytest.mark.parametrize(
    "spec,kind,value,in_bytes",
    [
        ("none", TargetKind.NONE, 0, False),
        ("ALL", TargetKind.ALL, 0, False),
        ("chunks:2", TargetKind.CHUNKS, 2, False),
        ("fraction:0.5", TargetKind.FRACTION, 0.5, False),
        ("limit:3.5", TargetKind.LIMIT, 3.5, False),
        ("limit:2GiB", TargetKind.LIMIT, 2 * 2**30, True),
        ("limit:500mb", TargetKind.LIMIT, 5e8, True),
        ("Recompute-Chunks:1+ALL", TargetKind.RECOMPUTE_CHUNKS_THEN_ALL, 1, False),
        ("recompute-chunks:2+all", TargetKind.RECOMPUTE_CHUNKS_THEN_ALL, 2, False),
    ],
)
def test_targets_parse(spec, kind, value, in_bytes):
    target = parse_target(spec)
    assert (target.kind, target.value, target.in_bytes) == (kind, value, in_bytes)
    assert parse_target(str(target)) == target


@pytest.mark.parametrize("spec", ["some", "chunks:0", "chunks:x", "fraction:1.5", "limit:",
                                  "limit:3parsecs", "fraction:0.5GiB", "recompute-chunks:1",
                                  "recompute-chunks:0+all", "recompute-chunks:1+none",
                                  "recompute-chunks:+all"])
def test_bad_targets_name_the_accepted_forms(spec):
    with pytest.raises(ConfigError, match="offload target"):
        parse_target(spec)


def test_the_recompute_and_offload_target_reads_back_in_its_cli_spelling():
    target = parse_target("  Recompute-Chunks:1+ALL ")
    assert str(target) == "recompute-chunks:1+all"
    assert not target.demands and parse_target(target) is target


def test_marker_csv_simulates_like_the_bare_schedule_and_keeps_markers_through_planning(
        tmp_path, capsys):
    from pipeoffload.cli.main import main
    from pipeoffload.core.actions import MARKER_KINDS
    from pipeoffload.offload.plan import add_offload
    from pipeoffload.sim.simulator import simulate

    path = tmp_path / "torch.csv"
    path.write_text("0UNSHARD,0F0,0F1,0B0,0B1,0REDUCE_GRAD,0RESHARD\n"
                    "1UNSHARD,1F0,1B0,1F1,1B1,1REDUCE_GRAD,1RESHARD\n")
    marked = read_csv(path)
    bare = marked.without(*MARKER_KINDS)
    assert simulate(marked).makespan == simulate(bare).makespan
    planned = add_offload(marked, target="all").schedule
    assert planned.has_kind(Kind.OFFLOAD)
    assert [a for a in planned.ranks[0] if a.kind.is_marker] == \
        [Action(0, Kind.UNSHARD, None), Action(0, Kind.REDUCE_GRAD, None),
         Action(0, Kind.RESHARD, None)]
    out = tmp_path / "out.csv"
    assert main(["simulate", "--from-csv", str(path), "--csv", str(out), "--json"]) == 0
    assert out.read_text() == path.read_text()
    notes = json.loads(capsys.readouterr().out)["notes"]
    assert any("REDUCE_GRAD / RESHARD / UNSHARD actions are markers" in n for n in notes)


def test_a_marker_on_the_wrong_rank_is_a_schedule_error(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("0F0,0B0,1REDUCE_GRAD\n1F0,1B0\n")
    with pytest.raises(ScheduleError, match="stage 1 appears on rank 0 and on rank 1"):
        read_csv(path)
