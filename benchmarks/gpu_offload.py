"""Activation offload on one GPU: what PipeOffload costs in step time and saves in memory.

Run: python benchmarks/gpu_offload.py [--quick]          (one CUDA GPU, under 8 minutes)
     python benchmarks/gpu_offload.py --device cpu --tiny (the same code path in seconds)

1. Measures pinned device-to-host and host-to-device bandwidth (each alone, then both at once)
   and the bf16 matmul rate (pipeoffload.training.probe's measurements; on CPU: memcpy and fp32).
2. For each size (p ranks, hidden h, sequence s), builds rank 0's two chunks of a grouped
   interleaved pipeline (stages 0 and p, v = 2, g = ceil(p/2); real layers from
   pipeoffload.training.model, stage 0 with the embedding), measures one chunk's F, I and W times
   and saved bytes, and plans three schedules from those costs (CostModel with bytes and the
   measured bandwidths): no offload, po-h (longest-lived chunk offloaded), po-f (all) and
   po-f with --fetch-on-use (activations read back by each backward pass as it uses them).
3. Replays rank 0's action list of each plan with the runtime's own pieces: RankExecutor,
   StageRunner and ActivationOffloader (side streams, pinned pool), with P2P replaced by a
   local stand-in: a forward input whose producer is on another rank, and every output
   gradient, is a fresh copy of a random tensor of the right shape; sends are dropped.
   Rank 0 therefore never waits for its peers, which leaves copies less slack than a real
   pipeline has: the overhead measured here is an upper bound for rank 0.
4. Reports step time and overhead vs no offload, activation memory (CUDA: peak allocated
   minus what was allocated at the start of the step, i.e. parameters, gradients and buffers;
   this includes the backward's temporaries, so it is not the simulator's quantity: the
   runtime's ActivationMeter peak is, and it is printed next to the simulator's), bytes moved,
   achieved copy bandwidth and overlap of copies with compute (from a torch.profiler trace).
   The metered replay runs after the timed one's offloader and pinned pool are freed, so one
   pool exists at a time, the one the fit check counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from _common import best_time, format_table, intersection, machine_summary, union
from _memory_checks import (
    CUDA_FIXED_ALLOWANCE,
    Check,
    host_pool_check,
    peak_check,
    report,
    reserved_check,
)

from pipeoffload.api import plan_schedule
from pipeoffload.offload.plan import OffloadPlan, OffloadPolicy
from pipeoffload.runtime.config import OffloadConfig
from pipeoffload.runtime.executor import RankExecutor, StepData
from pipeoffload.runtime.lowering import with_comms
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.offloader import ActivationOffloader
from pipeoffload.runtime.stage import StageRunner
from pipeoffload.sim.costs import CostModel, Duplex, HostLink
from pipeoffload.training.model import ModelConfig, Transformer

VARIANTS = ("none", "po-h", "po-f", "po-f+fetch")
GIB = 2**30
MIB = 2**20


@dataclass(frozen=True)
class Size:
    pp: int
    hidden: int
    seq: int


@dataclass(frozen=True)
class GpuBenchConfig:
    """What to measure. ``time_budget_s``: sizes predicted to end past it are skipped.
    ``memory_fraction``: a variant runs only if its predicted peak fits this fraction of the
    free device memory (and its offloaded bytes this fraction of the host's memory)."""

    device: str
    sizes: tuple[Size, ...]
    layers_per_chunk: int = 1
    microbatch_size: int = 1
    microbatches_per_rank: int = 1  # m = this * p
    steps: int = 3
    warmup: int = 1
    vocab_size: int = 32000
    dtype: torch.dtype = torch.bfloat16
    copy_bytes: int = 1 << 30
    matmul_size: int = 8192
    time_budget_s: float = 420.0
    memory_fraction: float = 0.85
    tiny: bool = False
    variants: tuple[str, ...] = VARIANTS
    max_pending_copy_bytes: int | None = None
    predict_scale: float = 1.0  # != 1 feeds the checks a wrong prediction (they must fail)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def unit(self) -> tuple[int, str]:
        """Memory unit of the tables: MiB at the tiny size, GiB otherwise."""
        return (MIB, "MiB") if self.tiny else (GIB, "GiB")


@dataclass(frozen=True)
class Links:
    d2h: float
    h2d: float
    d2h_both: float
    h2d_both: float
    matmul_flops: float

    @property
    def duplex(self) -> Duplex:
        full = self.d2h_both >= 0.75 * self.d2h and self.h2d_both >= 0.75 * self.h2d
        return Duplex.FULL if full else Duplex.HALF


def measure_links(cfg: GpuBenchConfig) -> Links:
    """Pinned copy bandwidth and matmul rate (CUDA); memcpy and fp32 matmul on CPU."""
    if cfg.cuda:
        from pipeoffload.training.probe import measure_copies, measure_matmul

        index = torch.device(cfg.device).index or 0
        copies = measure_copies(cfg.copy_bytes, 5, device=index)
        return Links(*copies, measure_matmul(cfg.matmul_size, 10, device=index))
    a, b = torch.empty(cfg.copy_bytes, dtype=torch.uint8), torch.empty(cfg.copy_bytes,
                                                                        dtype=torch.uint8)
    copy = best_time(lambda: b.copy_(a), 3)
    n = cfg.matmul_size
    x, y = torch.randn(n, n), torch.randn(n, n)
    mm = best_time(lambda: torch.matmul(x, y), 3)
    rate = cfg.copy_bytes / copy
    return Links(rate, rate, rate, rate, 2 * n**3 / mm)


def model_config(cfg: GpuBenchConfig, size: Size) -> ModelConfig:
    """Llama-like layer shapes: head_dim 128 (16 on --tiny), 8 KV heads, SwiGLU ~2.7 h."""
    heads = max(2, size.hidden // (16 if cfg.tiny else 128))
    kv = 2 if cfg.tiny else min(8, heads)
    ffn = 256 * math.ceil(8 * size.hidden / 3 / 256) if not cfg.tiny else 3 * size.hidden
    return ModelConfig(vocab_size=cfg.vocab_size, dim=size.hidden,
                       n_layers=2 * size.pp * cfg.layers_per_chunk, n_heads=heads,
                       n_kv_heads=kv, ffn_hidden=ffn, max_seq_len=size.seq)


def rank0_modules(cfg: GpuBenchConfig, size: Size) -> dict[int, torch.nn.Module]:
    """Stages 0 (embedding + L layers) and p (L layers) of a 2p-stage looped placement.
    Weights are drawn on the device: their values do not change the timing."""
    mc, layers = model_config(cfg, size), cfg.layers_per_chunk
    modules = {}
    for stage in (0, size.pp):
        ids = range(stage * layers, (stage + 1) * layers)
        module = Transformer(mc, ids, embedding=stage == 0, head=False)
        module = module.to(device=cfg.device, dtype=cfg.dtype)
        with torch.no_grad():
            for p in module.parameters():
                p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, 0.02)
        modules[stage] = module
    return modules


def _sync(cfg: GpuBenchConfig) -> None:
    if cfg.cuda:
        torch.cuda.synchronize(cfg.device)


class FakeTransport:
    """P2P stand-in for one rank replayed alone: receives are fresh copies of random tensors
    of the right shape (forward: [b, s, h]; gradients: the shapes the executor asks for)."""

    def __init__(self, cfg: GpuBenchConfig, size: Size) -> None:
        self._cfg = cfg
        self._hidden = (cfg.microbatch_size, size.seq, size.hidden)
        self._sources: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}

    def _fresh(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        if key not in self._sources:
            self._sources[key] = torch.randn(shape, dtype=dtype, device=self._cfg.device)
        return self._sources[key].clone()

    def recv(self, message: object, peer: int, meta: object, action: object) -> tuple:
        if meta is None:
            return (self._fresh(self._hidden, self._cfg.dtype),)
        return tuple(self._fresh(shape, dtype) * 1e-3 for shape, dtype in meta)  # type: ignore[union-attr]

    def send(self, message: object, tensors: object, peer: int, action: object) -> None:
        pass

    def begin_step(self) -> None:
        pass

    def finish(self) -> None:
        pass

    def abandon(self) -> None:
        pass


class CountingOffloader(ActivationOffloader):
    """The runtime's offloader, counting the bytes each OFFLOAD and RELOAD moves (FETCH reads:
    ``fetched_bytes``)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.d2h_bytes = 0
        self.h2d_bytes = 0

    def offload(self, key: Hashable) -> None:
        super().offload(key)
        self.d2h_bytes += self.host_bytes(key)

    def reload(self, key: Hashable) -> None:
        # Storages whose copy out was not seen complete stay on the device: nothing comes back.
        self.h2d_bytes += self.host_bytes(key) - self.device_bytes(key)
        super().reload(key)


@dataclass(frozen=True)
class ChunkCosts:
    f_s: float
    i_s: float
    w_s: float
    stage0_bytes: int
    chunk_bytes: int


def measure_chunk(cfg: GpuBenchConfig, size: Size, modules: dict[int, torch.nn.Module],
                  transport: FakeTransport) -> ChunkCosts:
    """F, I, W seconds of the middle chunk (median of 3 after one warm-up) and the saved
    bytes of one microbatch on stage 0 and on stage p (ActivationMeter scopes)."""
    meter = ActivationMeter()
    meter.exclude([p for m in modules.values() for p in m.parameters()])
    ids = torch.randint(0, cfg.vocab_size, (cfg.microbatch_size, size.seq), device=cfg.device)
    sizes, times = {}, {"F": [], "I": [], "W": []}
    for stage, module in modules.items():
        runner = StageRunner(stage, module, stage == 0, False, lambda *a: a[0], 1)
        for rep in range(4):
            inputs = (ids,) if stage == 0 else transport.recv(None, 0, None, None)
            _sync(cfg)
            start = time.perf_counter()
            with meter.scope(0, (stage, rep)):
                out = runner.forward(0, inputs, (), meter.observe(0))
            del inputs
            _sync(cfg)
            middle = time.perf_counter()
            runner.backward(0, transport.recv(None, 0, [(o.shape, o.dtype) for o in out], None),
                            split=True)
            _sync(cfg)
            after_i = time.perf_counter()
            runner.weight(0)
            _sync(cfg)
            end = time.perf_counter()
            sizes[stage] = meter.scope_bytes[(stage, rep)]
            if stage != 0 and rep > 0:
                times["F"].append(middle - start)
                times["I"].append(after_i - middle)
                times["W"].append(end - after_i)
            del out
    for m in modules.values():
        m.zero_grad(set_to_none=False)
    med = {k: statistics.median(v) for k, v in times.items()}
    return ChunkCosts(med["F"], med["I"], med["W"], sizes[0], sizes[size.pp])


def cost_model(costs: ChunkCosts, links: Links, size: Size) -> CostModel:
    stage_bytes = (costs.stage0_bytes,) + (costs.chunk_bytes,) * (2 * size.pp - 1)
    return CostModel(f_time=costs.f_s, i_time=costs.i_s, w_time=costs.w_s,
                     stage_activation_bytes=stage_bytes, d2h_bytes_per_s=links.d2h,
                     h2d_bytes_per_s=links.h2d, host_link=HostLink(duplex=links.duplex))


def plans(cfg: GpuBenchConfig, size: Size, costs: CostModel) -> dict[str, OffloadPlan]:
    m = cfg.microbatches_per_rank * size.pp
    return {
        "none": plan_schedule("po-f", size.pp, m, offload="none", costs=costs),
        "po-h": plan_schedule("po-h", size.pp, m, costs=costs),
        "po-f": plan_schedule("po-f", size.pp, m, costs=costs),
        "po-f+fetch": plan_schedule("po-f", size.pp, m, costs=costs,
                                    policy=OffloadPolicy(fetch_on_use=True)),
    }


@dataclass
class Replay:
    """Rank 0 of ``plan`` run by the runtime's executor, alone."""

    cfg: GpuBenchConfig
    size: Size
    plan: OffloadPlan
    modules: dict[int, torch.nn.Module]
    transport: FakeTransport

    def __post_init__(self) -> None:
        self.actions = with_comms(self.plan.schedule)

    def executor(self, meter: ActivationMeter | None) -> tuple[RankExecutor,
                                                               CountingOffloader | None]:
        schedule = self.plan.schedule
        last = schedule.num_stages - 1
        runners = {s: StageRunner(s, m, s == 0, s == last, lambda *a: a[0], schedule.microbatches)
                   for s, m in self.modules.items()}
        params = [p for m in self.modules.values() for p in (*m.parameters(), *m.buffers())]
        if meter is not None:
            meter.exclude(params)
        offloader = None
        if self.plan.report.offloaded:
            offloader = CountingOffloader(
                torch.device(self.cfg.device),
                OffloadConfig(max_pending_copy_bytes=self.cfg.max_pending_copy_bytes),
                params, meter)
        executor = RankExecutor(0, self.actions, runners, self.transport, offloader,  # type: ignore[arg-type]
                                meter, True, True)
        return executor, offloader

    def step(self, executor: RankExecutor, offloader: ActivationOffloader | None) -> None:
        m = self.plan.schedule.microbatches
        ids = [(torch.randint(0, self.cfg.vocab_size, (self.cfg.microbatch_size, self.size.seq),
                              device=self.cfg.device),) for _ in range(m)]
        data = StepData(list(ids), [() for _ in range(m)])
        for action in self.actions.ranks[0]:
            executor.run(action, data)
        executor.finish()
        if offloader is not None:
            offloader.finish()

    def zero_grads(self) -> None:
        for module in self.modules.values():
            for p in module.parameters():
                if p.grad is not None:
                    p.grad.zero_()


def profile_copies(replay: Replay, executor: RankExecutor,
                   offloader: ActivationOffloader | None) -> dict[str, float]:
    """One profiled step: busy seconds of D2H and H2D copies and the fraction of copy time
    during which a compute kernel ran too (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        replay.step(executor, offloader)
        _sync(replay.cfg)
    d2h, h2d, kernels = [], [], []
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        span = (event.time_range.start, event.time_range.end)
        if "DtoH" in event.name:
            d2h.append(span)
        elif "HtoD" in event.name:
            h2d.append(span)
        elif not event.name.startswith(("Memcpy", "Memset")):
            kernels.append(span)
    d2h, h2d, kernels = union(d2h), union(h2d), union(kernels)
    copies = union(d2h + h2d)
    busy = sum(e - s for s, e in copies)
    return {"d2h_s": sum(e - s for s, e in d2h) / 1e6, "h2d_s": sum(e - s for s, e in h2d) / 1e6,
            "overlap": intersection(copies, kernels) / busy if busy else float("nan")}


def run_variant(cfg: GpuBenchConfig, size: Size, name: str, plan: OffloadPlan,
                modules: dict[int, torch.nn.Module], transport: FakeTransport) -> dict:
    replay = Replay(cfg, size, plan, modules, transport)
    executor, offloader = replay.executor(None)
    times = []
    for index in range(cfg.warmup + cfg.steps):
        replay.zero_grads()
        _sync(cfg)
        start = time.perf_counter()
        replay.step(executor, offloader)
        _sync(cfg)
        if index >= cfg.warmup:
            times.append(time.perf_counter() - start)
    row = {"step_s": statistics.median(times), "spread": (min(times), max(times))}
    if offloader is not None:
        row["d2h_bytes"] = offloader.d2h_bytes / (cfg.warmup + cfg.steps)
        row["h2d_bytes"] = ((offloader.h2d_bytes + offloader.fetched_bytes)
                            / (cfg.warmup + cfg.steps))
    if cfg.cuda:
        replay.zero_grads()
        _sync(cfg)
        base = torch.cuda.memory_allocated(cfg.device)
        torch.cuda.reset_peak_memory_stats(cfg.device)
        replay.step(executor, offloader)
        _sync(cfg)
        row["base_bytes"] = base
        row["alloc_peak_abs"] = torch.cuda.max_memory_allocated(cfg.device)
        row["alloc_peak"] = row["alloc_peak_abs"] - base
        row["reserved_peak"] = torch.cuda.max_memory_reserved(cfg.device)
        if offloader is not None:
            row.update(profile_copies(replay, executor, offloader))
            row["max_pending_bytes"] = offloader.max_pending_bytes_seen
    if offloader is not None:
        row["pool_bytes"] = offloader.host_pool_bytes
        row["pool_need_bytes"] = offloader.host_pool_need_bytes
        if cfg.cuda:
            stats = torch.cuda.host_memory_stats()
            row["torch_pinned_bytes"] = stats.get("allocated_bytes.all.current", 0)
    del executor, offloader
    _release(cfg)  # one pinned pool at a time: the metered replay builds its own
    meter = ActivationMeter()
    metered, metered_offloader = replay.executor(meter)
    replay.step(metered, metered_offloader)
    _sync(cfg)
    row["meter_peak"] = meter.peak_bytes(0)
    # Saved tensors the offloader keeps on the device (at most min_offload_elements each): the
    # meter counts them, the simulator, which moves whole activations, does not.
    row["kept_small_bytes"] = (metered_offloader.kept_bytes.get("small", 0)
                               if metered_offloader is not None else 0)
    if not cfg.cuda:
        row["base_bytes"] = sum(t.numel() * t.element_size() for m in modules.values()
                                for p in m.parameters()
                                for t in (p, p.grad) if t is not None)
    return row


def memory_checks(cfg: GpuBenchConfig, name: str, row: dict, sim_peak: float,
                  stage_bytes: int) -> list[Check]:
    """The comparisons of benchmarks/_memory_checks.py for one variant's row: the peak against
    the simulator's (times ``cfg.predict_scale``) plus what was allocated before the step, the
    allocator's reserved bytes, the host pool against its need and torch's pinned bytes."""
    predicted = cfg.predict_scale * sim_peak + row["base_bytes"]
    if cfg.cuda:
        allowance = row["kept_small_bytes"] + stage_bytes + CUDA_FIXED_ALLOWANCE
        checks = [
            peak_check(f"{name} allocator peak", row["alloc_peak_abs"], predicted, allowance,
                       "small saved tensors kept on the device, one stage's activation of "
                       "temporaries in a backward, workspaces and allocator rounding"),
            reserved_check(f"{name} reserved", row["reserved_peak"], row["alloc_peak_abs"])]
    else:
        checks = [peak_check(f"{name} meter peak", row["meter_peak"] + row["base_bytes"],
                             predicted, row["kept_small_bytes"],
                             "on CPU the meter equals the simulator but for the small saved "
                             "tensors the offloader keeps on the device")]
    if "pool_bytes" in row and row["pool_need_bytes"]:
        checks.append(host_pool_check(f"{name} host pool", row["pool_bytes"],
                                      row["pool_need_bytes"], row.get("torch_pinned_bytes")))
    return checks


def _fits(cfg: GpuBenchConfig, plan: OffloadPlan) -> str | None:
    """Why ``plan`` would not fit this machine, or None. Parameters and gradients are
    allocated already (measure_chunk ran a W), so free memory is what activations can use;
    the 1.25 leaves room for the temporaries of a backward."""
    peak = plan.result.peak_bytes[0] if plan.result.peak_bytes else 0.0
    if cfg.cuda:
        free, _ = torch.cuda.mem_get_info(cfg.device)
        if 1.25 * peak > cfg.memory_fraction * free:
            return f"needs ~{1.25 * peak / GIB:.0f} GiB of {free / GIB:.0f} free"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    # At most the unoffloaded peak is on the host at once; the pool registers exactly its
    # segments and keeps at most 1.5 times its need (runtime/pool.py Note: [host pool]).
    moved = 1.5 * (plan.report.peak_bytes_before[0] if plan.report.peak_bytes_before else 0.0)
    if plan.report.offloaded and moved > cfg.memory_fraction * host:
        return f"host buffers up to ~{moved / GIB:.0f} GiB > {host / GIB:.0f} GiB available"
    return None


def bench_size(cfg: GpuBenchConfig, size: Size, links: Links,
               deadline: float) -> tuple[list[list], list[dict]]:
    """Table rows and raw records (bytes, seconds) of the three variants at ``size``."""
    modules = rank0_modules(cfg, size)
    transport = FakeTransport(cfg, size)
    chunk = measure_chunk(cfg, size, modules, transport)
    costs = cost_model(chunk, links, size)
    planned = plans(cfg, size, costs)
    chunk_s = chunk.f_s + chunk.i_s + chunk.w_s
    step_estimate = 2 * planned["none"].schedule.microbatches * chunk_s
    steps_per_variant = cfg.warmup + cfg.steps + 3
    label = f"p={size.pp} h={size.hidden} s={size.seq}"
    unit, unit_name = cfg.unit
    print(f"\n{label}: m={planned['none'].schedule.microbatches}, {cfg.layers_per_chunk} layer(s) "
          f"per chunk, chunk F/I/W {chunk.f_s * 1e3:.1f}/{chunk.i_s * 1e3:.1f}/"
          f"{chunk.w_s * 1e3:.1f} ms, saved bytes per microbatch: stage 0 "
          f"{chunk.stage0_bytes / unit:.3f} {unit_name}, chunk {chunk.chunk_bytes / unit:.3f} "
          f"{unit_name}; "
          f"one-way copy / (F+I+W) = {chunk.chunk_bytes / links.d2h / chunk_s:.2f}", flush=True)
    rows, records, base = [], [], None
    for name in cfg.variants:
        plan = planned[name]
        sim = plan.result
        sim_busy = sim.compute_time[0] + sim.stall_time[0]
        why = _fits(cfg, plan)
        if why is None and time.perf_counter() + steps_per_variant * step_estimate > deadline:
            why = "time budget"
        if why is not None:
            rows.append([label, name, "skipped: " + why] + [""] * (len(HEADERS) - 3))
            records.append({"size": dataclasses.asdict(size), "variant": name, "skipped": why})
            continue
        row = run_variant(cfg, size, name, plan, modules, transport)
        _release(cfg)
        if name == "none":
            base = (row["step_s"], sim_busy, sim.makespan)
        checks = memory_checks(cfg, f"{label} {name}", row,
                               sim.peak_bytes[0] if sim.peak_bytes else 0.0,
                               max(chunk.stage0_bytes, chunk.chunk_bytes))
        row["checks"] = [dataclasses.asdict(c) for c in checks]
        records.append({"size": dataclasses.asdict(size), "variant": name, **row,
                        "offloaded_fraction": plan.report.offloaded_fraction,
                        "sim_peak_bytes": sim.peak_bytes[0] if sim.peak_bytes else None,
                        "sim_busy_s": sim_busy, "sim_makespan_s": sim.makespan})
        moved, back = row.get("d2h_bytes", 0.0), row.get("h2d_bytes", 0.0)
        d2h_s, h2d_s = row.get("d2h_s"), row.get("h2d_s")
        rows.append([
            label, name, f"{plan.report.offloaded_fraction:.2f}",
            f"{row['step_s']:.3f} ({row['spread'][0]:.3f}-{row['spread'][1]:.3f})",
            f"{row['step_s'] / base[0] - 1:+.1%}" if base else "n/a",
            f"{row['alloc_peak'] / unit:.2f}" if "alloc_peak" in row else "n/a (CPU)",
            f"{row['meter_peak'] / unit:.3f}",
            f"{sim.peak_bytes[0] / unit:.3f}" if sim.peak_bytes else "n/a",
            f"{moved / unit:.2f}",
            f"{moved / d2h_s / 1e9:.1f}" if d2h_s else "n/a",
            f"{back / h2d_s / 1e9:.1f}" if h2d_s else "n/a",
            f"{row['overlap']:.0%}" if "overlap" in row else "n/a",
            f"{sim_busy:.3f}",
            f"{sim_busy / base[1] - 1:+.1%}" if base else "n/a",
            f"{sim.makespan / base[2] - 1:+.1%}" if base else "n/a",
        ])
    del modules, transport
    _release(cfg)
    return rows, records


def _release(cfg: GpuBenchConfig) -> None:
    """Free what a finished replay held: executors hold reference cycles (bound handlers), and
    pinned host buffers stay cached by torch's host allocator unless emptied."""
    gc.collect()
    if cfg.cuda:
        torch.cuda.empty_cache()
        if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "empty_host_cache"):
            torch.accelerator.empty_host_cache()


