"""Helpers shared by the runtime tests (no tests here): small models, a single-process autograd
reference, offload insertion and a multi-process launcher for gloo."""

from __future__ import annotations

import copy
import os
import socket
import traceback
from collections.abc import Callable

import pytest
import torch
import torch.multiprocessing as mp
from patience import PATIENCE_S
from torch import nn

from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.schedule import Schedule
from pipeoffload.core.validate import validate

WIDTH = 8


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run much faster on one intra-op thread (and don't fight parallel tests)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Block(nn.Module):
    """A small transformer-like block: attention with sdpa, LayerNorm, MLP."""

    def __init__(self, width: int = WIDTH, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(),
                                 nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(w, dim=-1)
        q, k, v = (t.view(b, s, self.heads, w // self.heads).transpose(1, 2) for t in (q, k, v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, w))
        return x + self.mlp(self.norm2(x))


class Embed(nn.Module):
    def __init__(self, vocab: int = 16, width: int = WIDTH) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.block = Block(width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.block(self.tok(ids))


class Head(nn.Module):
    def __init__(self, vocab: int = 16, width: int = WIDTH) -> None:
        super().__init__()
        self.block = Block(width)
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.block(x))).flatten(0, 1)


def token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, target.flatten())


def transformer_stages(num_stages: int, dtype: torch.dtype = torch.float64,
                       seed: int = 0) -> list[nn.Module]:
    """Embedding+block, blocks, block+head; identical for a given seed in every process."""
    torch.manual_seed(seed)
    stages: list[nn.Module] = [Embed()]
    stages += [Block() for _ in range(num_stages - 2)]
    stages.append(Head())
    return [s.to(dtype) for s in stages]


def part_index(schedule: Schedule, stage: int) -> int:
    """The model part a stage runs: its position on its route (DualPipe's stages j and p+j are
    both part j; Note: [routes] in core/schedule.py). For one route, the stage itself."""
    routes = schedule.routes or (tuple(range(schedule.num_stages)),)
    route = next(r for r in routes if stage in r)
    return stage - route[0]


def token_batch(batch: int = 8, seq: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 16, (batch, seq), generator=generator)
    target = torch.randint(0, 16, (batch, seq), generator=generator)
    return ids, target


def reference(stages: list[nn.Module], inputs: torch.Tensor, target: torch.Tensor,
              microbatches: int,
              loss_fn: Callable[..., torch.Tensor] = token_loss) -> tuple[torch.Tensor, list]:
    """Loss and per-stage parameter gradients from plain autograd on copies of ``stages``."""
    model = copy.deepcopy(stages)
    losses = []
    for x, t in zip(inputs.chunk(microbatches), target.chunk(microbatches)):
        h = x
        for stage in model:
            h = stage(h)
        losses.append(loss_fn(h, t))
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.detach(), [[p.grad for p in s.parameters()] for s in model]


def max_relative_error(stages: list[nn.Module] | dict, grads: list) -> float:
    items = stages.items() if isinstance(stages, dict) else enumerate(stages)
    worst = 0.0
    for index, stage in items:
        for p, g in zip(stage.parameters(), grads[index]):
            assert p.grad is not None, f"stage {index} has a parameter without gradient"
            worst = max(worst, ((p.grad - g).norm() / g.norm().clamp_min(1e-300)).item())
    return worst


def with_offload(schedule: Schedule, stages: set[int] | None = None,
                 back: Kind = Kind.RELOAD) -> Schedule:
    """OFFLOAD right after each F and ``back`` (RELOAD or FETCH) right before its backward (I or
    B), on its rank."""
    rows = []
    for actions in schedule.ranks:
        row = []
        for action in actions:
            chosen = stages is None or action.stage in stages
            if chosen and action.kind.is_backward:
                row.append(Action(action.stage, back, action.microbatch))
            row.append(action)
            if chosen and action.kind is Kind.F:
                row.append(Action(action.stage, Kind.OFFLOAD, action.microbatch))
        rows.append(row)
    return validate(schedule.with_ranks(rows, name=schedule.name + "+offload"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, result_dir: str, fn: Callable, args: tuple) -> None:
    import torch.distributed as dist

    outcome: dict = {}
    torch.set_num_threads(1)  # several processes share the CPU cores
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                               world_size=world)
        outcome = {"ok": fn(rank, world, *args)}
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        outcome = {"error": f"{type(error).__name__}: {error}", "type": type(error).__name__,
                   "trace": traceback.format_exc()}
    torch.save(outcome, os.path.join(result_dir, f"rank{rank}.pt"))
    os._exit(0)  # skip process-group teardown, which can block when a peer is gone


def launch(fn: Callable, world: int, tmp_path: object, *args: object,
           join_timeout_s: float = PATIENCE_S) -> dict[int, dict]:
    """Run ``fn(rank, world, *args)`` in ``world`` spawned gloo processes; return their outcomes
    (a rank that died without reporting is missing)."""
    port = free_port()
    context = mp.get_context("spawn")
    processes = [context.Process(target=_entry, args=(r, world, port, str(tmp_path), fn, args))
                 for r in range(world)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(join_timeout_s)
    for p in processes:
        if p.is_alive():
            p.kill()
    results = {}
    for r in range(world):
        path = os.path.join(str(tmp_path), f"rank{r}.pt")
        if os.path.exists(path):
            results[r] = torch.load(path, weights_only=False)
    return results
