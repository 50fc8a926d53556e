"""The planner's step-time model against published training runs (issues 21 and 37).

Prints, with their sources: (1) Korthikanti et al. 2022's Table 4 per-layer times against the
planner's, and the fit of the A100 constant calibrated on its unchecked rows; (2) every published
run of planner/published.py and published_hopper.py, measured MFU against the planner's
prediction, the rows that fitted a constant or carry issue 21's bar first and the held-out ones
after (not used to choose anything); (3) with ``--terms``, where the predicted step time of each
run goes; (4) with ``--ablation``, every run's error with each term of rounds 2 and 3 taken out
(the A100 constant refitted without it, as calibrate_hbm_efficiency fits it; docs/planner-model.md
gives each round's own numbers); (5) with ``--hopper``, the fit of the two Hopper efficiencies
from (1, 1) and how far the Megatron-LM README rows move with the microbatch size and
interleaving their source does not publish; (2b) always: issue 35's context-parallel rows.

    python benchmarks/planner_published.py              # (1) and (2), about 8 s of CPU
    python benchmarks/planner_published.py --terms      # and (3)
    python benchmarks/planner_published.py --ablation   # and (4), about 45 s more
    python benchmarks/planner_published.py --hopper     # and (5), about 30 s more
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

from pipeoffload.planner.frameworks import CUDNN_ATTENTION_SPEEDUP
from pipeoffload.planner.hardware import (
    HBM_EFFICIENCY,
    HOPPER_ATTENTION_EFFICIENCY,
    HOPPER_GEMM_EFFICIENCY,
    Hardware,
    hardware_preset,
)
from pipeoffload.planner.layer_work import NormKernel
from pipeoffload.planner.published import (
    MEGATRON_CORE_2024,
    PUBLISHED,
    TABLE4,
    PublishedRun,
    calibrate_hbm_efficiency,
    layer_prediction,
    predict,
)
from pipeoffload.planner.published_cp import (
    DGXC_CP,
    STEP_TIME_TOLERANCE,
    calibrate_cudnn_attention,
    step_seconds,
)
from pipeoffload.planner.published_hopper import HOPPER_FIT_ROWS, calibrate_hopper

#: Issue 21's bar for the runs it lists, in MFU points.
BAR_POINTS = 3.0


def table4() -> str:
    lines = ["(1) Korthikanti et al. 2022, Table 4: one 22B layer (h 6144, 64 heads, s 2048, "
             "microbatch 4) on 8 A100s, TP8",
             f"HBM efficiency fitted on the unchecked rows: {calibrate_hbm_efficiency():.2f} "
             f"(the A100 preset uses {HBM_EFFICIENCY:.2f})", "",
             "| time | measured ms | planner ms | error | role |", "|---|---|---|---|---|"]
    for row in TABLE4:
        predicted = layer_prediction(row)
        role = "checked (within 10%)" if row.checked else "fits HBM efficiency"
        lines.append(f"| {row.name} | {row.measured_s * 1e3:.1f} | {predicted * 1e3:.2f} | "
                     f"{predicted / row.measured_s - 1:+.1%} | {role} |")
    return "\n".join(lines)


def _row(run: PublishedRun) -> tuple[str, float]:
    plan = predict(run)
    error = 100 * (plan.mfu - run.measured_mfu)
    c = plan.candidate
    layout = (f"TP{c.tp} PP{c.pp} DP{c.dp} {c.schedule}" + (f" v{c.chunks}" if c.chunks > 1
                                                          else "")
              + f" b{c.micro_batch} m{c.microbatches}")
    return (f"| {run.source} | {run.row} | {layout} | {run.recompute.value} | "
            f"{run.measured_mfu:.1%} | {plan.mfu:.1%} | {error:+.1f} | "
            f"{plan.step_time:.2f} | {plan.bubble_rate:.1%} | {run.citation} |", error)


def runs() -> str:
    header = ["| source | run | layout | recompute | measured MFU | planner MFU | error (points) "
              "| step s | bubble | citation |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines = ["(2) Published runs: the rows that fitted a constant or carry issue 21's bar "
             "(3 points)", "", *header]
    shown = [run for run in PUBLISHED if not run.held_out]
    errors = []
    for run in shown:
        text, error = _row(run)
        lines.append(text)
        errors.append(error)
    over = [f"{run.label} ({error:+.1f})" for run, error in zip(shown, errors)
            if abs(error) > BAR_POINTS]
    lines += ["", f"within {BAR_POINTS:g} points: {len(shown) - len(over)} of {len(shown)}"
              + (f"; over: {', '.join(over)}" if over else ""),
              f"mean error {sum(errors) / len(errors):+.1f} points, largest "
              f"{max(errors, key=abs):+.1f}", "",
              "Held out (no constant was chosen with them)", "", *header]
    held = []
    for run in (run for run in PUBLISHED if run.held_out):
        text, error = _row(run)
        lines.append(text)
        held.append(error)
        lines.extend(f"|  | note: {note} |  |  |  |  |  |  |  |  |" for note in run.notes)
    lines.append(f"\nheld-out mean error {sum(held) / len(held):+.1f} points, largest "
                 f"{max(held, key=abs):+.1f}")
    return "\n".join(lines)


def context_rows() -> str:
    """Issue 35's rows: dgxc-benchmarking's Llama 3 runs with context parallelism, step time
    against the planner's, and the fit of cuDNN attention's speedup on them."""
    lines = [f"(2b) Context parallelism: dgxc Llama 3 rows (issue 35's bar: step time within "
             f"{STEP_TIME_TOLERANCE:.0%}); cuDNN attention speedup fitted on them: "
             f"{calibrate_cudnn_attention():.2f} (frameworks.CUDNN_ATTENTION_SPEEDUP = "
             f"{CUDNN_ATTENTION_SPEEDUP:.2f})", "",
             "| run | layout | measured s | planner s | error | measured MFU | planner MFU | "
             "citation |", "|---|---|---|---|---|---|---|---|"]
    for run in DGXC_CP:
        plan = predict(run)
        c = plan.candidate
        layout = (f"TP{c.tp} PP{c.pp} DP{c.dp} CP{c.cp}"
                  + (f" v{c.chunks}" if c.chunks > 1 else "") + f" m{c.microbatches}")
        measured = step_seconds(run)
        lines.append(f"| {run.row} | {layout} | {measured:.2f} | {plan.step_time:.2f} | "
                     f"{plan.step_time / measured - 1:+.1%} | {run.measured_mfu:.1%} | "
                     f"{plan.mfu:.1%} | {run.citation} |")
    return "\n".join(lines)


def terms() -> str:
    lines = ["(3) Where each predicted step goes", "",
             "| run | step s | pipeline | exposed DP | optimizer | bubble |",
             "|---|---|---|---|---|---|"]
    for run in PUBLISHED:
        plan = predict(run)
        lines.append(f"| {run.label} | {plan.step_time:.2f} | {plan.pipeline_time:.2f} | "
                     f"{plan.dp_time:.3f} | {plan.optimizer_time:.3f} | "
                     f"{plan.bubble_rate:.1%} |")
    return "\n".join(lines)


def _without_sm_sharing(hw: Hardware) -> Hardware:
    return dataclasses.replace(hw, collective_sms=0)


def _without_one_gpu_nic_share(hw: Hardware) -> Hardware:
    """The first round's network: 0.9 of every NIC [its assumption], whoever drives it."""
    return dataclasses.replace(hw, inter_node_busbw_fraction=0.9,
                               inter_node_one_gpu_busbw_fraction=0.0)


