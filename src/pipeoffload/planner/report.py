"""What ``pipeoffload plan`` prints: the k line, a ranked table, the winner's command, the
verdict on offload, and the same as one JSON object (the contract: k, best and candidates, each
plan with pp, tp, dp, schedule, chunks, group_size, offload (the option searched), offload_run
(what its command runs: a class plan's classes:A+B), recompute, microbatch_size,
microbatches, step_time, mfu (= mfu_megatron, the full attention square) and mfu_causal,
memory_gib, host_gib, host_node_gib, feasible and command: the
`pipeoffload train` command, or null with ``command_refused`` saying why train cannot run the
plan)."""

from __future__ import annotations

from typing import Any

from pipeoffload.planner.costing import GIB
from pipeoffload.planner.evaluate import Plan
from pipeoffload.planner.search import SearchResult
from pipeoffload.planner.train_command import train_command
from pipeoffload.planner.transformer import TransformerSpec
from pipeoffload.planner.verdict import Verdict


def plan_json(plan: Plan, spec: TransformerSpec | None = None, *,
              sharded_optimizer: bool = False, fsdp: bool = False) -> dict[str, Any]:
    """One plan as a JSON-ready dictionary (times in seconds, memory in GiB);
    ``sharded_optimizer``: its memory counts ZeRO-1; ``fsdp``: train's --zero 3
    (train_command)."""
    c = plan.candidate
    memory = plan.memory
    command = train_command(c, spec, sharded_optimizer=sharded_optimizer,
                            offload=plan.offload_spec, fsdp=fsdp)
    return {
        "pp": c.pp,
        "tp": c.tp,
        "dp": c.dp,
        "cp": c.cp,
        "schedule": c.display_name,
        "chunks": c.chunks,
        "group_size": c.group_size,
        "offload": c.offload,
        "offload_run": plan.offload_spec or c.offload,
        "recompute": c.recompute.value,
        "microbatch_size": c.micro_batch,
        "microbatches": c.microbatches,
        "step_time": plan.step_time,
        "pipeline_time": plan.pipeline_time,
        "dp_time": plan.dp_time,
        "optimizer_time": plan.optimizer_time,
        "mfu": plan.mfu,
        "mfu_megatron": plan.mfu,
        "mfu_causal": plan.mfu_causal,
        "bubble_rate": plan.bubble_rate,
        "stall_time": plan.stall_time,
        "offloaded_fraction": plan.offloaded_fraction,
        "memory_gib": plan.memory_gib,
        "memory_split_gib": {
            "parameters": memory.params / GIB,
            "gradients": memory.grads / GIB,
            "optimizer": memory.optimizer / GIB,
            "activations": memory.activations / GIB,
            "reserve": memory.reserve / GIB,
        },
        "host_gib": plan.host_bytes / GIB,
        "host_node_gib": plan.host_node_bytes / GIB,
        "fits_device": plan.fits_device,
        "fits_host": plan.fits_host,
        "feasible": plan.feasible,
        "simulated_microbatches": list(plan.simulated_microbatches),
        "command": command.argv,
        "command_refused": command.refused,
    }


def result_json(result: SearchResult, inputs: dict[str, Any], *, fixed: bool = False,
                verdict: Verdict | None = None) -> dict[str, Any]:
    """The whole search as one JSON object. ``fixed``: every dimension was given, so ``best`` is
    that configuration whether or not it fits."""
    best = result.best
    stats = result.stats
    return {
        "inputs": inputs,
        "fixed": fixed,
        "verdict": verdict.as_json() if verdict is not None else None,
        "sharding": sharding_line(best, result.sharded_optimizer, fsdp=result.fsdp),
        "k": result.k.k,
        "k_detail": str(result.k),
        "budget_gib": result.budget_bytes / GIB,
        "host_budget_gib": (best.host_budget_bytes / GIB if best is not None else None),
        "best": plan_json(best, result.spec, sharded_optimizer=result.sharded_optimizer,
                          fsdp=result.fsdp)
        if best is not None else None,
        "feasible": bool(best is not None and best.feasible),
        "shortfall": result.shortfall("this configuration" if fixed else "the nearest plan"),
        "candidates": [plan_json(plan, result.spec, sharded_optimizer=result.sharded_optimizer,
                                 fsdp=result.fsdp) for plan in result.candidates],
        "search": {
            "configurations": stats.configurations,
            "simulated": stats.simulated,
            "pruned_by_time": stats.pruned_by_time,
            "pruned_by_memory": stats.pruned_by_memory,
            "dominated": stats.dominated,
            "pruned_by_copies": stats.pruned_by_copies,
            "not_buildable": stats.not_buildable,
            "finalists": stats.finalists,
            "seconds": stats.seconds,
        },
        "notes": list(result.notes),
    }


_HEADER = ("#", "schedule", "pp", "tp", "dp", "cp", "v", "g", "b", "m", "recompute", "offload",
           "step s", "MFU Megatron", "MFU causal", "params+grads", "optimizer", "activations",
           "total GiB", "host GiB/GPU", "fits")


def _row(rank: int, plan: Plan) -> tuple[str, ...]:
    c, memory = plan.candidate, plan.memory
    return (
        str(rank), c.display_name, str(c.pp), str(c.tp), str(c.dp), str(c.cp), str(c.chunks),
        str(c.group_size) if c.group_size is not None else "-", str(c.micro_batch),
        str(c.microbatches), c.recompute.value, plan.offload_spec or c.offload,
        f"{'~' if plan.extrapolated else ''}{plan.step_time:.3f}",
        f"{plan.mfu:.1%}", f"{plan.mfu_causal:.1%}", f"{(memory.params + memory.grads) / GIB:.1f}",
        f"{memory.optimizer / GIB:.1f}", f"{memory.activations / GIB:.1f}",
        f"{plan.memory_gib:.1f}", f"{plan.host_bytes / GIB:.1f}",
        "yes" if plan.feasible else ("no (host)" if plan.fits_device else "no"),
    )


