"""No function or method in src/ is longer than 80 lines (docstring included), so each one fits
on a screen and does one thing a reader can hold; the offenders are listed."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 80


def long_functions(root: Path, max_lines: int = MAX_LINES) -> list[str]:
    """``path:line name (N lines)`` for each function under ``root`` longer than ``max_lines``
    (from its ``def`` line to its last line; nested functions count in their own right)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > max_lines:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} "
                                 f"({lines} lines)")
    return found


def test_no_function_is_longer_than_80_lines() -> None:
    offenders = long_functions(SOURCE)
    assert not offenders, f"functions over {MAX_LINES} lines:\n" + "\n".join(offenders)


def test_the_count_runs_from_def_to_the_last_line(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES - 1))
    (tmp_path / "m.py").write_text(f"def fits():\n{body}\n\n\ndef long():\n{body}\n    return 0\n")
    assert long_functions(tmp_path) == [f"m.py:{MAX_LINES + 3} long ({MAX_LINES + 1} lines)"]