def _persistent_norms(run: PublishedRun) -> PublishedRun:
    """Megatron 2021 priced with the persistent LayerNorm of the 2022 code."""
    framework = dataclasses.replace(run.framework, norm_kernel=NormKernel.PERSISTENT)
    return dataclasses.replace(run, framework=framework)


def _without_dp_copies(run: PublishedRun) -> PublishedRun:
    return dataclasses.replace(run, optimizer=dataclasses.replace(run.optimizer,
                                                                  dp_copy_bytes=0.0))


def _untied(run: PublishedRun) -> PublishedRun:
    return dataclasses.replace(run, spec=dataclasses.replace(run.spec, tied_embeddings=False))


def _same_hw(hw: Hardware) -> Hardware:
    return hw


def _same_run(run: PublishedRun) -> PublishedRun:
    return run


#: Each term of rounds 2 and 3 and how to take it out: (name, hardware change, run change).
ABLATIONS: tuple[tuple[str, Callable[[Hardware], Hardware],
                       Callable[[PublishedRun], PublishedRun]], ...] = (
    ("2021 norms as 2022", _same_hw, _persistent_norms),
    ("no DP copies", _same_hw, _without_dp_copies),
    ("both round-3 out", _same_hw, lambda run: _without_dp_copies(_persistent_norms(run))),
    ("no SM sharing", _without_sm_sharing, _same_run),
    ("NICs at 0.9", _without_one_gpu_nic_share, _same_run),
    ("untied", _same_hw, _untied),
)