HEADERS = ["size", "offload", "offloaded fraction", "step s median (min-max)", "vs none",
           "alloc. peak (incl. temporaries)", "act. peak (meter)", "sim peak", "D2H per step",
           "D2H GB/s achieved", "H2D GB/s achieved", "copy overlap", "sim rank-0 busy s",
           "sim busy vs none", "sim makespan vs none"]

DEFAULT_SIZES = (Size(8, 4096, 4096), Size(8, 4096, 16384), Size(8, 8192, 8192),
                 Size(16, 4096, 8192))
QUICK_SIZES = (Size(8, 4096, 4096), Size(16, 4096, 4096))
TINY_SIZES = (Size(8, 64, 32), Size(16, 64, 32))


def parse_args(argv: list[str] | None = None) -> tuple[GpuBenchConfig, str | None]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    parser.add_argument("--tiny", action="store_true",
                        help="h=64, s=32, 2 layers per chunk, fp32 (for tests and CPU)")
    parser.add_argument("--quick", action="store_true", help="two small sizes only")
    parser.add_argument("--sizes", default=None,
                        help="comma separated PxHxS, e.g. 8x4096x4096,16x4096x8192")
    parser.add_argument("--layers-per-chunk", type=int, default=None)
    parser.add_argument("--microbatches-per-rank", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--time-budget-s", type=float, default=420.0)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma separated, among {', '.join(VARIANTS)} (none is the "
                        "baseline of the 'vs none' columns and always runs)")
    parser.add_argument("--max-pending-copy-mib", type=float, default=None,
                        help="OffloadConfig.max_pending_copy_bytes, in MiB (default: no cap)")
    parser.add_argument("--json", metavar="FILE", default=None,
                        help="also write the raw numbers (bytes, seconds) as JSON")
    parser.add_argument("--predict-scale", type=float, default=1.0,
                        help="multiply the simulator's predicted peaks in the memory checks "
                        "(to see them fail; default 1)")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else None)
    if device is None:
        parser.error("no CUDA device; pass --device cpu --tiny to run the CPU path")
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {device} but torch sees no CUDA device")
    if args.sizes:
        try:
            sizes = tuple(Size(*(int(x) for x in item.split("x")))
                          for item in args.sizes.split(","))
        except (TypeError, ValueError):
            parser.error(f"--sizes {args.sizes!r}: write PxHxS items, e.g. 8x4096x4096")
    else:
        sizes = TINY_SIZES if args.tiny else QUICK_SIZES if args.quick else DEFAULT_SIZES
    tiny = dict(dtype=torch.float32, vocab_size=256, copy_bytes=1 << 22, matmul_size=256,
                layers_per_chunk=2) if args.tiny else {}
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants {unknown}: choose among {', '.join(VARIANTS)}")
    variants = ("none",) + tuple(v for v in VARIANTS[1:] if v in variants)
    cap = None if args.max_pending_copy_mib is None else int(args.max_pending_copy_mib * MIB)
    cfg = GpuBenchConfig(device=device, sizes=sizes, steps=args.steps, warmup=args.warmup,
                         microbatches_per_rank=args.microbatches_per_rank,
                         time_budget_s=args.time_budget_s, tiny=args.tiny, variants=variants,
                         max_pending_copy_bytes=cap, predict_scale=args.predict_scale, **tiny)
    if args.layers_per_chunk is not None:
        cfg = dataclasses.replace(cfg, layers_per_chunk=args.layers_per_chunk)
    return cfg, args.json


