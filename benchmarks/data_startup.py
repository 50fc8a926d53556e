"""Start-up to the first step of `pipeoffload train` on a corpus of a given size: with a local
tokenizer (first run, which tokenises into the token cache; and again, cached), and from a
pre-tokenised store (`pipeoffload tokenize`, timed on its own).

Each cell is the wall time and the CPU time (user + system) of `pipeoffload train --model tiny
--steps 1 --no-baseline --no-png` in a fresh process (pp 2 inline, one process: the data path,
not the launcher, is what is measured), so it includes Python and torch start-up, the up-front
checks and one training step. On a shared machine the wall time follows the other load; the CPU
time much less. The corpus is JSON lines of random words (a fixed seed); the tokenizer a
byte-level BPE of 1,000 ids trained on its first MiB. Sizes above --max-tokenize-mb skip the
tokenizer rows and time a store of random ids of that size written directly, in documents of
about 1,000 tokens (the pre-tokenised row needs no text).

    python benchmarks/data_startup.py --sizes-mb 1 100 1000 --max-tokenize-mb 100

``--baseline-src SRC`` times the cached and pre-tokenised cells with another checkout's package
too (``git archive COMMIT src | tar -x -C DIR``, then ``--baseline-src DIR/src``), alternating
run by run with this code's, so both see the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
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
    """A store of ``size_mb`` of random ids in documents of 64 .. 2047 tokens (about 1,000 on
    average, as web text has: 500k documents per GB), so costs per document are measured."""
    import torch

    from pipeoffload.training.token_store import write_store

    tokens = int(size_mb * (1 << 20)) // 2
    generator = torch.Generator().manual_seed(0)
    lengths = random.Random(0)

    def documents():
        first = 0
        while first < tokens:
            n = min(lengths.randrange(64, 2048), tokens - first)
            yield torch.randint(2, 1000, (n,), generator=generator).tolist()
            first += n

    write_store(folder, documents(), eos=1, vocab_size=1000)


def timed(argv: list[str], env: dict[str, str], reps: int = 1) -> tuple[float, float]:
    """(wall, CPU) seconds of the fastest of ``reps`` runs (the least disturbed by other load);
    CPU is the process's user + system time, which other load disturbs far less."""
    return min(_timed(argv, env) for _ in range(reps))


def _timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pipeoffload.cli", *argv], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def cell(times: tuple[float, float], baseline: tuple[float, float] | None = None) -> str:
    """``wall / CPU`` seconds, with the baseline's after an arrow's tail (``before -> now``)."""
    now = f"{times[0]:.1f} / {times[1]:.1f}"
    return now if baseline is None else f"{baseline[0]:.1f} / {baseline[1]:.1f} -> {now}"


def compared(argv: list[str], env: dict[str, str], old: dict[str, str] | None,
             reps: int) -> str:
    """The cell of ``argv``: this code, and with ``old`` the baseline's, run alternately (so
    both see the same load); the fastest of ``reps`` each."""
    if old is None:
        return cell(timed(argv, env, reps))
    runs = [(timed(argv, old), timed(argv, env)) for _ in range(reps)]
    return cell(min(r[1] for r in runs), min(r[0] for r in runs))


def train_argv(data: Path, tokenizer: Path | None) -> list[str]:
    argv = ["train", "--model", "tiny", "--pp", "2", "--inline", "--steps", "1", "--no-baseline",
            "--no-png",
            "--data", str(data), "--seq-len", "64", "--batch-size", "8"]
    return argv + (["--tokenizer", str(tokenizer)] if tokenizer else [])


def measure(size_mb: float, root: Path, tokenize: bool, reps: int, baseline: str | None
            ) -> list[object]:
    env = {**os.environ, "PIPEOFFLOAD_CACHE": str(root / "cache")}
    old = None if baseline is None else {**env, "PYTHONPATH": baseline}
    store = root / "store"
    row: list[object] = [f"{size_mb:g} MB"]
    if tokenize:
        corpus = root / "corpus.jsonl"
        write_corpus(corpus, size_mb)
        tok = write_tokenizer(root / "tok", corpus)
        row.append(cell(timed(train_argv(corpus, tok), env)))  # fills the cache: once
        row.append(compared(train_argv(corpus, tok), env, old, reps))
        row.append(cell(timed(["tokenize", str(corpus), str(store), "--tokenizer", str(tok),
                               "--quiet"], env)))
    else:
        start = time.perf_counter()
        write_random_store(store, size_mb)
        row += ["-", "-", f"(a store of random ids, written directly in "
                f"{time.perf_counter() - start:.0f} s)"]
    row.append(compared(train_argv(store, None), env, old, reps))
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
                        help="also time the cached and pre-tokenised runs with the package in "
                        "SRC (another checkout's src/: the code before a change), alternating "
                        "with this code's runs")
    args = parser.parse_args()
    print(machine_summary())
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    rows = []
    for size in args.sizes_mb:
        with tempfile.TemporaryDirectory(prefix="data_startup.") as folder:
            rows.append(measure(size, Path(folder), size <= args.max_tokenize_mb, args.reps,
                                args.baseline_src))
            print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    print("cells: wall / CPU seconds (with --baseline-src: baseline -> this code)")
    print(format_table(["corpus", "tokenizer, first run", "tokenizer, cached",
                        "pipeoffload tokenize", "pre-tokenised"], rows))
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