def _refitted(change: Callable[[Hardware], Hardware]) -> dict[str, Hardware]:
    """Every preset with ``change`` applied and HBM_EFFICIENCY refitted on Table 4's unchecked
    rows under it (the A100's fit carried to the others, as the presets do)."""
    a100 = change(hardware_preset("a100-80gb"))
    fraction = calibrate_hbm_efficiency(a100)
    presets = {}
    for name in {run.hardware for run in PUBLISHED}:
        hw = change(hardware_preset(name))
        presets[name] = dataclasses.replace(
            hw, hbm_bytes_per_s=hw.hbm_bytes_per_s / HBM_EFFICIENCY * fraction)
    return presets


def ablation() -> str:
    names = [name for name, _, _ in ABLATIONS]
    lines = ["(4) Error (MFU points) with each term of rounds 2 and 3 taken out", "",
             "| run | now | " + " | ".join(names) + " |",
             "|---|---|" + "---|" * len(names)]
    variants = [(_refitted(change), alter) for _, change, alter in ABLATIONS]
    for run in PUBLISHED:
        cells = [100 * (predict(run).mfu - run.measured_mfu)]
        for presets, alter in variants:
            changed = alter(run)
            plan = predict(changed, presets[run.hardware])
            cells.append(100 * (plan.mfu - run.measured_mfu))
        held = " (held out)" if run.held_out else ""
        lines.append(f"| {run.label}{held} | " + " | ".join(f"{c:+.1f}" for c in cells) + " |")
    return "\n".join(lines)


def hopper() -> str:
    """The Hopper fit from (1, 1), and each README row's error under every microbatch size and
    interleaving the planner can build (the published row's assumption marked)."""
    fitted = calibrate_hopper()
    lines = [f"(5) Hopper efficiencies fitted from (1, 1) on "
             f"{', '.join(run.label for run in HOPPER_FIT_ROWS)}: GEMM {fitted[0]:.2f}, "
             f"attention {fitted[1]:.2f} (the presets use {HOPPER_GEMM_EFFICIENCY:.2f}, "
             f"{HOPPER_ATTENTION_EFFICIENCY:.2f})", "",
             "Megatron-LM README rows: error (MFU points) by microbatch size b and chunks v "
             "(* the row's assumption)", "", "| run | errors |", "|---|---|"]
    for run in MEGATRON_CORE_2024:
        cells = []
        per_replica = run.global_batch // run.dp
        for b in (1, 2, 4):
            for v in sorted({1, 2, run.chunks} if run.pp > 1 else {1}):
                m = per_replica // b
                if per_replica % b or (v > 1 and m % run.pp):
                    continue
                variant = dataclasses.replace(
                    run, micro_batch=b, chunks=v,
                    schedule="interleaved-1f1b" if v > 1 else "1f1b")
                error = 100 * (predict(variant).mfu - run.measured_mfu)
                mark = "*" if (b, v) == (run.micro_batch, run.chunks) else ""
                cells.append(f"b{b} v{v}: {error:+.1f}{mark}")
        lines.append(f"| {run.label} | {', '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--terms", action="store_true", help="also print each step's parts")
    parser.add_argument("--ablation", action="store_true",
                        help="also print each run's error with each round-2 and round-3 term out")
    parser.add_argument("--hopper", action="store_true",
                        help="also fit the Hopper efficiencies and vary the README rows' "
                             "unpublished settings")
    args = parser.parse_args()
    print(table4(), end="\n\n")
    print(runs())
    print()
    print(context_rows())
    if args.terms:
        print()
        print(terms())
    if args.ablation:
        print()
        print(ablation())
    if args.hopper:
        print()
        print(hopper())


if __name__ == "__main__":
    main()
