"""`pipeoffload tokenize`: text tokenised once into a token store (training/token_store.py) that
`pipeoffload train --data STORE` memory-maps, so a run starts in seconds at any corpus size."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from pipeoffload.cli.preflight import count, data_source, input_path, output_dir


def add_tokenize_parser(subparsers: Any) -> None:
    """Register the ``tokenize`` subcommand."""
    p = subparsers.add_parser(
        "tokenize", help="tokenise text once into a pre-tokenised store that train "
        "memory-maps",
        description="Read text as `pipeoffload train --data` does (files, folders, JSON lines, "
        ".gz / .zst, Parquet, datasets), encode each document with a local tokenizer (in "
        "parallel, over the tokenizers package's threads), and write OUT/tokens.bin, "
        "OUT/documents.bin and OUT/tokens.json with the end-of-document id between documents. "
        "See docs/training.md.")
    p.add_argument("data", type=data_source, metavar="DATA", help="what --data would name")
    p.add_argument("output", type=output_dir, metavar="OUT", help="a new or empty folder")
    p.add_argument("--tokenizer", type=input_path, required=True, metavar="PATH",
                   help="a local tokenizer.json (or its folder)")
    p.add_argument("--text-key", default="text", metavar="KEY",
                   help="the JSON-lines field / Parquet or dataset column holding the text")
    p.add_argument("--max-bytes", type=count(1), default=None,
                   help="read at most this much text (default: all)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(arg_names={"data": "DATA", "output": "OUT"})  # as errors name them
    p.set_defaults(handler=cmd_tokenize)


def cmd_tokenize(args: argparse.Namespace) -> int:
    from pipeoffload.errors import ConfigError
    from pipeoffload.training.data_config import DataConfig
    from pipeoffload.training.token_cache import write_tokens
    from pipeoffload.training.token_store import open_store

    out = Path(args.output)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"OUT {out} is not empty; tokenize writes a new or empty folder")
    if out.exists():
        out.rmdir()  # empty: the store is renamed into its place
    config = DataConfig(source=args.data, tokenizer=args.tokenizer, text_key=args.text_key,
                        max_bytes=args.max_bytes)
    start = time.perf_counter()

    def progress(done: int, total: int) -> None:
        if not args.quiet:
            rate = done / max(time.perf_counter() - start, 1e-9)
            print(f"\rtokenize: {done:,}/{total:,} documents ({done / total:.0%}, "
                  f"{rate:,.0f}/s)", end="", file=sys.stderr, flush=True)

    write_tokens(config, out, progress)
    if not args.quiet:
        print(file=sys.stderr)
    store = open_store(out)
    print(f"wrote {len(store):,} tokens in {len(store.ends):,} documents to {out} in "
          f"{time.perf_counter() - start:.1f} s; train with --data {out}")
    return 0
