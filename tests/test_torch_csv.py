"""CSV files that torch's pipelining runtime writes, lowered with its comms and markers, load,
validate, simulate like the bare schedule and are written back as read: the committed files from
torch 2.15.0 (no torch needed), and the files the installed torch writes now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeoffload.api import build_schedule
from pipeoffload.core.actions import MARKER_KINDS, Kind, parse_action
from pipeoffload.core.text import parse_rows, read_csv, to_csv_text
from pipeoffload.core.validate import validate
from pipeoffload.sim.simulator import simulate

DATA = Path(__file__).parent / "data"
COMMS = (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B)
# torch's schedule -> ours with the same placement (and, where torch's order is ours, the same
# order): every one simulates to the same makespan and peaks once torch's lowering is stripped.
OURS = {
    "Interleaved1F1B": ("interleaved-1f1b", {"chunks": 2}, True),
    "ZBVZeroBubble": ("zbv", {}, False),
    "InterleavedZeroBubble": (None, {}, False),
}
TORCH_215_KINDS = (Kind.WAIT_SEND_F, Kind.WAIT_SEND_B, Kind.WAIT_REDUCE_GRAD)


def _check_torch_file(path: Path, name: str) -> set[Kind]:
    text = path.read_text()
    loaded = validate(read_csv(path))
    assert to_csv_text(loaded).splitlines() == text.splitlines()  # written back as read
    compute = loaded.without(*MARKER_KINDS, *COMMS)
    assert parse_rows(to_csv_text(loaded, compute_only=True)) == [list(r) for r in compute.ranks]
    # markers cost no time: the same makespan and peaks with and without them
    with_markers, bare = simulate(loaded), simulate(compute)
    assert (with_markers.makespan, with_markers.peak_activation) == \
        (bare.makespan, bare.peak_activation)
    generator, options, same_order = OURS[name]
    if generator is not None:
        ours = build_schedule(generator, pp=2, microbatches=4, **options)
        assert compute.stage_to_rank == ours.stage_to_rank
        assert (simulate(ours).makespan, simulate(ours).peak_activation) == \
            (bare.makespan, bare.peak_activation)
        if same_order:
            assert compute.ranks == ours.ranks
    return {a.kind for row in loaded.ranks for a in row}


@pytest.mark.parametrize("name", sorted(OURS))
def test_csv_written_by_torch_2_15_loads_simulates_and_round_trips(name):
    kinds = _check_torch_file(DATA / f"torch-2.15.0-{name}.csv", name)
    assert set(TORCH_215_KINDS) <= kinds


@pytest.mark.parametrize("token", ["3WAIT_SEND_F1", "2WAIT_SEND_B0", "2WAIT_REDUCE_GRAD",
                                   "0WAIT_REDUCE_GRAD4"])
def test_torch_2_15_kinds_are_markers(token):
    action = parse_action(token)
    assert action.kind.is_marker and not action.kind.is_compute and not action.kind.blocks
    assert str(action) == token


@pytest.mark.parametrize("token", ["0WAIT_SEND_F", "1WAIT_SEND_B", "0WAIT_SEND1", "0WAIT_F1"])
def test_send_waits_need_their_microbatch(token):
    from pipeoffload.core.errors import ParseError

    with pytest.raises(ParseError, match=f"invalid action '{token}'"):
        parse_action(token)


def test_csv_written_by_the_installed_torch(tmp_path):
    """What the installed torch writes today (with WAIT_* from 2.15 on) loads the same way."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torch.distributed.pipelining")
    subprocess.run([sys.executable, str(DATA / "torch_csv.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True, text=True)
    from torch.distributed.pipelining.schedules import _ComputationType

    version = torch.__version__.split("+")[0]
    written = hasattr(_ComputationType, "WAIT_SEND_F")
    for name in OURS:
        kinds = _check_torch_file(tmp_path / f"torch-{version}-{name}.csv", name)
        assert {Kind.UNSHARD, Kind.RESHARD, Kind.REDUCE_GRAD, *COMMS} <= kinds
        assert (set(TORCH_215_KINDS) <= kinds) == written
