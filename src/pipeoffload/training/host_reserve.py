"""Sizing the host pool before the first step (runtime/pool.py Note: [host pool]).

On NCCL, pinned memory allocated inside a step synchronises the device and can deadlock
(docs/runtime.md, "GPU rules"), so ``train`` reserves the pool before step 1: one microbatch runs
forward through each of this process's stages (no backward, the graph dropped at once) under an
``ActivationMeter``, and ``Pipeline.reserve_host_memory`` sizes the pool from those bytes and
the plan. The meter counts every saved non-parameter storage, the offloader moves those above
``min_offload_elements``, so the reservation is at least what a step uses.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.pipeline import Pipeline
from pipeoffload.training.model import lm_loss


def measure_stage_bytes(stages: Mapping[int, nn.Module], first: int, last: int,
                        tokens: torch.Tensor, hidden_shape: tuple[int, ...],
                        dtype: torch.dtype) -> dict[int, int]:
    """Saved bytes of one microbatch per stage: ``tokens`` ([microbatch, seq] ids, also the
    targets) into stage ``first``, a zero hidden state of ``hidden_shape`` into the others."""
    meter = ActivationMeter()
    meter.exclude([t for m in stages.values() for t in (*m.parameters(), *m.buffers())])
    devices = [tokens.device] if tokens.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # the run's random streams stay as they are
        for stage, module in stages.items():
            x = tokens if stage == first else torch.zeros(
                hidden_shape, dtype=dtype, device=tokens.device, requires_grad=True)
            with meter.scope(0, (stage, 0)), meter.observe(0):
                out = module(x)
                if stage == last:
                    out = lm_loss(out, tokens)
            del out, x
    return {stage: nbytes for (stage, _), nbytes in meter.stage_scope_bytes.items()}


def reserve_host_memory(pipe: Pipeline, stages: Mapping[int, nn.Module], microbatch: int,
                        seq_len: int, hidden_shape: tuple[int, ...], dtype: torch.dtype,
                        device: torch.device) -> int:
    """Reserve ``pipe``'s host pool before its first step; the bytes it needs (0 without
    offload). ``hidden_shape``: what a stage receives from the one before it (the reference
    model's tensor-parallel ranks hold [microbatch, seq / tp, dim], a Hugging Face model's the
    whole [microbatch, seq, hidden])."""
    if pipe.offloader is None:
        return 0
    schedule = pipe.schedule
    tokens = torch.zeros((microbatch, seq_len), dtype=torch.int64, device=device)
    sizes = measure_stage_bytes(stages, 0, schedule.num_stages - 1, tokens, hidden_shape, dtype)
    return pipe.reserve_host_memory(sizes)
