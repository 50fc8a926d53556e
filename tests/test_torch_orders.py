"""Every drop-in class of pipeoffload.torch runs the order of torch's class of the same name, for
p = 2..8 ranks and m = p..4p microbatches, over stand-in stages that carry only what torch's
schedule-plan tests give theirs (no stage_index, no module): what torch's ``_dump_csv`` writes
for its multi-stage classes (compute only, and lowered with its comms), and, for its single-stage
classes (whose ``pipeline_order`` is a drawing, not what runs), the forwards and backwards its
``step`` calls, recorded. No process group, no tensors."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.pipelining")

from pipeoffload.errors import IntegrationError  # noqa: E402

try:
    import pipeoffload.torch as ours
except IntegrationError as refusal:
    pytest.skip(str(refusal), allow_module_level=True)
from torch.distributed.pipelining import schedules  # noqa: E402
from torch.distributed.pipelining.stage import _PipelineStageBase  # noqa: E402

GRID = [(p, m) for p in range(2, 9) for m in range(p, 4 * p + 1)]
# torch's class name -> the stages per rank to try (torch's V classes take exactly 2)
MULTI = {"Interleaved1F1B": (1, 2, 3), "LoopedBFS": (1, 2, 3), "InterleavedZeroBubble": (1, 2, 3),
         "ZBVZeroBubble": (2,), "DualPipeV": (2,)}
SINGLE = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B", "ForwardOnly": "_ScheduleForwardOnly"}


class StandIn(_PipelineStageBase):
    """A stage with only what torch's ``MockPipelineStage`` sets (it skips the base __init__)."""

    def __init__(self, num_stages: int, group_size: int, group_rank: int = 0) -> None:
        self.submod = None
        self.num_stages, self.group_size = num_stages, group_size
        self.group_rank, self.group = group_rank, None

    def _create_grad_recv_info(self, *args, **kwargs):  # noqa: ANN002, ANN003
        return None

    def _prepare_forward_infra(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        pass

    def _prepare_backward_infra(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        pass


class Recorder(StandIn):
    """Stage ``rank`` of a single-stage schedule that records the passes torch's step runs."""

    def __init__(self, ranks: int, rank: int) -> None:
        super().__init__(ranks, ranks, rank)
        self.stage_index, self.device, self.output_chunks = rank, torch.device("cpu"), []
        self.log: list[str] = []

    def forward_one_chunk(self, mb, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        self.log.append(f"{self.stage_index}F{mb}")

    def backward_one_chunk(self, mb, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        self.log.append(f"{self.stage_index}B{mb}")

    def _no_ops(self, *args, **kwargs) -> list:  # noqa: ANN002, ANN003
        return []

    get_fwd_recv_ops = get_bwd_recv_ops = get_fwd_send_ops = get_bwd_send_ops = _no_ops

    def clear_runtime_states(self) -> None:
        pass

    def release_fwd_send_outputs(self, *args) -> None:  # noqa: ANN002 - torch >= 2.15
        pass

    def perform_reduce_grad(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        pass


def dumped(schedule, tmp_path: Path, format: str) -> list[list[str]]:
    """What ``schedule._dump_csv`` writes, empty cells (torch's bubbles) left out."""
    path = tmp_path / "order.csv"
    schedule._dump_csv(str(path), format=format)
    with path.open(newline="") as f:
        return [[cell for cell in row if cell] for row in csv.reader(f)]


def torch_step_order(name: str, p: int, m: int) -> list[list[str]]:
    """The passes torch's single-stage class runs on each rank, from its own step loop."""
    rows = []
    for rank in range(p):
        stage = Recorder(p, rank)
        forward_only = name == "ForwardOnly"
        schedule = getattr(schedules, SINGLE[name])(
            stage, m, loss_fn=None if forward_only else (lambda out, target: out))
        schedule._initialize_stage = lambda *args, **kwargs: None  # no metadata exchange
        schedule._step_microbatches(None, None, None if forward_only else [None] * m, None)
        rows.append(stage.log)
    return rows


@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(MULTI))
def test_multi_stage_classes_dump_torchs_csv(name: str, tmp_path: Path) -> None:
    compared = refused = 0
    for local in MULTI[name]:
        for p, m in GRID:
            def stand_ins() -> list[StandIn]:
                return [StandIn(local * p, p) for _ in range(local)]  # noqa: B023

            try:
                theirs = getattr(schedules, f"Schedule{name}")(stand_ins(), m)
            except ValueError as torch_refusal:
                with pytest.raises(ValueError):
                    getattr(ours, f"Schedule{name}")(stand_ins(), m)
                refused += 1
                assert "microbatches" in str(torch_refusal)
                continue
            mine = getattr(ours, f"Schedule{name}")(stand_ins(), m)
            for format in ("compute_only", "compute_comms"):
                assert dumped(mine, tmp_path, format) == dumped(theirs, tmp_path, format), \
                    (name, local, p, m, format)
            compared += 1
    assert compared + refused == len(GRID) * len(MULTI[name]) and refused < compared


@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(SINGLE))
def test_single_stage_classes_run_torchs_step_order(name: str) -> None:
    for p, m in GRID:
        mine = getattr(ours, f"Schedule{name}")(StandIn(p, p), m)
        passes = [[str(a) for a in row if a is not None and a.computation_type.value in "FB"]
                  for _, row in sorted(mine.pipeline_order.items())]
        if name == "ForwardOnly":
            passes = [[a for a in row if "F" in a] for row in passes]
        assert passes == torch_step_order(name, p, m), (name, p, m)


@pytest.mark.torch
def test_dualpipev_writes_torchs_overlapped_pairs(tmp_path: Path) -> None:
    """torch's own DualPipeV artefact case (4 ranks, 10 microbatches): the pairs are
    ``OVERLAP_F_B`` cells, as torch writes them."""
    def stand_ins() -> list[StandIn]:
        return [StandIn(8, 4) for _ in range(2)]

    mine = dumped(ours.ScheduleDualPipeV(stand_ins(), 10), tmp_path, "compute_only")
    theirs = dumped(schedules.ScheduleDualPipeV(stand_ins(), 10), tmp_path, "compute_only")
    assert mine == theirs
    assert sum(cell.endswith("OVERLAP_F_B") for row in mine for cell in row) == 41


def test_get_schedule_class_takes_torchs_names_and_ours() -> None:
    for spelling in ("1F1B", "1f1b", "Interleaved1F1B", "INTERLEAVED1F1B", "GPipe", "LoopedBFS",
                     "ScheduleInterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        cls = ours.get_schedule_class(spelling)
        assert issubclass(cls, ours.PipeOffloadSchedule), spelling
        assert cls.__name__.lower().removeprefix("schedule") == \
            spelling.lower().removeprefix("schedule")
    assert ours.get_schedule_class("PipelineScheduleMulti") is schedules.PipelineScheduleMulti
    po_f = ours.get_schedule_class("po-f")
    assert issubclass(po_f, ours.PipeOffloadSchedule) and po_f.family == "po-f"
    with pytest.raises(ValueError, match="ScheduleThatDoesNotExist"):
        ours.get_schedule_class("ScheduleThatDoesNotExist")
