"""What `pipeoffload train` tells its user around the run: the start-up line (what runs, where
outputs go, which checkpoint is resumed) and what a Ctrl-C leaves behind."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeoffload.cli.train_report import ReportOptions
    from pipeoffload.training.data_config import DataConfig
    from pipeoffload.training.train import TrainConfig


def startup_line(config: TrainConfig, report: ReportOptions, processes: int,
                 schedule: str) -> str:
    """What is about to run and where its outputs go (said before the first slow step)."""
    from pipeoffload.parallel.checkpoint import complete_checkpoints, describe_resume

    if config.hf_model is None:
        model = f"model {config.model.n_layers} layers x dim {config.model.dim}"
    else:
        from pipeoffload.training.hf_model import resolve_model

        model = f"model {resolve_model(config.hf_model).describe()}"
    data = config.data.source or "the Python standard library's sources"
    tokens = (f"tokens from {config.data.tokenizer}" if config.data.tokenizer
              else "byte tokens")
    where = (f"{processes} local processes (pp {config.pp} x dp {config.dp} x tp {config.tp})"
             if processes > 1 else f"one process (all {config.pp} pipeline ranks)")
    parts = [f"pipeoffload train: {where}, device {config.device}; schedule {schedule}, "
             f"{config.num_microbatches} microbatches; {model}, {config.dtype}, recompute "
             f"{config.recompute}; data {data}, {tokens}; steps up to {config.steps}"]
    if (config.resume == "auto" and config.checkpoint_dir is not None  # TrainConfig: both
            and not complete_checkpoints(config.checkpoint_dir)):
        parts.append(f"no checkpoint in {config.checkpoint_dir} yet: starting from scratch "
                     "(--resume auto)")
    elif config.resume is not None:
        parts.append(describe_resume("latest" if config.resume == "auto" else config.resume,
                                     config.checkpoint_dir))
    outputs = [f"checkpoints in {config.checkpoint_dir}" if config.checkpoint_dir
               else "no checkpoints (no --checkpoint-dir)"]
    outputs.append(f"picture {report.png}" if report.png else "no picture")
    if config.export_hf:
        outputs.append(f"a Hugging Face export in {config.export_hf}")
    parts.append("writes " + ", ".join(outputs))
    return "; ".join(parts)


def data_line(data: DataConfig) -> str:
    """Which files the run reads and how many bytes of each, the binary files skipped, and
    what goes between documents; or, for pre-tokenised data, its tokens and documents."""
    from pipeoffload.training.data import load_corpus
    from pipeoffload.training.documents import files_report
    from pipeoffload.training.sources import is_token_source

    if is_token_source(data.source):
        from pathlib import Path

        from pipeoffload.training.token_store import open_store

        store = open_store(Path(str(data.source)))
        eos = "no end-of-document id" if store.eos is None else f"end-of-document id {store.eos}"
        return (f"data: {len(store):,} pre-tokenised tokens in {len(store.ends):,} documents "
                f"from {store.origin} (memory-mapped; {eos})")
    corpus = None
    if data.tokenizer is not None:  # tokenised by the up-front check: its store says
        from pipeoffload.training.token_cache import cached_report

        corpus = cached_report(data)
    if corpus is None:
        corpus = load_corpus(data)
    cut = " (cut at --max-bytes)" if corpus.truncated else ""
    skipped = (f"; {corpus.skipped} binary file(s) skipped" if corpus.skipped else "")
    between = ""
    if data.tokenizer is not None:
        from pipeoffload.training.data import end_of_document_id

        eos_id = end_of_document_id(data)
        between = ("; documents joined with no end-of-document token (the tokenizer names "
                   "none)" if eos_id is None else f"; end-of-document id {eos_id} between "
                   "documents")
    return files_report(corpus.origin, corpus.files, corpus.file_bytes) + cut + skipped + between


def interrupt_note(args: argparse.Namespace) -> str:
    """What a Ctrl-C leaves: the newest complete checkpoint, if any."""
    if getattr(args, "checkpoint_dir", None) is None:
        return "no checkpoint was saved (no --checkpoint-dir)"
    from pipeoffload.parallel.checkpoint import complete_checkpoints

    found = complete_checkpoints(args.checkpoint_dir)
    if not found:
        return f"no complete checkpoint in {args.checkpoint_dir} yet"
    return (f"the latest complete checkpoint is {found[-1]}; continue with --resume auto "
            f"--checkpoint-dir {args.checkpoint_dir}")


def nothing_to_resume(config: TrainConfig) -> str | None:
    """With --resume auto: a note when the newest checkpoint is already at --steps (a requeued
    job that had finished), else None."""
    if config.resume != "auto" or config.checkpoint_dir is None:  # TrainConfig: both or none
        return None
    from pipeoffload.parallel.checkpoint import complete_checkpoints, read_manifest

    found = complete_checkpoints(config.checkpoint_dir)
    if not found:
        return None
    step = read_manifest(found[-1], verify_files=False).step
    if step < config.steps:
        return None
    return (f"--resume auto: the newest checkpoint {found[-1]} is at step {step}, and --steps "
            f"is {config.steps}: nothing to train (raise --steps to train on)")
