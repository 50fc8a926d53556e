"""pipeoffload's runtime against torch.distributed.pipelining on the same model, ranks,
microbatches and schedule, over gloo with one real process per rank.

Run: python benchmarks/vs_torch.py [--microbatches 8] [--reps 7] [--steps 4]
         [--sizes tiny:8:2,small:2:4] [--schedules 1f1b,interleaved-1f1b,zbv,po-f]
         [--transport-baseline]

A size is MODEL:ROWS[:PP]: a model preset of training/model.py, the rows (sequences) per
microbatch, and the pipeline ranks (``--pp`` when left out); each size runs in its own process
group. ``--model`` / ``--microbatch-size`` / ``--pp`` name one size instead. The default runs
the tiny model (4 layers) with 8 rows per microbatch on 2 ranks, where per-action overhead
shows most, and the small model (8 layers) with 2 rows on 4 ranks; the V and interleaved
schedules need 2 * PP stages of at least one layer each.

Per schedule (1F1B, interleaved 1F1B with 2 chunks, ZB-V) both runtimes drive identical stage
modules (pipeoffload.training.split.build_stage_modules, one seed): torch through PipelineStage and
its Schedule1F1B / ScheduleInterleaved1F1B / ScheduleZBVZeroBubble, pipeoffload through
Pipeline with its own schedule of the same name. ``po-f`` is pipeoffload's PipeOffload preset
(grouped interleaved, full offload) on its own modules; it is compared with torch's 1F1B (time
and memory) and with the same schedule without offload (what the offload itself costs).
Ours runs as ``train`` does, one process group per message channel
(runtime/groups.new_channel_groups); ``--transport-baseline`` adds our runtime with every message
on one group and receives posted 2 compute actions ahead (the layout before issue 15), so the
gain from channels and earlier receives is measured in the same run.
All variants run in one process group, alternated (A, B, ..., then reversed) in every
repetition after a warm-up, each process with one torch thread. Step time is rank 0's wall
time between two barriers over ``--steps`` steps. Resident activation is measured on a
separate, untimed step of each variant by one ActivationMeter kind: Pipeline's meter for
pipeoffload, ``ActivationMeter.observe`` (pass-through saved_tensors_hooks) around torch's
``step``, so both count the same thing: bytes of distinct saved-tensor storages that are not
parameters. The same step also checks that both runtimes compute the same loss and gradients.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import format_table, free_port, machine_summary, mib, spread

from pipeoffload import build_schedule, plan_schedule, simulate
from pipeoffload.core.schedule import Schedule
from pipeoffload.runtime.config import OffloadConfig, RuntimeConfig
from pipeoffload.runtime.groups import new_channel_groups
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.pipeline import Pipeline
from pipeoffload.sim.costs import CostModel
from pipeoffload.training.model import lm_loss
from pipeoffload.training.model_config import MODEL_PRESETS, ModelConfig, model_preset
from pipeoffload.training.split import build_stage_modules

# schedule name -> (our build_schedule options, torch class name, torch placement style)
SCHEDULES: dict[str, tuple[dict[str, int], str, str]] = {
    "1f1b": ({}, "Schedule1F1B", "loop"),
    "interleaved-1f1b": ({"chunks": 2}, "ScheduleInterleaved1F1B", "loop"),
    "zbv": ({}, "ScheduleZBVZeroBubble", "v"),
}
POF = "po-f"
POF_NONE = "po-f-none"  # po-f's schedule without offload: separates the offload's cost
BASELINE = "ours one group"  # --transport-baseline: our runtime as it was before issue 15


@dataclass(frozen=True)
class BenchConfig:
    """What to run; ``offload_ratio`` None means: measure it on this machine (see
    ``measure_offload_ratio``)."""

    pp: int = 4
    microbatches: int = 8
    microbatch_size: int = 2
    seq_len: int | None = None  # None: the model's max_seq_len
    reps: int = 7
    steps: int = 4
    warmup: int = 1
    model: str = "small"
    schedules: tuple[str, ...] = ("1f1b", "interleaved-1f1b", "zbv", POF)
    sizes: tuple[tuple[str, int, int], ...] = (("tiny", 8, 2), ("small", 2, 4))
    offload_ratio: float | None = None
    transport_baseline: bool = False  # also run ours on one group, receives posted 2 ahead
    timeout_s: float = 120.0
    seed: int = 0
    min_offload_elements: int = 0
    profile_dir: str | None = None
    json_path: str | None = None

    @property
    def model_config(self) -> ModelConfig:
        return model_preset(self.model)

    @property
    def tokens(self) -> int:
        return self.seq_len or self.model_config.max_seq_len

    @property
    def size_label(self) -> str:
        return f"{self.model}:{self.microbatch_size}:{self.pp}"


def torch_stage_to_rank(style: str, pp: int, num_stages: int) -> tuple[int, ...]:
    """Where torch.distributed.pipelining places stage s (its "loop" and "v" styles)."""
    if style == "v":
        return tuple(s if s < pp else 2 * pp - 1 - s for s in range(num_stages))
    return tuple(s % pp for s in range(num_stages))


def our_schedule(name: str, cfg: BenchConfig, offload_ratio: float) -> Schedule:
    if name in (POF, POF_NONE):
        offload = "none" if name == POF_NONE else None
        return plan_schedule(POF, cfg.pp, cfg.microbatches, offload,
                             offload_ratio=offload_ratio).schedule
    return build_schedule(name, cfg.pp, cfg.microbatches, **SCHEDULES[name][0])


def make_batch(cfg: BenchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets [batch, seq], the same in every process."""
    generator = torch.Generator().manual_seed(cfg.seed)
    shape = (cfg.microbatches * cfg.microbatch_size, cfg.tokens + 1)
    tokens = torch.randint(0, cfg.model_config.vocab_size, shape, generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@dataclass
class Variant:
    """One runtime on one schedule, as seen from this process."""

    label: str
    step: Callable[[], torch.Tensor | None]
    measured: Callable[[ActivationMeter], torch.Tensor | None]
    params: list[torch.nn.Parameter]
    stage_bytes: Callable[[], dict[int, int]] = dict


def _zero(params: list[torch.nn.Parameter]) -> None:
    for p in params:
        p.grad = None


Batch = tuple[torch.Tensor, torch.Tensor]


def _torch_variant(name: str, sched: Schedule, modules: dict[int, torch.nn.Module],
                   rank: int, cfg: BenchConfig, batch: Batch) -> Variant:
    from torch.distributed import pipelining

    _, cls_name, style = SCHEDULES[name]
    expected = torch_stage_to_rank(style, cfg.pp, sched.num_stages)
    if tuple(sched.stage_to_rank) != expected:
        raise RuntimeError(f"our {name} places stages as {sched.stage_to_rank}, torch's "
                           f"{cls_name} as {expected}; they must hold the same modules")
    stages = [pipelining.PipelineStage(modules[s], s, sched.num_stages, torch.device("cpu"))
              for s in sorted(modules)]
    cls = getattr(pipelining, cls_name)
    torch_sched = cls(stages[0] if cls_name == "Schedule1F1B" else stages,
                      cfg.microbatches, loss_fn=lm_loss)
    first, last = 0 in modules, sched.num_stages - 1 in modules
    ids, target = batch
    params = [p for m in modules.values() for p in m.parameters()]

    def step() -> torch.Tensor | None:
        _zero(params)
        losses: list[torch.Tensor] = []
        kwargs = {"target": target, "losses": losses} if last else {}
        torch_sched.step(*((ids,) if first else ()), return_outputs=False, **kwargs)
        return torch.stack(losses).mean() if last else None

    def measured(meter: ActivationMeter) -> torch.Tensor | None:
        meter.exclude(params)
        with meter.observe(rank):
            return step()

    return Variant(f"torch {name}", step, measured, params)


def _our_variant(name: str, sched: Schedule, modules: dict[int, torch.nn.Module],
                 rank: int, cfg: BenchConfig, batch: Batch, baseline: bool = False) -> Variant:
    # min_offload_elements=0: every saved tensor moves, which is what the simulator models
    # (OffloadConfig's docstring); the default 1024 keeps tiny tensors on the device.
    runtime = RuntimeConfig(p2p_timeout_s=cfg.timeout_s,
                            offload=OffloadConfig(min_offload_elements=cfg.min_offload_elements))
    # As `train` runs: one group per channel (groups.new_channel_groups). The baseline: every
    # message on the default group, receives posted 2 compute actions ahead.
    channels = None
    if baseline:
        runtime = dataclasses.replace(runtime, recv_lookahead=2)
    else:
        channels = new_channel_groups(list(range(cfg.pp)))
    timed = Pipeline(modules, sched, lm_loss, config=runtime, channel_groups=channels)
    params = [p for m in modules.values() for p in m.parameters()]
    ids, target = batch
    meters: list[ActivationMeter] = []

    def step() -> torch.Tensor | None:
        _zero(params)
        return timed.step(ids, target=target)

    def measured(meter: ActivationMeter) -> torch.Tensor | None:
        # A Pipeline takes its meter when built; this one is used for the untimed step only.
        metered = Pipeline(modules, sched, lm_loss, config=runtime, meter=meter,
                           channel_groups=channels)
        meters.append(meter)
        _zero(params)
        return metered.step(ids, target=target)

    def stage_bytes() -> dict[int, int]:
        sizes: dict[int, int] = {}
        for (stage, _), nbytes in meters[-1].scope_bytes.items():
            sizes[stage] = max(sizes.get(stage, 0), nbytes)
        return sizes

    label = f"{BASELINE} {name}" if baseline else f"ours {name}"
    return Variant(label, step, measured, params, stage_bytes)


def build_variants(cfg: BenchConfig, rank: int, offload_ratio: float) -> list[Variant]:
    batch = make_batch(cfg)
    variants = []
    names = [*cfg.schedules, *([POF_NONE] if POF in cfg.schedules else [])]
    for name in names:
        sched = our_schedule(name, cfg, offload_ratio)
        # Each variant builds its own modules (same seed, so the same weights): sharing them
        # across runtimes would let one runtime's leftover state touch the other's numbers.
        def make(s: Schedule = sched) -> dict[int, torch.nn.Module]:
            return build_stage_modules(cfg.model_config, s.num_stages, s.stages_on_rank(rank),
                                       cfg.seed)

        if name in SCHEDULES:
            variants.append(_torch_variant(name, sched, make(), rank, cfg, batch))
            if cfg.transport_baseline:
                variants.append(_our_variant(name, sched, make(), rank, cfg, batch, True))
        variants.append(_our_variant(name, sched, make(), rank, cfg, batch))
    return variants


def _max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for key, x in a.items():
        y = b[key]
        worst = max(worst, ((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item())
    return worst


def worker(rank: int, cfg: BenchConfig, port: int, out_path: str, offload_ratio: float) -> None:
    """One pipeline rank: build every variant, time them alternately, measure memory."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=cfg.pp)
    try:
        result = _run(rank, cfg, offload_ratio)
        gathered: list[object] = [None] * cfg.pp
        dist.all_gather_object(gathered, result)
        if rank == 0:
            merged = gathered[0]
            merged["peaks"] = {label: [g["peaks"][label] for g in gathered]
                               for label in merged["peaks"]}
            merged["stage_bytes"] = {
                label: {s: n for g in gathered for s, n in g["stage_bytes"][label].items()}
                for label in merged["stage_bytes"]}
            merged["grad_diff"] = {k: max(g["grad_diff"][k] for g in gathered)
                                   for k in merged["grad_diff"]}
            merged["loss"] = {k: v for g in gathered for k, v in g["loss"].items()}
            # CPU seconds per step summed over ranks: less sensitive to other load than wall time.
            merged["cpu"] = {label: [sum(x) for x in zip(*(g["cpu"][label] for g in gathered))]
                             for label in merged["cpu"]}
            Path(out_path).write_text(json.dumps(merged))
        dist.barrier()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # a peer may be stuck in a collective; do not wait for it
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(rank: int, cfg: BenchConfig, offload_ratio: float) -> dict:
    variants = build_variants(cfg, rank, offload_ratio)
    for _ in range(cfg.warmup):
        for v in variants:
            v.step()
    times: dict[str, list[float]] = {v.label: [] for v in variants}
    cpu: dict[str, list[float]] = {v.label: [] for v in variants}
    profiles = {v.label: cProfile.Profile() for v in variants} if cfg.profile_dir else {}
    for rep in range(cfg.reps):
        for v in (variants if rep % 2 == 0 else variants[::-1]):
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            if profiles:
                profiles[v.label].enable()
            for _ in range(cfg.steps):
                v.step()
            if profiles:
                profiles[v.label].disable()
            cpu[v.label].append((time.process_time() - start_cpu) / cfg.steps)
            dist.barrier()
            times[v.label].append((time.perf_counter() - start) / cfg.steps)
    for label, profile in profiles.items():
        profile.dump_stats(Path(cfg.profile_dir) / f"{label.replace(' ', '_')}.rank{rank}.prof")
    peaks, stage_bytes, losses, grads = {}, {}, {}, {}
    for v in variants:
        meter = ActivationMeter()
        loss = v.measured(meter)
        peaks[v.label] = meter.peak_bytes(rank)
        stage_bytes[v.label] = v.stage_bytes()
        if loss is not None:
            losses[v.label] = loss.item()
        grads[v.label] = {str(i): p.grad.detach().clone() for i, p in enumerate(v.params)
                          if p.grad is not None}
    grad_diff = {}
    for name in cfg.schedules:
        if name in SCHEDULES:
            grad_diff[name] = _max_rel_diff(grads[f"torch {name}"], grads[f"ours {name}"])
            if cfg.transport_baseline:
                grad_diff[f"{name} vs {BASELINE}"] = _max_rel_diff(grads[f"{BASELINE} {name}"],
                                                                   grads[f"ours {name}"])
    return {"times": times, "cpu": cpu, "peaks": peaks, "stage_bytes": stage_bytes, "loss": losses,
            "grad_diff": grad_diff}


def measure_offload_ratio(cfg: BenchConfig) -> float:
    """One-way copy time of one stage's saved activations over that stage's F+I+W time, on
    this CPU (one thread): what the simulator and the planner call ``offload_ratio``."""
    torch.set_num_threads(1)
    num_stages = our_schedule(POF_NONE, cfg, 0.0).num_stages
    stage = 1 if num_stages > 2 else 0
    module = build_stage_modules(cfg.model_config, num_stages, [stage], cfg.seed)[stage]
    dim = cfg.model_config.dim
    meter = ActivationMeter()
    meter.exclude(module.parameters())
    compute = []
    for _ in range(4):
        x = torch.randn(cfg.microbatch_size, cfg.tokens, dim, requires_grad=True)
        start = time.perf_counter()
        with meter.scope(0, "probe"), meter.observe(0):
            out = module(x)
        out.backward(torch.ones_like(out))
        compute.append(time.perf_counter() - start)
        nbytes = meter.scope_bytes["probe"]
        meter.reset()
    source, host = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    copies = []
    for _ in range(5):
        start = time.perf_counter()
        host.copy_(source)
        copies.append(time.perf_counter() - start)
    return min(copies) / min(compute)


def predictions(cfg: BenchConfig, result: dict, offload_ratio: float) -> dict[str, float]:
    """The simulator's rank-0 peaks (M_a units and bytes, from the measured per-stage bytes)."""
    out = {}
    for name in ("1f1b", POF):
        label = f"ours {name}"
        if label not in result["stage_bytes"]:
            continue
        sched = our_schedule(name, cfg, offload_ratio)
        sizes = result["stage_bytes"][label]
        stage_bytes = tuple(float(sizes.get(str(s), 0)) for s in range(sched.num_stages))
        costs = CostModel(offload_ratio=offload_ratio if name == POF else None,
                          stage_activation_bytes=stage_bytes)
        sim = simulate(sched, costs)
        out[f"{name} units"] = sim.peak_activation[0]
        out[f"{name} bytes"] = sim.peak_bytes[0] if sim.peak_bytes else float("nan")
    return out


def report(cfg: BenchConfig, result: dict, offload_ratio: float) -> dict:
    """Print the tables; return the summary (ratios, peaks, factors) for --json."""
    times, peaks = result["times"], result["peaks"]
    summary: dict = {"machine": machine_summary(), "config": dataclasses.asdict(cfg),
                     "size": cfg.size_label, "offload_ratio": offload_ratio, "schedules": {}}
    batch_tokens = cfg.microbatches * cfg.microbatch_size * cfg.tokens
    print(f"\n## size {cfg.size_label}")
    print(f"pp={cfg.pp} microbatches={cfg.microbatches} microbatch={cfg.microbatch_size}x"
          f"{cfg.tokens} tokens model={cfg.model} reps={cfg.reps} steps/rep={cfg.steps} "
          f"warmup={cfg.warmup} gloo, 1 thread per process\n")
    pairs = [(name, f"torch {name}", f"ours {name}") for name in cfg.schedules
             if name in SCHEDULES]
    if cfg.transport_baseline:
        pairs += [(f"{name} vs {BASELINE}", f"{BASELINE} {name}", f"ours {name}")
                  for name in cfg.schedules if name in SCHEDULES]
    if POF in cfg.schedules:
        pairs += [("po-f vs torch 1f1b", "torch 1f1b", f"ours {POF}"),
                  ("po-f vs po-f without offload", f"ours {POF_NONE}", f"ours {POF}")]
    rows = []
    for row_name, ref, mine in pairs:
        ratios = [t / o for t, o in zip(times[ref], times[mine])]
        med, lo, hi = spread(ratios)
        cpu_ratio = spread([t / o for t, o in zip(result["cpu"][ref], result["cpu"][mine])])[0]
        grad = result["grad_diff"].get(row_name)
        summary["schedules"][row_name] = {
            "reference": ref, "ratio": [med, lo, hi], "cpu_ratio": cpu_ratio,
            "reference_s": times[ref], "ours_s": times[mine], "reference_peak_bytes": peaks[ref],
            "ours_peak_bytes": peaks[mine], "grad_rel_diff": grad,
            "loss_diff": (abs(result["loss"][mine] - result["loss"][ref])
                          if grad is not None and ref in result["loss"] else None)}
        rows.append([row_name, f"{spread(times[ref])[0]:.3f}", f"{spread(times[mine])[0]:.3f}",
                     f"{batch_tokens / spread(times[mine])[0]:.0f}",
                     f"{med:.3f}", f"{lo:.3f}", f"{hi:.3f}", f"{cpu_ratio:.3f}",
                     " ".join(mib(b) for b in peaks[ref]), " ".join(mib(b) for b in peaks[mine]),
                     "" if grad is None else f"{grad:.1e}"])
    print("ratio = reference step time / our step time, per repetition (>1: ours faster); "
          "CPU-time ratio: the same with CPU seconds summed over ranks (median)")
    print(format_table(
        ["schedule", "reference s/step", "ours s/step", "ours tok/s", "ratio median", "min",
         "max", "CPU-time ratio", "reference peak MiB per rank", "ours peak MiB per rank",
         "grad rel diff"], rows))
    loss = result["loss"]
    diffs = [abs(loss[f"ours {n}"] - loss[f"torch {n}"]) for n in cfg.schedules
             if f"torch {n}" in loss and f"ours {n}" in loss]
    if diffs:
        print(f"max |loss ours - loss torch| over schedules: {max(diffs):.2e}")
    if POF in cfg.schedules and "1f1b" in cfg.schedules:
        pred = predictions(cfg, result, offload_ratio)
        measured = peaks["torch 1f1b"][0] / max(peaks[f"ours {POF}"][0], 1)
        by_bytes = pred["1f1b bytes"] / max(pred[f"{POF} bytes"], 1)
        by_units = pred["1f1b units"] / pred[f"{POF} units"]
        print(f"\nrank-0 peak activation: torch 1f1b {mib(peaks['torch 1f1b'][0])} MiB, "
              f"ours po-f {mib(peaks[f'ours {POF}'][0])} MiB (offload_ratio "
              f"{offload_ratio:.4f})")
        print(f"measured factor torch 1f1b / ours po-f: {measured:.2f}")
        print(f"simulator's predicted factor: {by_bytes:.2f} from measured per-stage bytes "
              f"({mib(pred['1f1b bytes'])} / {mib(pred[f'{POF} bytes'])} MiB), {by_units:.2f} in "
              f"M_a units ({pred['1f1b units']:g} / {pred[f'{POF} units']:g})")
        print("measured >= predicted: " + ("yes" if measured >= by_bytes else "NO"))
        summary["pof_factor"] = {"measured": measured, "predicted_bytes": by_bytes,
                                 "predicted_units": by_units}
    return summary


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = BenchConfig()
    parser.add_argument("--pp", type=int, default=None,
                        help=f"ranks of sizes that name none (default {defaults.pp})")
    parser.add_argument("--microbatches", type=int, default=defaults.microbatches)
    parser.add_argument("--microbatch-size", type=int, default=None,
                        help=f"rows per microbatch of the --model size (default "
                             f"{defaults.microbatch_size})")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--reps", type=int, default=defaults.reps)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--warmup", type=int, default=defaults.warmup)
    parser.add_argument("--sizes", default=None,
                        help="comma separated MODEL:ROWS[:PP] (model preset: tiny, small or "
                             "medium; rows per microbatch; ranks, default --pp), default "
                             + ",".join(f"{m}:{r}:{p}" for m, r, p in defaults.sizes))
    parser.add_argument("--model", default=None,
                        help="one size: this model (with --microbatch-size, --pp) instead of "
                             "--sizes")
    parser.add_argument("--schedules", default=",".join(defaults.schedules),
                        help="comma separated, from: " + ", ".join([*SCHEDULES, POF]))
    parser.add_argument("--offload-ratio", type=float, default=None,
                        help="po-f planning ratio (default: measured on this machine)")
    parser.add_argument("--min-offload-elements", type=int,
                        default=defaults.min_offload_elements,
                        help="saved tensors this small stay on the device in po-f (default 0: "
                             "everything moves, as the simulator assumes)")
    parser.add_argument("--transport-baseline", action="store_true",
                        help="also run our runtime with every message on one process group and "
                             "receives posted 2 compute actions ahead (before issue 15), and "
                             "compare it with ours")
    parser.add_argument("--timeout-s", type=float, default=defaults.timeout_s)
    parser.add_argument("--json", metavar="FILE", default=None,
                        help="also write the summary (ratios, peaks, factors) as JSON")
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="cProfile each variant's timed steps per rank into "
                             "DIR/MODEL_ROWS/*.prof")
    args = parser.parse_args(argv)
    names = tuple(n.strip().lower() for n in args.schedules.split(",") if n.strip())
    unknown = [n for n in names if n not in SCHEDULES and n != POF]
    if unknown:
        parser.error(f"unknown schedule {unknown[0]!r}; choose from "
                     f"{', '.join([*SCHEDULES, POF])}")
    if POF in names and "1f1b" not in names:
        names = ("1f1b", *names)  # po-f's memory is compared with torch's 1F1B
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    if args.reps < 1 or args.steps < 1 or args.warmup < 0:
        parser.error("--reps and --steps must be >= 1 and --warmup >= 0")
    sizes = defaults.sizes
    pp = args.pp or defaults.pp
    if args.sizes is not None and (args.model is not None or args.microbatch_size is not None):
        parser.error("give either --sizes or --model / --microbatch-size, not both")
    if args.sizes is not None:
        sizes = tuple(_parse_size(parser, item, pp) for item in args.sizes.split(",")
                      if item.strip())
    elif args.model is not None or args.microbatch_size is not None or args.pp is not None:
        sizes = ((args.model or defaults.model, args.microbatch_size or defaults.microbatch_size,
                  pp),)
    if not sizes:
        parser.error("--sizes names no size")
    chunked = any(n != "1f1b" for n in names)
    for model, _, ranks in sizes:
        stages, layers = ranks * (2 if chunked else 1), MODEL_PRESETS[model].n_layers
        if stages > layers:
            parser.error(f"size {model}:{ranks} ranks needs {stages} stages but model {model!r} "
                         f"has {layers} layers; use at most {layers // 2} ranks for the "
                         "interleaved, V and po-f schedules, or a larger model")
    return dataclasses.replace(
        defaults, pp=sizes[0][2], microbatches=args.microbatches, sizes=sizes,
        model=sizes[0][0], microbatch_size=sizes[0][1], seq_len=args.seq_len, reps=args.reps,
        steps=args.steps, warmup=args.warmup, schedules=names,
        offload_ratio=args.offload_ratio, transport_baseline=args.transport_baseline,
        timeout_s=args.timeout_s,
        min_offload_elements=args.min_offload_elements, profile_dir=args.profile,
        json_path=args.json)


def _parse_size(parser: argparse.ArgumentParser, item: str, pp: int) -> tuple[str, int, int]:
    parts = item.strip().split(":")
    numbers = parts[1:]
    if (parts[0] not in MODEL_PRESETS or len(numbers) not in (1, 2)
            or not all(n.isdigit() and int(n) >= 1 for n in numbers)):
        parser.error(f"size {item.strip()!r} is not MODEL:ROWS[:PP] with MODEL one of "
                     f"{', '.join(MODEL_PRESETS)} and ROWS, PP >= 1 (e.g. tiny:8:2)")
    return parts[0], int(numbers[0]), int(numbers[1]) if len(numbers) == 2 else pp


def run_size(cfg: BenchConfig) -> dict:
    """All variants at one size (``cfg.model``, ``cfg.microbatch_size``); prints its tables."""
    ratio = cfg.offload_ratio if cfg.offload_ratio is not None else measure_offload_ratio(cfg)
    size_profile = (str(Path(cfg.profile_dir) / cfg.size_label.replace(":", "_"))
                    if cfg.profile_dir else None)
    if size_profile:
        Path(size_profile).mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(cfg, profile_dir=size_profile)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        mp.spawn(worker, args=(cfg, free_port(), str(out), ratio), nprocs=cfg.pp, join=True)
        result = json.loads(out.read_text())
    return report(cfg, result, ratio)


def overview(summaries: list[dict]) -> str:
    """One row per (size, schedule): the ratios of every size side by side."""
    rows = []
    for summary in summaries:
        for name, row in summary["schedules"].items():
            med, lo, hi = row["ratio"]
            rows.append([summary["size"], name, f"{spread(row['reference_s'])[0]:.4f}",
                         f"{spread(row['ours_s'])[0]:.4f}", f"{med:.3f}", f"{lo:.3f}",
                         f"{hi:.3f}", f"{row['cpu_ratio']:.3f}"])
    return format_table(["size", "schedule", "reference s/step", "ours s/step", "ratio median",
                         "min", "max", "CPU-time ratio"], rows)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(machine_summary())
    summaries = [run_size(dataclasses.replace(cfg, model=model, microbatch_size=rows, pp=pp))
                 for model, rows, pp in cfg.sizes]
    if len(summaries) > 1:
        print("\n## all sizes (ratio = reference / ours per repetition, > 1: ours faster)")
        print(overview(summaries))
    if cfg.json_path:
        data = summaries[0] if len(summaries) == 1 else {"sizes": summaries}
        Path(cfg.json_path).write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
