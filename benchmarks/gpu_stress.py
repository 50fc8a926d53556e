"""Host-ahead stress of the offloader: the GPU far behind the host, copies slower than compute.

Run: python benchmarks/gpu_stress.py               (one CUDA GPU, about a minute)
     python benchmarks/gpu_stress.py --device cpu  (the same code path, no slowing, seconds)

zbv at p = 2 runs in local mode (both ranks on this device) with every (stage, microbatch)
offloaded and brought back by RELOAD or by FETCH, without and with a cap on pending copy bytes
(OffloadConfig.max_pending_copy_bytes). On CUDA every stage forward first queues
``torch.cuda._sleep`` on the compute stream and every copy to host one on the copy stream, so
the host runs far ahead of both: what a real run sees when the GPU is the bottleneck. It prints
whether gradients are bitwise those without offload, the most device bytes that waited for
their copy, the allocator's peak (activations plus temporaries, above parameters and
gradients) and the meter's and the simulator's peaks (offloader.py Note: [release order]).
The last line starts with RESULT: (benchmarks/gpu_check.sh collects it).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import torch
from _common import format_table
from _memory_checks import Check, report, reserved_check
from torch import nn

from pipeoffload.api import build_schedule
from pipeoffload.core.actions import Action, Kind
from pipeoffload.errors import ConfigError
from pipeoffload.runtime import pipeline as pipeline_module
from pipeoffload.runtime.config import OffloadConfig, RuntimeConfig
from pipeoffload.runtime.copies import CudaCopies
from pipeoffload.runtime.meter import ActivationMeter
from pipeoffload.runtime.offloader import ActivationOffloader
from pipeoffload.sim.costs import CostModel
from pipeoffload.sim.simulator import simulate

MIB = 2**20


class Block(nn.Module):
    """LayerNorm, MLP, residual: deterministic kernels, so bitwise comparisons hold."""

    def __init__(self, width: int, sleep_cycles: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.sleep_cycles = sleep_cycles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sleep_cycles and x.is_cuda:
            torch.cuda._sleep(self.sleep_cycles)  # the compute stream falls behind the host
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class SlowCopies(CudaCopies):
    """CUDA copies to host that each wait ``sleep_cycles`` on the copy stream first."""

    def __init__(self, device: torch.device, sleep_cycles: int) -> None:
        super().__init__(device)
        self.sleep_cycles = sleep_cycles

    def copy_out(self, pairs):  # type: ignore[no-untyped-def]
        with torch.cuda.stream(self.d2h):
            torch.cuda._sleep(self.sleep_cycles)
        return super().copy_out(pairs)


def offloaded(schedule, back: Kind):
    """OFFLOAD after every F, ``back`` (RELOAD or FETCH) before every I / B."""
    rows = []
    for row in schedule.ranks:
        out: list[Action] = []
        for action in row:
            if action.kind.is_backward:
                out.append(Action(action.stage, back, action.microbatch))
            out.append(action)
            if action.kind is Kind.F:
                out.append(Action(action.stage, Kind.OFFLOAD, action.microbatch))
        rows.append(out)
    return schedule.with_ranks(rows, name=f"{schedule.name}+{back.value}")


RELEASES = {"host time": {"pending_copy_activations": None},  # release when a poll sees it
            "default": {},  # OffloadConfig's: at most one activation waits, then stream order
            }


def run(args: argparse.Namespace, back: Kind | None, cap: int | None,
        release: str = "default") -> dict:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    base = build_schedule("zbv", pp=2, microbatches=args.microbatches)
    sched = base if back is None else offloaded(base, back)
    torch.manual_seed(0)
    stages = {s: nn.Sequential(*(Block(args.width, args.sleep_cycles if cuda else 0)
                                 for _ in range(2))).to(device) for s in range(4)}
    if cuda:
        pipeline_module.ActivationOffloader = partial(  # type: ignore[misc]
            ActivationOffloader, copies=SlowCopies(device, 2 * args.sleep_cycles))
    try:
        meter = ActivationMeter()
        config = RuntimeConfig(offload=OffloadConfig(min_offload_elements=0,
                                                     max_pending_copy_bytes=cap,
                                                     **RELEASES.get(release, {})))
        pipe = pipeline_module.Pipeline(stages, sched, lambda out: out.float().square().mean(),
                                        config=config, device=device, meter=meter)
    finally:
        pipeline_module.ActivationOffloader = ActivationOffloader  # type: ignore[misc]
    x = torch.randn(args.microbatches, args.seq, args.width, device=device)
    row: dict = {}
    for _ in range(2):
        for module in stages.values():
            module.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            base_bytes = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        meter.reset()
        pipe.step(x)
        if cuda:
            torch.cuda.synchronize()
            row["alloc_peak"] = torch.cuda.max_memory_allocated() - base_bytes
            row["alloc_peak_abs"] = torch.cuda.max_memory_allocated()
            row["reserved_peak"] = torch.cuda.max_memory_reserved()
    try:
        sizes = meter.stage_activation_bytes(sched.num_stages)
        row["plan_peak"] = simulate(sched, CostModel(stage_activation_bytes=sizes)).peak_bytes
    except ConfigError as error:  # microbatches of a stage measured different sizes
        print(f"no plan peak for {sched.name}: {error}")
        row["plan_peak"] = ()
    row["meter_peak"] = tuple(meter.peak_bytes(r) for r in range(2))
    row["pending"] = pipe.offloader.max_pending_bytes_seen if pipe.offloader else 0
    row["largest"] = max(sizes) if row["plan_peak"] else 0
    row["grads"] = [p.grad.cpu() for m in stages.values() for p in m.parameters()]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--sleep-cycles", type=int, default=2_000_000)
    parser.add_argument("--cap-mib", type=float, default=64.0)
    parser.add_argument("--predict-scale", type=float, default=1.0,
                        help="multiply the plan's peaks in the memory checks (to see them fail)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device; pass --device cpu")
    if args.device == "cpu":
        args.width, args.seq = min(args.width, 32), min(args.seq, 8)
        torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    cap = int(args.cap_mib * MIB)
    reference = run(args, None, None)
    rows, verdicts, checks = [], [], []
    for back in (Kind.RELOAD, Kind.FETCH):
        for release, limit in (("host time", None), ("default", None), (f"cap {args.cap_mib:g} MiB",
                                                                          cap)):
            row = run(args, back, limit, release)
            same = all(torch.equal(a, b) for a, b in zip(reference["grads"], row["grads"]))
            verdicts.append(same)
            checks += release_checks(f"{back.value} {release}", row, limit, release,
                                     args.predict_scale)
            rows.append([back.value, release, "yes" if same else "NO",
                         f"{row['pending'] / MIB:.1f}",
                         f"{row['alloc_peak'] / MIB:.1f}" if "alloc_peak" in row else "n/a",
                         " / ".join(f"{b / MIB:.2f}" for b in row["meter_peak"]),
                         " / ".join(f"{b / MIB:.2f}" for b in row["plan_peak"]) or "n/a"])
    print(f"zbv p=2 m={args.microbatches} local mode on {args.device}, width {args.width}, "
          f"seq {args.seq}; no-offload allocator peak "
          + (f"{reference['alloc_peak'] / MIB:.1f} MiB" if "alloc_peak" in reference else "n/a"))
    print(format_table(["back", "release", "bitwise = no offload", "max pending MiB",
                        "alloc peak MiB (+temporaries)", "meter peak MiB r0 / r1",
                        "plan peak MiB r0 / r1"], rows))
    passed = report(checks)
    ok = all(verdicts) and passed
    print(f"RESULT: {'ok' if ok else 'FAILED'}: RELOAD and FETCH bitwise {all(verdicts)}; "
          f"{sum(c.ok for c in checks)}/{len(checks)} memory checks ok")
    return 0 if ok else 1


def release_checks(name: str, row: dict, cap: int | None, release: str,
                   scale: float) -> list[Check]:
    """Memory above the plan is what waits for its copy to host: the meter's peak per rank is
    the plan's (times ``scale``, to see the check fail) plus at most the most bytes seen
    waiting, which the cap (or by default the largest activation) bounds. Released in host
    time nothing bounds it (on a GPU behind the host, activations stay: reported, not
    checked beyond the plan as a floor). On CUDA the allocator's reserved bytes too."""
    if not row["plan_peak"]:
        return [Check(f"{name} plan", False, "no plan peak (microbatches differed)")]
    bound = {"default": row["largest"]}.get(release, cap)
    checks = []
    for rank, (meter, plan) in enumerate(zip(row["meter_peak"], row["plan_peak"])):
        predicted = scale * plan
        if bound is None:
            ok = meter >= predicted
            detail = f"meter {meter / MIB:.3f} MiB >= plan {predicted / MIB:.3f} MiB"
        else:
            ok = predicted <= meter <= predicted + row["pending"] and row["pending"] <= bound
            detail = (f"meter {meter / MIB:.3f} MiB within plan {predicted / MIB:.3f} MiB + "
                      f"waiting {row['pending'] / MIB:.3f} MiB <= {bound / MIB:.3f} MiB")
        checks.append(Check(f"{name} rank {rank}", ok, detail))
    if "reserved_peak" in row:
        checks.append(reserved_check(f"{name} reserved", row["reserved_peak"],
                                     row["alloc_peak_abs"]))
    return checks


if __name__ == "__main__":
    sys.exit(main())
