"""Start-up to the first step of `pipeoffload train` on a corpus of a given size: with a local
tokenizer (first run, which tokenises into the token cache; and again, cached), and from a
pre-tokenised store (`pipeoffload tokenize`, timed on its own).

Each row is the wall time of `pipeoffload train --model tiny --steps 1 --no-baseline --no-png`
in a fresh process (pp 2 inline, one process: the data path, not the launcher, is what is measured),
so it includes Python and torch start-up, the up-front checks and one training step. The corpus
is JSON lines of random words (a fixed seed); the tokenizer a byte-level BPE of 1,000 ids
trained on its first MiB. Sizes above --max-tokenize-mb skip the tokenizer rows and time a
store of random ids of that size written directly (the pre-tokenised row needs no text).

    python benchmarks/data_startup.py --sizes-mb 1 100 1000 --max-tokenize-mb 100

``--baseline-src`` times the tokenizer row with another checkout's package too (its
``--max-bytes`` set to the corpus size, since before this change 1 MiB was the default cap).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import format_table, machine_summary  # noqa: E402

WORDS = [f"w{i}" for i in range(5000)]


def write_corpus(path: Path, size_mb: float) -> None:
    rng = random.Random(0)
    target = int(size_mb * (1 << 20))
    with path.open("w") as f:
        written = 0
        while written < target:
            line = json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randrange(50, 400)))})
            f.write(line + "\n")
            written += len(line) + 1


def write_tokenizer(folder: Path, corpus: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    with corpus.open() as f:
        sample = [json.loads(line)["text"] for line, _ in zip(f, range(2000))]
    tokenizer.train_from_iterator(sample, trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def write_random_store(folder: Path, size_mb: float) -> None:
    import torch

    from pipeoffload.training.token_store import write_store

    tokens = int(size_mb * (1 << 20)) // 2
    generator = torch.Generator().manual_seed(0)
    per_doc = 1 << 16

    def documents():
        for first in range(0, tokens, per_doc):
            n = min(per_doc, tokens - first)
            yield torch.randint(2, 1000, (n,), generator=generator).tolist()

    write_store(folder, documents(), eos=1, vocab_size=1000)


def timed(argv: list[str], env: dict[str, str], reps: int = 1) -> float:
    """The fastest of ``reps`` runs (the least disturbed by other load)."""
    return min(_timed(argv, env) for _ in range(reps))


def _timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pipeoffload.cli", *argv], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def train_argv(data: Path, tokenizer: Path | None) -> list[str]:
    argv = ["train", "--model", "tiny", "--pp", "2", "--inline", "--steps", "1", "--no-baseline",
            "--no-png",
            "--data", str(data), "--seq-len", "64", "--batch-size", "8"]
    return argv + (["--tokenizer", str(tokenizer)] if tokenizer else [])


def measure(size_mb: float, root: Path, tokenize: bool, reps: int, baseline: str | None
            ) -> list[object]:
    env = {**os.environ, "PIPEOFFLOAD_CACHE": str(root / "cache")}
    store = root / "store"
    row: list[object] = [f"{size_mb:g} MB"]
    if tokenize:
        corpus = root / "corpus.jsonl"
        write_corpus(corpus, size_mb)
        tok = write_tokenizer(root / "tok", corpus)
        if baseline is not None:
            old = {**env, "PYTHONPATH": baseline}
            limit = ["--max-bytes", str(int(size_mb * (1 << 20)) + 1)]
            row.append(f"{timed(train_argv(corpus, tok) + limit, old, reps):.1f}")
        row.append(f"{timed(train_argv(corpus, tok), env):.1f}")
        row.append(f"{timed(train_argv(corpus, tok), env, reps):.1f}")
        row.append(f"{timed(['tokenize', str(corpus), str(store), '--tokenizer', str(tok), '--quiet'], env):.1f}")  # noqa: E501
    else:
        start = time.perf_counter()
        write_random_store(store, size_mb)
        row += ["-"] * (3 if baseline else 2)
        row.append(f"({time.perf_counter() - start:.1f} written directly)")
    row.append(f"{timed(train_argv(store, None), env, reps):.1f}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 100.0, 1000.0])
    parser.add_argument("--max-tokenize-mb", type=float, default=100.0,
                        help="larger corpora time only the pre-tokenised row")
    parser.add_argument("--reps", type=int, default=2,
                        help="runs per cached / pre-tokenised / baseline cell; the fastest is "
                        "shown (the first run with a tokenizer runs once: it fills the cache)")
    parser.add_argument("--baseline-src", default=None, metavar="SRC",
                        help="also time the tokenizer run with the package in SRC (another "
                        "checkout's src/, e.g. the code before the token cache)")
    args = parser.parse_args()
    print(machine_summary())
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    rows = []
    for size in args.sizes_mb:
        with tempfile.TemporaryDirectory(prefix="data_startup.") as folder:
            rows.append(measure(size, Path(folder), size <= args.max_tokenize_mb, args.reps,
                                args.baseline_src))
            print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    before = ["tokenizer, --baseline-src (s)"] if args.baseline_src else []
    print(format_table(["corpus", *before, "tokenizer, first run (s)", "tokenizer, cached (s)",
                        "pipeoffload tokenize (s)", "pre-tokenised (s)"], rows))
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
