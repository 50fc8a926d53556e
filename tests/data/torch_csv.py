"""Write the CSV files that torch's own pipelining runtime dumps for three of its schedules.

Run with the torch whose files you want (the committed ones came from torch 2.15.0, the CUDA
build from the package registry, on a CPU-only machine):

    python tests/data/torch_csv.py            writes tests/data/torch-<version>-<schedule>.csv
    python tests/data/torch_csv.py --out DIR  the same files in DIR (tests/test_torch_csv.py)

Each file is what ``_PipelineScheduleRuntime._dump_csv`` writes (format "compute_comms"): one row
per rank, lowered by torch with UNSHARD / RESHARD, REDUCE_GRAD / WAIT_REDUCE_GRAD, SEND / RECV
and WAIT_SEND_F / WAIT_SEND_B (torch 2.15's kinds). pp = 2, two stages per rank, 4 microbatches.
One process builds every rank's lists over a fake process group: no communication happens.
tests/test_torch_csv.py loads them without torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, schedules
from torch.testing._internal.distributed.fake_pg import FakeStore

PP, MICROBATCHES = 2, 4
# torch's schedule class -> the stages rank 0 holds (loop placement, or V for ZBV)
SCHEDULES = {
    "Interleaved1F1B": (0, 2),
    "InterleavedZeroBubble": (0, 2),
    "ZBVZeroBubble": (0, 3),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    out = parser.parse_args().out
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=PP)
    version = torch.__version__.split("+")[0]
    for name, stage_ids in SCHEDULES.items():
        stages = [PipelineStage(nn.Linear(4, 4), s, 2 * PP, torch.device("cpu"))
                  for s in stage_ids]
        schedule = getattr(schedules, f"Schedule{name}")(stages, MICROBATCHES,
                                                         loss_fn=nn.functional.mse_loss)
        path = out / f"torch-{version}-{name}.csv"
        schedule._dump_csv(str(path))
        print(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
