"""`pipeoffload export`: a checkpoint of `pipeoffload train --model PATH` as a Hugging Face
model folder (training/hf_run.py, parallel/export.py), in one process, without the job that
wrote it."""

from __future__ import annotations

import argparse
from typing import Any

from pipeoffload.cli.preflight import input_path, output_dir


def add_export_parser(subparsers: Any) -> None:
    """Register the ``export`` subcommand."""
    p = subparsers.add_parser(
        "export", help="write a checkpoint of a Hugging Face model as a folder that "
        "transformers' from_pretrained loads",
        description="Consolidate a `pipeoffload train --model PATH` checkpoint (every pipeline "
        "stage and tensor-parallel shard) into a Hugging Face model folder: config.json and "
        "model.safetensors (and the tokenizer's files with --tokenizer). See docs/training.md.")
    p.add_argument("checkpoint", type=input_path, metavar="CHECKPOINT",
                   help="a step_<N> folder, or a --checkpoint-dir (its newest complete one)")
    p.add_argument("output", type=output_dir, metavar="DIR", help="a new or empty folder")
    p.add_argument("--dtype", default=None, choices=("fp32", "bf16"),
                   help="weights' dtype (default: bf16 for a bf16 run, else fp32; fp32 of a "
                   "bf16 run writes its float32 master weights)")
    p.add_argument("--tokenizer", type=input_path, default=None, metavar="PATH",
                   help="the tokenizer.json (or its folder) the run trained with: written "
                   "with tokenizer_config.json and special_tokens_map.json, as --export-hf does")
    p.set_defaults(arg_names={"checkpoint": "CHECKPOINT", "output": "DIR"})  # as errors say
    p.set_defaults(handler=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from pipeoffload.parallel.export import check_export_folder
    from pipeoffload.training.hf_run import export_checkpoint

    check_export_folder(args.output, "DIR")
    folder, step = export_checkpoint(args.checkpoint, args.output, args.dtype, args.tokenizer)
    print(f"exported step {step} of {args.checkpoint} to {folder} (transformers."
          "AutoModelForCausalLM.from_pretrained loads it)")
    return 0
