"""The multi-GPU check of issue 20 (one process per GPU, started by benchmarks/gpu_multi.sh with
torchrun): what only real NCCL communicators can show.

Run: bash benchmarks/gpu_multi.sh [--nproc 2]          (>= 2 GPUs; skips cleanly with fewer)
     bash benchmarks/gpu_multi.sh --device cpu         (the same on gloo, what CI runs)

Every process joins with pipeoffload.init_distributed (NCCL bound to its GPU, one
communicator per message channel), then:
1. zbv, interleaved-1f1b and dualpipe at p = world: step 1 (connection warm-up, shape
   metadata) and two more, each with an SGD update; per model part the gradients (DualPipe's
   twins summed) and the loss equal plain autograd on the whole model in this process, to a
   relative 1e-10 in float64 (runtime/p2p.py, runtime/rendezvous.py);
2. a Hugging Face Llama with tied embeddings split over the ranks (extra ``hf``; skipped with
   a note without it): every held gradient, the tie's included, equals the unsplit model's
   (runtime/tied.py posts its sums on the GPU);
3. zbv with every activation offloaded, its host pool reserved from the plan before step 1, on
   a device capped (``set_per_process_memory_fraction``) to what the plan needs plus a
   headroom: three steps must end (no hang), the pool must not grow inside a step, and the
   allocator's peak must stay within the simulator's prediction (benchmarks/_memory_checks.py).
Each process prints its CHECK lines; rank 0 prints the RESULT line. Exit status: 0 when every
check on every rank passed.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import warnings

import torch
import torch.distributed as dist
from _memory_checks import CUDA_FIXED_ALLOWANCE, MIB, Check, peak_check

from pipeoffload.api import build_schedule
from pipeoffload.core.schedule import Schedule
from pipeoffload.parallel.topology import Topology, connect, disconnect
from pipeoffload.runtime.config import OffloadConfig, RuntimeConfig
from pipeoffload.runtime.groups import collective_device
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.pipeline import Pipeline
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.simulator import simulate
from pipeoffload.training.host_reserve import measure_stage_bytes
from pipeoffload.training.model import lm_loss
from pipeoffload.training.model_config import model_preset
from pipeoffload.training.split import build_stage_modules

SEQ = 16
LR = 0.1
# Headroom left on the capped device besides the plan (docs/runtime.md, GPU rules: the
# allocator must never reach its out-of-memory path, whose cudaFree synchronises the device).
HEADROOM = 512 * MIB


def part_of(schedule: Schedule, stage: int) -> int:
    """The model part a stage runs (DualPipe's stages j and p + j are both part j)."""
    routes = schedule.routes or (tuple(range(schedule.num_stages)),)
    route = next(r for r in routes if stage in r)
    return stage - route[0]


def batch(vocab: int, size: int, step: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, vocab, (size, SEQ + 1), generator=generator).to(device)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def exactness(name: str, topo: Topology, steps: int) -> list[Check]:
    """Distributed steps of ``name`` against plain autograd on the whole model (item 1)."""
    world, rank, device = topo.pp, topo.pp_rank, topo.device
    schedule = build_schedule(name, pp=world, microbatches=2 * world)
    parts = len(schedule.route_of(0))
    config = dataclasses.replace(model_preset("tiny"), n_layers=max(parts, 2))
    whole = build_stage_modules(config, parts, list(range(parts)), 0, dtype=torch.float64,
                                device=device)
    reference = [whole[p] for p in range(parts)]
    mine = {s: copy.deepcopy(whole[part_of(schedule, s)]) for s in schedule.stages_on_rank(rank)}
    pipe = Pipeline(mine, schedule, lm_loss, group=topo.pp_group, device=device,
                    channel_groups=topo.channel_groups, config=RuntimeConfig(p2p_timeout_s=120))
    sizes = [sum(p.numel() for p in module.parameters()) for module in reference]
    offsets = [sum(sizes[:p]) for p in range(parts)]
    worst_grad = worst_loss = 0.0
    for step in range(steps):
        ids, target = batch(config.vocab_size, 2 * world, step, device)
        for module in [*mine.values(), *reference]:
            module.zero_grad(set_to_none=True)
        loss = pipe.step(ids, target=target)
        flat = torch.zeros(sum(sizes), dtype=torch.float64, device=device)
        for stage, module in mine.items():
            start = offsets[part_of(schedule, stage)]
            flat[start:start + sizes[part_of(schedule, stage)]] += torch.cat(
                [p.grad.reshape(-1) for p in module.parameters()])
        share = torch.tensor([0.0 if loss is None else loss.item()], dtype=torch.float64,
                             device=device)
        dist.all_reduce(flat, group=topo.pp_group)  # DualPipe's twins add up here
        dist.all_reduce(share, group=topo.pp_group)
        losses = []
        for x, t in zip(ids.chunk(schedule.microbatches), target.chunk(schedule.microbatches)):
            h = x
            for module in reference:
                h = module(h)
            losses.append(lm_loss(h, t))
        ref_loss = torch.stack(losses).mean()
        ref_loss.backward()
        ref_flat = torch.cat([p.grad.reshape(-1) for m in reference for p in m.parameters()])
        worst_grad = max(worst_grad, ((flat - ref_flat).norm() / ref_flat.norm()).item())
        worst_loss = max(worst_loss, abs(share.item() - ref_loss.item()) / ref_loss.item())
        with torch.no_grad():  # the same SGD update on both sides, summed gradients on twins
            for stage, module in mine.items():
                start = offsets[part_of(schedule, stage)]
                for p in module.parameters():
                    p -= LR * flat[start:start + p.numel()].view_as(p)
                    start += p.numel()
            for p in (p for m in reference for p in m.parameters()):
                p -= LR * p.grad
    ok = worst_grad <= 1e-10 and worst_loss <= 1e-10
    return [Check(f"{name} p={world} {steps} steps exact", ok,
                  f"largest relative error of gradients {worst_grad:.1e}, of the loss "
                  f"{worst_loss:.1e} against plain autograd (<= 1e-10)")]


def tied_hf(topo: Topology) -> list[Check]:
    """A tied-embedding Llama split over the ranks against the unsplit model (item 2)."""
    try:
        import transformers

        from pipeoffload.hf import causal_lm_loss, split_causal_lm
    except ImportError as error:
        print(f"SKIP tied Hugging Face model: {error} (pip install -e '.[hf]')")
        return []
    world, rank, device = topo.pp, topo.pp_rank, topo.device
    schedule = build_schedule("1f1b", pp=world, microbatches=2 * world)
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2 * world,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=SEQ,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double().to(device)
    ids, _ = batch(32, 2 * world, 0, device)
    reference = copy.deepcopy(model)
    losses = [causal_lm_loss(reference(input_ids=x).logits, x)
              for x in ids.chunk(schedule.microbatches)]
    torch.stack(losses).mean().backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}
    stages = split_causal_lm(model, schedule, rank=rank)
    pipe = Pipeline(stages, schedule, causal_lm_loss, group=topo.pp_group, device=device,
                    channel_groups=topo.channel_groups, config=RuntimeConfig(p2p_timeout_s=120))
    pipe.step({"input_ids": ids}, target=ids)
    held = {id(p) for m in stages.values() for p in m.parameters()}
    worst = max(((p.grad - expected[n]).norm() / expected[n].norm()).item()
                for n, p in model.named_parameters() if id(p) in held)
    return [Check(f"tied Llama p={world}", worst <= 1e-10,
                  f"largest relative gradient error {worst:.1e} (ties {pipe.stats().tied}) "
                  "against the unsplit model (<= 1e-10)")]


