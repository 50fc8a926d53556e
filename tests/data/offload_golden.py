"""Record (or check) what the offload planner makes of ~200 fixed random inputs.

Run: python tests/data/offload_golden.py            rewrite offload_golden.json.xz
     python tests/data/offload_golden.py --check    compare the current code with it

The file pins the planner's output (schedule CSV text and report fields) and a digest of the
planned schedule's simulation, so that work on the planner's or the simulator's speed can show
it changed no plan (tests/test_offload_plan_stable.py). Inputs are drawn with a fixed seed and
stored with the outputs: the test reads them back and never draws anything itself. Rewrite the
file only for a change that is meant to alter plans, and say so in the commit.

A second list pins the simulator alone on what the plans do not exercise: every zoo family,
with explicit SEND / RECV, with RECOMPUTE and with torch's markers, each stored as its action
lists (so the check needs no generator and no torch).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import random
import sys
from pathlib import Path
from typing import Any

from pipeoffload.api import plan_schedule
from pipeoffload.core import registry
from pipeoffload.core.actions import Action, Kind, parse_action
from pipeoffload.core.schedule import Schedule
from pipeoffload.core.text import to_csv_text
from pipeoffload.errors import PipeoffloadError
from pipeoffload.offload.plan import OffloadPlan, OffloadPolicy
from pipeoffload.offload.recompute import add_recompute
from pipeoffload.sim.costs import CostModel, Duplex, HostLink
from pipeoffload.sim.simulator import SimResult, simulate

GOLDEN = Path(__file__).with_name("offload_golden.json.xz")
SEED = 2026
CASES = 200
SCHEDULES = ("po-f", "po-h", "grouped-interleaved", "interleaved-1f1b", "zbv", "dualpipev")


def draw_case(rng: random.Random) -> dict[str, Any]:
    """One planning input (plain JSON, so the file says what was asked)."""
    name = rng.choice(SCHEDULES)
    pp = rng.randint(2, 8)
    options: dict[str, Any] = {}
    if name in ("grouped-interleaved", "interleaved-1f1b", "po-f", "po-h"):
        options["chunks"] = rng.choice((2, 2, 3, 4))
    if name == "grouped-interleaved":
        options["group_size"] = rng.choice(sorted({max(1, pp // 2), pp, pp + 1}))
    microbatches = rng.choice((pp, 2 * pp, 3 * pp, 4 * pp, 2 * pp + 1))
    target = rng.choice(("all", "all", "chunks:1", "chunks:2", "fraction:0.3", "fraction:0.7",
                         "limit:0.5", "limit:1.2", "none"))
    costs: dict[str, Any] = {
        "f_time": 1.0,
        "i_time": rng.choice((1.0, 2.0, 1.5)),
        "w_time": rng.choice((1.0, 0.5)),
        "p2p_time": rng.choice((0.0, 0.0, 0.1, 0.25)),
        "offload_ratio": rng.choice((0.1, 0.25, 0.5, 0.75, 1.0, 1.5)),
        "duplex": rng.choice(("full", "full", "half")),
        "ranks_per_link": rng.choice((1, 1, 2)),
    }
    if name == "dualpipev" and rng.random() < 0.5:
        costs["overlap_f_b"] = rng.choice((0.0, 0.5))
    if rng.random() < 0.2:
        costs["activation_bytes"] = 1e6
        costs["stage_time_scale"] = [rng.choice((1.0, 1.0, 2.0)) for _ in range(64)]
        if target.startswith("limit") and rng.random() < 0.5:
            target = "limit:2MB"
    policy = {
        "fetch_on_use": rng.random() < 0.3,
        "max_pending_offloads": rng.choice((1, 1, 1, 0, 2, None)),
        "postpone_slack": rng.choice((0.0, 0.0, 0.0, 0.02)),
        "reload_margin": rng.choice((0.0, 0.0, 0.0, 0.1)),
    }
    return {"schedule": name, "pp": pp, "microbatches": microbatches, "options": options,
            "target": target, "costs": costs, "policy": policy}


def plan_case(case: dict[str, Any]) -> OffloadPlan:
    costs = dict(case["costs"])
    link = HostLink(Duplex(costs.pop("duplex")), costs.pop("ranks_per_link"))
    if "stage_time_scale" in costs:
        costs["stage_time_scale"] = tuple(costs["stage_time_scale"])
    return plan_schedule(case["schedule"], case["pp"], case["microbatches"], case["target"],
                         costs=CostModel(host_link=link, **costs),
                         policy=OffloadPolicy(**case["policy"]), **case["options"])


def digests(result: SimResult) -> dict[str, str]:
    """sha256 of the whole timeline (action, start, end, stall, lane) and memory curves."""
    timeline = repr([(str(t.action), t.start, t.end, t.stall, t.lane.value)
                     for rank in result.timeline for t in rank])
    return {"timeline_sha256": hashlib.sha256(timeline.encode()).hexdigest(),
            "memory_sha256": hashlib.sha256(repr(result.memory).encode()).hexdigest()}


def outcome(plan: OffloadPlan) -> dict[str, Any]:
    """What the plan is, in exact (repr) floats."""
    r = plan.report
    return {
        "csv": to_csv_text(plan.schedule),
        "offloaded": [list(item) for item in r.offloaded],
        "peak_before": [repr(x) for x in r.peak_before],
        "peak_after": [repr(x) for x in r.peak_after],
        "peak_bytes_after": None if r.peak_bytes_after is None else
        [repr(x) for x in r.peak_bytes_after],
        "offloaded_fraction": repr(r.offloaded_fraction),
        "makespan_before": repr(r.makespan_before),
        "makespan_after": repr(r.makespan_after),
        "stall_time": [repr(x) for x in r.stall_time],
        "skipped": [[s.stage, s.microbatch, s.reason] for s in r.skipped],
        "notes": list(r.notes),
        **digests(plan.result),
    }


def _with_comms(schedule: Schedule) -> Schedule:
    """SEND / RECV around every cross-rank boundary (what runtime/lowering.py adds; written out
    here so that recording needs no runtime import)."""
    ranks = []
    for rank, actions in enumerate(schedule.ranks):
        out: list[Action] = []
        for a in actions:
            s, m = a.stage, a.microbatch
            remote_before = not schedule.is_first_stage(s) and schedule.rank_of(s - 1) != rank
            remote_after = not schedule.is_last_stage(s) and schedule.rank_of(s + 1) != rank
            if a.kind is Kind.F and remote_before:
                out.append(Action(s, Kind.RECV_F, m))
            if a.kind in (Kind.I, Kind.B) and remote_after:
                out.append(Action(s, Kind.RECV_B, m))
            out.append(a)
            if a.kind is Kind.F and remote_after:
                out.append(Action(s, Kind.SEND_F, m))
            if a.kind in (Kind.I, Kind.B) and remote_before:
                out.append(Action(s, Kind.SEND_B, m))
        ranks.append(out)
    return schedule.with_ranks(ranks)


def simulation_cases() -> list[dict[str, Any]]:
    """Schedules and cost models for the simulator alone (small: p <= 4)."""
    cases = []
    costs = [{"p2p_time": 0.0}, {"i_time": 2.0, "w_time": 0.5, "p2p_time": 0.1},
             {"activation_bytes": 3.0, "stage_time_scale": [1.0, 2.0, 1.0, 0.5, 1.5]}]
    for name in registry.FAMILIES:
        for pp in (2, 4):
            m = 2 * pp
            options = {"chunks": 2} if name in ("interleaved-1f1b", "grouped-interleaved") else {}
            schedule = registry.build_schedule(name, pp, m, **options)
            variants = [schedule, _with_comms(schedule)]
            if name in ("grouped-interleaved", "zbv", "1f1b"):
                variants.append(add_recompute(schedule, target="fraction:0.5").schedule)
            if name == "1f1b":
                variants.append(schedule.with_ranks(
                    [[Action(r, Kind.UNSHARD, None), *acts, Action(r, Kind.REDUCE_GRAD, None)]
                     for r, acts in enumerate(schedule.ranks)]))
            for variant in variants:
                for cost in costs + ([{"overlap_f_b": 0.5}] if name.startswith("dual") else []):
                    cases.append({"ranks": [[str(a) for a in acts] for acts in variant.ranks],
                                  "stage_to_rank": list(variant.stage_to_rank),
                                  "microbatches": variant.microbatches,
                                  "routes": [list(r) for r in variant.routes], "costs": cost})
    return cases


def simulate_case(case: dict[str, Any]) -> dict[str, Any]:
    schedule = Schedule(tuple(tuple(parse_action(t) for t in acts) for acts in case["ranks"]),
                        tuple(case["stage_to_rank"]), case["microbatches"],
                        routes=tuple(tuple(r) for r in case["routes"]))
    costs = dict(case["costs"])
    if "stage_time_scale" in costs:
        costs["stage_time_scale"] = tuple(costs["stage_time_scale"])
    result = simulate(schedule, CostModel(**costs))
    return {"makespan": repr(result.makespan), "bubble_rate": repr(result.bubble_rate),
            "peak_activation": [repr(x) for x in result.peak_activation],
            "peak_bytes": None if result.peak_bytes is None else
            [repr(x) for x in result.peak_bytes],
            "stall_time": [repr(x) for x in result.stall_time],
            "compute_time": [repr(x) for x in result.compute_time], **digests(result)}


def record() -> list[dict[str, Any]]:
    rng = random.Random(SEED)
    entries: list[dict[str, Any]] = []
    while len(entries) < CASES:
        case = draw_case(rng)
        try:
            plan = plan_case(case)
        except PipeoffloadError:
            continue  # an input the schedule family rejects (e.g. too few microbatches)
        entries.append({"input": case, "output": outcome(plan)})
    return entries


def load() -> dict[str, list[dict[str, Any]]]:
    """{"plans": [{"input", "output"}], "simulations": [{"input", "output"}]}"""
    with lzma.open(GOLDEN, "rt") as fh:
        return json.load(fh)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    if args.check:
        golden = load()
        bad = [i for i, e in enumerate(golden["plans"])
               if outcome(plan_case(e["input"])) != e["output"]]
        bad_sim = [i for i, e in enumerate(golden["simulations"])
                   if simulate_case(e["input"]) != e["output"]]
        print(f"{len(bad)} plans differ: {bad}; {len(bad_sim)} simulations differ: {bad_sim}")
        return 1 if bad or bad_sim else 0
    entries = {"plans": record(),
               "simulations": [{"input": c, "output": simulate_case(c)}
                               for c in simulation_cases()]}
    text = json.dumps(entries, sort_keys=True, separators=(",", ":"))
    # xz, not gzip: the schedules repeat across cases further apart than gzip's 32 KB window.
    GOLDEN.write_bytes(lzma.compress(text.encode(), preset=9 | lzma.PRESET_EXTREME))
    print(f"wrote {len(entries['plans'])} plans and {len(entries['simulations'])} simulations "
          f"to {GOLDEN} ({GOLDEN.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
