"""Issue 35's question: for long sequences, tensor parallelism alone, context parallelism,
pipeline parallelism with offload, or any mix? The planner's best plan of each kind for
Llama 3 70B on H100s (docs/planner.md, "Long sequences: TP, CP or PP + offload").

Each row is one search (planner/search.py) over the kind's space, priced as `pipeoffload
train` runs (the planner's default framework, ``current``) with the optimizer state sharded
over the data-parallel (x context-parallel) ranks (``--sharded-optimizer``, ZeRO-1, as the
published long-sequence runs do; without it no 70B plan without pipelining fits 80 GB), at
2^21 tokens per step (256 sequences of 8192 tokens, 64 of 32768, 16 of 131072):
- TP only: pp 1, cp 1 (DP over the rest);
- TP + CP: pp 1, cp 2 to 32 (across nodes where tp x cp passes 8);
- PP + offload: pp > 1, cp 1, every schedule, offload and recompute;
- unconstrained: all of it.

    python benchmarks/planner_cp_table.py                 # 64 and 256 GPUs (about 2 min of CPU)
    python benchmarks/planner_cp_table.py --gpus 64 --seq 8192
"""

from __future__ import annotations

import argparse

from pipeoffload.planner.costing import MemoryConfig
from pipeoffload.planner.evaluate import Plan
from pipeoffload.planner.hardware import hardware_preset
from pipeoffload.planner.optimizer import OptimizerSpec
from pipeoffload.planner.presets import model_preset
from pipeoffload.planner.search import SearchConfig, SearchSpace, search

TOKENS_PER_STEP = 2**21
CP_DEGREES = (2, 4, 8, 16, 32)
PIPELINE_DEGREES = tuple(range(2, 81))  # the search keeps those dividing the GPUs

KINDS: dict[str, SearchSpace] = {
    "TP only": SearchSpace(pp=(1,), cp=(1,)),
    "TP + CP": SearchSpace(pp=(1,), cp=CP_DEGREES),
    "PP + offload": SearchSpace(pp=PIPELINE_DEGREES, cp=(1,)),
    "unconstrained": SearchSpace(cp=(1, *CP_DEGREES)),
}


def _layout(plan: Plan) -> str:
    c = plan.candidate
    parts = [c.display_name, f"TP{c.tp}", f"PP{c.pp}", f"DP{c.dp}", f"CP{c.cp}"]
    if c.chunks > 1:
        parts.append(f"v{c.chunks}")
    parts += [f"b{c.micro_batch}", f"m{c.microbatches}", f"recompute {c.recompute.value}",
              f"offload {c.offload}"]
    return " ".join(parts)


def row(gpus: int, seq: int, kind: str) -> str:
    spec = model_preset("llama3-70b", seq_len=seq)
    config = SearchConfig(gpus=gpus, global_batch=TOKENS_PER_STEP // seq,
                          memory=MemoryConfig(optimizer=OptimizerSpec(sharded=True)))
    result = search(spec, hardware_preset("h100-80gb"), config, KINDS[kind])
    plan = result.best
    if plan is None:
        return f"| {gpus} | {seq} | {kind} | no configuration of this kind | | | | |"
    fits = "yes" if plan.feasible else "no"
    return (f"| {gpus} | {seq} | {kind} | {_layout(plan)} | {plan.step_time:.2f} | "
            f"{plan.mfu:.1%} | {plan.memory_gib:.1f} | {fits} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="*", default=[64, 256])
    parser.add_argument("--seq", type=int, nargs="*", default=[8192, 32768, 131072])
    args = parser.parse_args()
    print("| GPUs | seq | kind | best plan | step s | MFU | GiB per GPU | fits |")
    print("|---|---|---|---|---|---|---|---|")
    for gpus in args.gpus:
        for seq in args.seq:
            for kind in KINDS:
                print(row(gpus, seq, kind), flush=True)
    print(f"\nLlama 3 70B on H100 80GB, {TOKENS_PER_STEP} tokens per step, priced as "
          "pipeoffload train runs (--framework current), optimizer sharded; memory per GPU as "
          "the planner counts it (4 GiB reserve included), against the GPU's 80 GB")


if __name__ == "__main__":
    main()
