"""Wall time and peak memory at the bounds of issue 40's items 7 to 10: the largest input each
accepts, and the refusal just past it.

Run: python benchmarks/input_bounds.py
Each case runs in a child process of its own and prints one table row: what it runs, its exit
status, wall and CPU seconds and peak resident memory (the child's ru_maxrss, from os.wait4). The
JSON-lines cases (item 9) write files of 64 MiB and 300 MB into a temporary folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeoffload.training.sources import MAX_LINE_BYTES

LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=16, intermediate_size=32,
             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=32, head_dim=8, hidden_act="silu")
# The model's skeleton at the layer bound: what `train` builds before any weight exists.
BUILD = ("import json, sys; from pipeoffload.training.hf_model import resolve_model, meta_model; "
         "source = resolve_model(sys.argv[1]); model = meta_model(source.config); "
         "print(sum(1 for _ in model.modules()))")


def run(argv: list[str]) -> tuple[int, float, float, float]:
    """Exit status, wall and CPU seconds (user + system: less sensitive to other jobs) and
    peak RSS (MiB) of ``argv`` in a child process."""
    start = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    return child.returncode, wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def config(folder: Path, name: str, **changes: object) -> str:
    path = folder / f"{name}.json"
    path.write_text(json.dumps({**LLAMA, **changes}))
    return str(path)


def json_lines(path: Path, line_bytes: int) -> str:
    """A JSON-lines file of one record whose line (newline included) is ``line_bytes`` long."""
    head, tail = b'{"text": "', b'"}\n'
    with open(path, "wb") as f:
        f.write(head)
        left = line_bytes - len(head) - len(tail)
        while left > 0:
            f.write(b"a" * min(left, 1 << 24))
            left -= 1 << 24
        f.write(tail)
    return str(path)


def cases(folder: Path) -> list[tuple[str, list[str]]]:
    cli = [sys.executable, "-m", "pipeoffload.cli"]
    train = [*cli, "train", "--pp", "1", "--steps", "1", "--no-png", "--data",
             str(folder / "t.txt"), "--seq-len", "16", "--batch-size", "4"]
    (folder / "t.txt").write_text("text " * 200)
    settings = folder / "big.toml"  # 1 MiB, the most a settings file may hold; a bad last value
    settings.write_text("# a comment line of a long settings file\n" * ((1 << 20) // 42)
                        + "pp = 0\n")
    over = folder / "over.toml"
    over.write_text(settings.read_text() + "#" * 64 + "\n")
    from pipeoffload.planner.hardware import hardware_preset

    hardware = json.loads(hardware_preset("h100-80gb").to_json())
    (folder / "h_max.json").write_text(json.dumps({**hardware, "gpus_per_node": 65536}))
    (folder / "h_over.json").write_text(json.dumps({**hardware, "gpus_per_node": 1e300}))
    data = [*cli, "train", "--model", "tiny", "--pp", "1", "--steps", "1", "--no-png",
            "--no-baseline", "--eval-fraction", "0", "--data"]
    plan = [*cli, "plan", "--model", "gpt3-2.7b", "--gpus", "8", "--quiet", "--no-verdict",
            "--hardware"]
    return [
        ("7: build a 4096-layer model's skeleton (the layer bound)",
         [sys.executable, "-c", BUILD, config(folder, "layers_max", num_hidden_layers=4096)]),
        ("7: train refuses 4097 layers", [*train, "--model", config(
            folder, "layers_over", num_hidden_layers=4097)]),
        ("7: train refuses 10^6 layers", [*train, "--model", config(
            folder, "layers_huge", num_hidden_layers=10**6)]),
        ("7: train refuses vocab 10^8 (past this machine's memory)", [*train, "--model", config(
            folder, "vocab_huge", vocab_size=10**8)]),
        ("8: --config of 1 MiB read and parsed (refused at its last line)",
         [*train, "--config", str(settings)]),
        ("8: --config over 1 MiB refused unread", [*train, "--config", str(over)]),
        ("8: --config /dev/zero refused unread", [*train, "--config", "/dev/zero"]),
        ("9: train on a JSON line of 64 MiB (MAX_LINE_BYTES, the bound)",
         [*data, json_lines(folder / "line_max.jsonl", MAX_LINE_BYTES)]),
        ("9: train refuses a JSON line of 64 MiB + 1 byte",
         [*data, json_lines(folder / "line_over.jsonl", MAX_LINE_BYTES + 1)]),
        ("9: train refuses a JSON line of 300 MB (issue 40's case)",
         [*data, json_lines(folder / "line_huge.jsonl", 300_000_000)]),
        ("10: plan with gpus_per_node 65536 (the bound)", [*plan, str(folder / "h_max.json")]),
        ("10: plan refuses gpus_per_node 1e300", [*plan, str(folder / "h_over.json")]),
    ]


def main() -> None:
    print("| case | exit | wall s | CPU s | peak RSS MiB |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for what, argv in cases(Path(tmp)):
            code, wall, cpu, rss = run(argv)
            print(f"| {what} | {code} | {wall:.1f} | {cpu:.1f} | {rss:.0f} |", flush=True)


if __name__ == "__main__":
    main()