def render_table(plans: list[Plan] | tuple[Plan, ...]) -> str:
    """A Markdown table of ranked plans (memory on the fullest device; total includes the
    reserve)."""
    rows = [_HEADER] + [_row(i + 1, plan) for i, plan in enumerate(plans)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_HEADER))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |"
             for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def render_result(result: SearchResult, inputs_line: str, *, fixed: bool = False,
                  verdict: Verdict | None = None) -> str:
    """The human report: the k line with its inputs, the ranked table, the winner's command
    (or what the nearest plan would need), and the verdict on offload."""
    stats = result.stats
    lines = [inputs_line, str(result.k), ""]
    if result.candidates:
        lines.append(render_table(result.candidates))
    lines.append("")
    lines.append(f"searched {stats.configurations} configurations in {stats.seconds:.1f} s: "
                 f"{stats.simulated} simulations, {stats.pruned_by_time} pruned by time, "
                 f"{stats.pruned_by_memory} by memory, {stats.pruned_by_copies} by copy rate, "
                 f"{stats.dominated} dominated, "
                 f"{stats.not_buildable} not buildable, {stats.finalists} re-simulated in full")
    if any(plan.extrapolated for plan in result.candidates):
        lines.append("~: step time extrapolated from fewer microbatches (docs/planner.md); "
                     "the best plan is simulated with all of them")
    lines.extend(result.notes)
    best = result.best
    if best is None:
        lines.append("no configuration to show")
        return "\n".join(lines)
    host = (f", {best.host_node_bytes / GIB:.1f} GiB pinned host memory per node"
            if best.host_node_bytes else "")
    summary = (f"{best.step_time:.3f} s per step, MFU {best.mfu:.1%} (Megatron's count; "
               f"{best.mfu_causal:.1%} counting the causal half of attention), "
               f"{best.memory_gib:.1f} GiB per device{host}")
    if fixed:
        lines.append("every dimension was fixed (tp, pp, chunks, microbatch size, schedule, "
                     "recompute, offload): this is that configuration's prediction, "
                     + ("and it fits" if best.feasible else "and it does NOT fit"))
    command = str(train_command(best.candidate, result.spec,
                                sharded_optimizer=result.sharded_optimizer, fsdp=result.fsdp,
                                offload=best.offload_spec))
    if best.feasible:
        lines.append(f"{'yours' if fixed else 'best'}: {summary}")
        lines.append(command)
    else:
        if fixed:
            lines.append(f"yours: {summary}")
        lines.append(result.shortfall("this configuration" if fixed else "the nearest plan")
                     or "")
        lines.append(("yours: " if fixed else "nearest: ") + command)
    if verdict is not None:
        lines.append(verdict.line())
    sharding = sharding_line(best, result.sharded_optimizer, fsdp=result.fsdp)
    if sharding is not None:
        lines.append(sharding)
    return "\n".join(lines)


def sharding_line(plan: Plan | None, sharded: bool, *, fsdp: bool = False) -> str | None:
    """What sharding the optimizer over the plan's data-parallel replicas and context-parallel
    ranks saves per device (ZeRO-1: fp32 master weights and moments / (dp * cp)), or would
    save; None with neither. ``fsdp`` (--zero 3) saves the same at the peak (optimizer.py
    Note [zero 3 terms]), and parameters and gradients only between steps."""
    if plan is None or plan.candidate.dp * plan.candidate.cp < 2:
        return None
    if fsdp:
        return _zero3_line(plan)
    optimizer, cp = plan.memory.optimizer, plan.candidate.cp
    dp = plan.candidate.dp * cp
    over = f"dp={dp}" if cp == 1 else f"dp x cp = {plan.candidate.dp} x {cp}"
    whole = optimizer * dp if sharded else optimizer
    saved = whole * (dp - 1) / dp
    if sharded:
        return (f"sharding: --zero 1 keeps {optimizer / GIB:.1f} GiB of fp32 master weights and "
                f"moments per device instead of {whole / GIB:.1f} GiB, {saved / GIB:.1f} GiB "
                f"less over {over}")
    return (f"sharding: --sharded-optimizer (train --zero 1) would keep {whole / dp / GIB:.1f} "
            f"GiB of fp32 master weights and moments per device instead of {whole / GIB:.1f} "
            f"GiB, {saved / GIB:.1f} GiB less over {over}")


def _zero3_line(plan: Plan) -> str:
    """The sharding line of a plan priced as train's --zero 3 (FSDP2 stages)."""
    m, dp = plan.memory, plan.candidate.dp * plan.candidate.cp
    return (f"sharding: --zero 3 keeps {m.optimizer / GIB:.1f} GiB of fp32 master weights and "
            f"moments per device instead of {m.optimizer * dp / GIB:.1f} GiB over dp={dp}, as "
            f"--zero 1 does; its peak is no lower than --zero 1's: inside the step each stage "
            f"holds its parameters ({m.params / GIB:.1f} GiB) and gradients "
            f"({m.grads / GIB:.1f} GiB) whole; between steps they are 1/{dp} "
            f"({(m.params + m.grads) / dp / GIB:.1f} GiB)")
