"""Pipeline your own nn.Module under torchrun, and check it: a stack of residual MLP blocks cut
into stages by ``split_blocks``, trained with AdamW and gradient clipping over the pipeline,
checkpointed and resumed, against the same model trained in one process without a pipeline.

    torchrun --nproc-per-node 2 examples/custom_module.py --out /tmp/ckpt           # pp 2
    torchrun --nproc-per-node 2 examples/custom_module.py --out /tmp/ckpt --dp 2    # 2 replicas

Runs in float64, so the pipelined weights equal the plain loop's to ~1e-12. Each rank checks its
own stages and prints one line; any mismatch raises.
"""

from __future__ import annotations

import argparse
import copy
import os
from pathlib import Path

import torch
from torch import nn

import pipeoffload as po

DIM, BLOCKS, BATCH, MICROBATCHES = 16, 8, 16, 4


class Block(nn.Module):
    """x + W2 gelu(W1 norm(x)): any module taking one tensor and returning one is a block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def build() -> tuple[nn.Module, nn.Sequential, nn.Module]:
    torch.manual_seed(0)
    return (nn.Linear(8, DIM).double(), nn.Sequential(*(Block() for _ in range(BLOCKS))).double(),
            nn.Linear(DIM, 1).double())


def data(step: int, replica: int = 0, replicas: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch, or a data-parallel replica's equal share of it."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, 8, generator=g, dtype=torch.float64)
    y = x.sum(dim=1, keepdim=True).sin()
    return x.chunk(replicas)[replica], y.chunk(replicas)[replica]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def reference(steps: int) -> nn.Module:
    """The same training in one process, no pipeline: microbatch losses averaged, clipped."""
    first, blocks, last = build()
    model = nn.Sequential(first, *blocks, last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = data(step)
        loss = sum(loss_fn(model(a), b) for a, b in zip(x.chunk(MICROBATCHES),
                                                        y.chunk(MICROBATCHES))) / MICROBATCHES
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    return model


def train(stages: dict[int, nn.Module], pipe: po.Pipeline, topology: po.distributed.Topology,
          steps: range, checkpoints: Path, save_at: int) -> dict[int, torch.optim.Optimizer]:
    optimizers = {s: torch.optim.AdamW(m.parameters(), lr=1e-2) for s, m in stages.items()}
    if steps.start:
        assert po.load_checkpoint(checkpoints, stages, optimizers, topology) == steps.start
    for step in steps:
        x, y = data(step, topology.dp_index, topology.dp)
        pipe.step(x, target=y)
        po.average_gradients(stages, topology)  # over data-parallel replicas (none at dp 1)
        po.clip_grad_norm_(stages, 0.5, topology)
        for optimizer in optimizers.values():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if step + 1 == save_at:
            po.save_checkpoint(checkpoints, step + 1, stages, optimizers, topology)
    return optimizers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--schedule", default="po-f")
    parser.add_argument("--out", type=Path, required=True, help="checkpoints go here")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    args = parser.parse_args()
    pp = int(os.environ["WORLD_SIZE"]) // args.dp
    topology = po.init_distributed(pp=pp, dp=args.dp, device="cpu")
    schedule = po.build_schedule(args.schedule, pp=pp, microbatches=MICROBATCHES)
    first, blocks, last = build()  # every rank builds the same model, then keeps its stages
    stages = po.split_blocks(blocks, schedule, rank=topology.pp_rank, first=first, last=last)
    pipe = po.Pipeline(stages, schedule, loss_fn, **topology.pipeline_options())

    half = args.steps // 2
    train(stages, pipe, topology, range(args.steps), args.out, save_at=half)
    straight = {s: copy.deepcopy(m.state_dict()) for s, m in stages.items()}
    train(stages, pipe, topology, range(half, args.steps), args.out, save_at=-1)  # resumed
    for s, module in stages.items():
        for name, value in module.state_dict().items():
            assert torch.equal(value, straight[s][name]), f"resumed stage {s}: {name} differs"

    full = dict(reference(args.steps).named_parameters())
    worst = 0.0
    for s, module in stages.items():
        for name, param in module.named_parameters():
            index, _, rest = name.partition(".")
            worst = max(worst, (param - full[f"{int(index) + _offset(s, schedule)}.{rest}"])
                        .abs().max().item())
    assert worst < 1e-10, f"rank {topology.rank}: largest difference {worst:.2e}"
    print(f"rank {topology.rank}: stages {sorted(stages)} equal the one-process run "
          f"(max |diff| {worst:.1e}) and resume bitwise from step {half}", flush=True)
    torch.distributed.destroy_process_group()


def _offset(stage: int, schedule: po.Schedule) -> int:
    """Index in the one-process nn.Sequential(first, *blocks, last) of the stage's module 0."""
    from pipeoffload.runtime.blocks import balanced_ranges

    start = balanced_ranges(BLOCKS, schedule.num_stages)[stage].start
    return 0 if stage == 0 else start + 1


if __name__ == "__main__":
    main()