def summary(records: list[dict]) -> str:
    """One line per offloading variant of the first size that ran: step-time overhead and
    activation cut vs none, copy overlap, meter vs simulated peak (for gpu_check.sh)."""
    ran = [r for r in records if "step_s" in r]
    if not ran:
        return "nothing ran"
    size = ran[0]["size"]
    base = next((r for r in ran if r["size"] == size and r["variant"] == "none"), None)
    parts = []
    for r in ran:
        if r["size"] != size or r["variant"] == "none" or base is None:
            continue
        cut = 1 - r["meter_peak"] / base["meter_peak"] if base["meter_peak"] else float("nan")
        overlap = f"{r['overlap']:.0%}" if "overlap" in r else "n/a"
        sim = r.get("sim_peak_bytes")
        parts.append(f"{r['variant']} step {r['step_s'] / base['step_s'] - 1:+.1%}, "
                     f"activations -{cut:.0%}, overlap {overlap}, meter/sim peak "
                     + (f"{r['meter_peak'] / sim:.2f}" if sim else "n/a"))
    return "; ".join(parts) or "no offloading variant ran"


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    cfg, json_path = parse_args(argv)
    torch.manual_seed(0)
    if not cfg.cuda:
        torch.set_num_threads(1)  # tiny ops: thread wake-ups cost more than they save
    print(machine_summary())
    links = measure_links(cfg)
    kind = "pinned" if cfg.cuda else "host memcpy"
    print(f"{kind} D2H {links.d2h / 1e9:.1f} GB/s, H2D {links.h2d / 1e9:.1f} GB/s, both at once "
          f"{links.d2h_both / 1e9:.1f} + {links.h2d_both / 1e9:.1f} GB/s ({links.duplex.value} "
          f"duplex); {'bf16' if cfg.cuda else 'fp32'} matmul {links.matmul_flops / 1e12:.2f} "
          f"TFLOP/s", flush=True)
    deadline = started + cfg.time_budget_s
    rows, records = [], []
    for size in cfg.sizes:
        size_rows, size_records = bench_size(cfg, size, links, deadline)
        rows.extend(size_rows)
        records.extend(size_records)
    print("\nRank 0 of a grouped-interleaved pipeline (v=2, g=ceil(p/2)) replayed alone; "
          "P2P replaced by local random tensors")
    print(f"memory columns in {cfg.unit[1]}; copy columns need CUDA (profiler trace)")
    print(format_table(HEADERS, rows))
    print(f"total {time.perf_counter() - started:.0f} s")
    checks = [Check(**c) for r in records for c in r.get("checks", ())]
    passed = report(checks)
    print("RESULT: " + ("" if passed else "memory checks FAILED; ") + summary(records)
          + f"; {sum(c.ok for c in checks)}/{len(checks)} memory checks ok")
    if json_path:
        with open(json_path, "w") as out:
            json.dump({"links": dataclasses.asdict(links), "rows": records}, out, indent=1)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