def v_near_limit(topo: Topology, steps: int) -> list[Check]:
    """zbv, everything offloaded, on a device capped near the plan's need (item 3)."""
    world, rank, device = topo.pp, topo.pp_rank, topo.device
    schedule = build_schedule("zbv", pp=world, microbatches=2 * world, offload="all")
    config = dataclasses.replace(model_preset("tiny"), n_layers=2 * world)
    stages = build_stage_modules(config, schedule.num_stages, list(schedule.stages_on_rank(rank)),
                                 0, dtype=torch.float32, device=device)
    runtime = RuntimeConfig(p2p_timeout_s=120, offload=OffloadConfig(min_offload_elements=0))
    pipe = Pipeline(stages, schedule, lm_loss, group=topo.pp_group, device=device,
                    channel_groups=topo.channel_groups, config=runtime, meter=ActivationMeter())
    tokens, _ = batch(config.vocab_size, 1, 0, device)  # one microbatch of 2p over 2p
    mine = measure_stage_bytes(stages, 0, schedule.num_stages - 1, tokens,
                               (1, SEQ, config.dim), torch.float32)
    every = torch.zeros(schedule.num_stages, dtype=torch.float64, device=device)
    for stage, nbytes in mine.items():
        every[stage] = nbytes
    dist.all_reduce(every, op=dist.ReduceOp.MAX, group=topo.pp_group)  # every stage's bytes
    sizes = {s: int(b) for s, b in enumerate(every.tolist())}
    pipe.reserve_host_memory(sizes)
    planned = simulate(schedule, CostModel(stage_activation_bytes=tuple(
        sizes[s] for s in range(schedule.num_stages)))).peak_bytes[rank]
    pool = pipe.offloader.host_pool
    allocations = pool.allocations
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        limit = base + planned + 2 * max(sizes.values()) + HEADROOM
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
        torch.cuda.reset_peak_memory_stats(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            ids, target = batch(config.vocab_size, 2 * world, step, device)
            for module in stages.values():
                module.zero_grad(set_to_none=True)
            pipe.step(ids, target=target)
    checks = [Check(f"zbv offloaded p={world}, rank {rank}: no host allocation in a step",
                    pool.allocations == allocations and not caught,
                    f"{pool.allocations - allocations} segment(s) allocated in {steps} steps, "
                    f"pool {pool.allocated_bytes / MIB:.2f} MiB for a need of "
                    f"{pool.last_step_need / MIB:.2f} MiB")]
    if cuda:
        torch.cuda.synchronize(device)
        measured = torch.cuda.max_memory_allocated(device)
        checks.append(peak_check(
            f"zbv offloaded p={world}, rank {rank}: allocator peak", measured, planned + base,
            max(sizes.values()) + CUDA_FIXED_ALLOWANCE,
            "one stage's activation of backward temporaries, workspaces and rounding"))
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    world = int(os.environ["WORLD_SIZE"])
    topo = connect(pp=world, dp=1, device=args.device, timeout_s=args.timeout_s)
    torch.use_deterministic_algorithms(True, warn_only=True)
    checks: list[Check] = []
    try:
        for name in ("zbv", "interleaved-1f1b", "dualpipe"):
            checks += exactness(name, topo, args.steps)
        checks += tied_hf(topo)
        checks += v_near_limit(topo, args.steps)
    finally:
        for check in checks:
            print(f"[rank {topo.rank}] {check.line()}", flush=True)
    failed = torch.tensor([sum(not c.ok for c in checks)],
                          device=collective_device(topo.device or torch.device("cpu")))
    dist.all_reduce(failed)
    if topo.rank == 0:
        print(f"RESULT: {'ok' if failed.item() == 0 else 'FAILED'}: {world} processes on "
              f"{args.device}, {len(checks)} checks per rank, {int(failed.item())} failed in all",
              flush=True)
    disconnect(topo)
    return 0 if failed.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
