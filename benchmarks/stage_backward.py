"""One stage's backward actions, ours against torch.distributed.pipelining's, in one process.

Run: python benchmarks/stage_backward.py [--sizes tiny:8,small:2] [--reps 40]

For the first, a middle and the last stage of a 4-stage split of each size (MODEL:ROWS, as in
vs_torch.py), the same module runs its forward and then, timed: our StageRunner's I and W
(runtime/backward.py, Note: [B/W split]) and B, and torch's ``stage_backward_input`` /
``stage_backward_weight`` (ZB's I / W) and ``stage_backward`` (B). Torch runs a first stage's
split backward whole in I (no input gradient), ours in W; compare their sums. Median of
``--reps`` after a warm-up, one thread, milliseconds. It isolates the per-action compute path
from P2P and scheduling (vs_torch.py measures whole steps).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
from _common import format_table, machine_summary
from torch.distributed.pipelining._backward import (
    stage_backward,
    stage_backward_input,
    stage_backward_weight,
)

from pipeoffload.runtime.stage import StageRunner
from pipeoffload.training.model import lm_loss
from pipeoffload.training.model_config import MODEL_PRESETS, model_preset
from pipeoffload.training.split import build_stage_modules

STAGES = 4
Timing = tuple[float, float]  # (I or B, W) seconds


def _inputs(model: str, rows: int, stage: int) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = model_preset(model)
    generator = torch.Generator().manual_seed(stage)
    if stage == 0:
        x = torch.randint(0, cfg.vocab_size, (rows, cfg.max_seq_len), generator=generator)
    else:
        x = torch.randn(rows, cfg.max_seq_len, cfg.dim, generator=generator)
    target = torch.randint(0, cfg.vocab_size, (rows, cfg.max_seq_len), generator=generator)
    return x, target


def ours(module: torch.nn.Module, stage: int, x: torch.Tensor, target: torch.Tensor,
         split: bool) -> Timing:
    last = stage == STAGES - 1
    runner = StageRunner(stage, module, stage == 0, last, lm_loss, 8)
    out = runner.forward(0, (x.clone(),), (target,) if last else ())
    grads = () if last else (torch.ones_like(out[0]),)
    start = time.perf_counter()
    runner.backward(0, grads, split=split)
    middle = time.perf_counter()
    if split:
        runner.weight(0)
    return middle - start, time.perf_counter() - middle


def theirs(module: torch.nn.Module, stage: int, x: torch.Tensor, target: torch.Tensor,
           split: bool) -> Timing:
    x = x.clone() if stage == 0 else x.clone().requires_grad_()
    out = module(x)
    if stage == STAGES - 1:
        out, grad = lm_loss(out, target) * (1 / 8), None
    else:
        grad = torch.ones_like(out)
    # The graph is freed inside the timed region, as the runtimes free it in their actions
    # (torch pops the stage's forward cache in B and drops its param groups after W).
    start = time.perf_counter()
    if not split or stage == 0:  # torch: a first stage's I is its whole backward
        stage_backward(out, grad, [x])
        del out, x, grad
        return time.perf_counter() - start, 0.0
    _, groups = stage_backward_input([out], None if grad is None else [grad], [x],
                                     module.parameters())
    middle = time.perf_counter()
    stage_backward_weight(module.parameters(), groups)
    del groups, out, x, grad
    return middle - start, time.perf_counter() - middle


def median_ms(run: Callable[..., Timing], reps: int, *args: object) -> Timing:
    run(*args)
    samples = [run(*args) for _ in range(reps)]
    return (statistics.median(s[0] for s in samples) * 1e3,
            statistics.median(s[1] for s in samples) * 1e3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny:8,small:2", help="comma separated MODEL:ROWS")
    parser.add_argument("--reps", type=int, default=40)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(machine_summary())
    rows = []
    for item in args.sizes.split(","):
        model, _, count = item.strip().partition(":")
        if model not in MODEL_PRESETS or not count.isdigit():
            parser.error(f"size {item!r} is not MODEL:ROWS with MODEL in {list(MODEL_PRESETS)}")
        for stage in (0, 1, STAGES - 1):
            module = build_stage_modules(model_preset(model), STAGES, [stage], 0)[stage]
            x, target = _inputs(model, int(count), stage)
            cells = []
            for split in (True, False):
                for impl in (ours, theirs):
                    first, second = median_ms(impl, args.reps, module, stage, x, target, split)
                    cells.append((first, second))
            (oi, ow), (ti, tw), (ob, _), (tb, _) = cells
            rows.append([item.strip(), stage, f"{oi:.3f}", f"{ow:.3f}", f"{ti:.3f}", f"{tw:.3f}",
                         f"{(ti + tw) / (oi + ow):.3f}", f"{ob:.3f}", f"{tb:.3f}",
                         f"{tb / ob:.3f}"])
    print(f"of {STAGES} stages, median of {args.reps}, ms; ratio = torch / ours (> 1: ours "
          "faster)")
    print(format_table(["size", "stage", "ours I", "ours W", "torch I", "torch W",
                        "I+W ratio", "ours B", "torch B", "B ratio"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
