"""Imports point one way (docs/architecture.md): every import of every module, at any depth
(inside functions and under TYPE_CHECKING too), goes to its own layer or one above it, no
modules import each other around a circle, and the pure layers import no torch. The layer
order is read from docs/architecture.md's table, the one place that says it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "pipeoffload"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
PURE = ("core", "sim", "offload", "planner")
TORCH_SIDE = ("runtime", "integrations", "parallel", "training", "cli")


def module_names(package: Path) -> dict[str, Path]:
    """{dotted module name: file} of every module of the package rooted at ``package``."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imported_modules(module: str, path: Path, modules: Iterable[str]) -> set[str]:
    """The modules of the package ``module`` imports, at any depth of its file: ``from a
    import b`` is module ``a.b`` when there is one, else ``a``; relative imports resolved."""
    known = set(modules)
    found: set[str] = set()

    def add(name: str) -> None:
        while name and name not in known:  # an attribute: its module
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package_of(module, path).split(".")
                anchor = ".".join(package[:len(package) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    modules = module_names(package)
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def external_imports(path: Path) -> set[str]:
    """Every absolute module name ``path`` imports, at any depth (torch's included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def read_layers(page: Path) -> dict[str, int]:
    """{package or module: layer} from the table of ``page`` (rows ``| N | `name`, ... |``)."""
    layers = {}
    for line in page.read_text().splitlines():
        row = re.match(r"^\|\s*(\d+)\s*\|([^|]*)\|", line)
        if row:
            for name in re.findall(r"`([\w.]+)`", row.group(2)):
                layers[name] = int(row.group(1))
    return layers


def layer_of(module: str, layers: Mapping[str, int], root: str) -> int | None:
    """The layer of the longest entry ``module`` is or lies inside; the package's root entry
    holds only the root module itself (a new subpackage must get its own row)."""
    if module == root:
        return layers.get(root)
    entries = [e for e in layers if e != root and (module == e or module.startswith(e + "."))]
    return layers[max(entries, key=len)] if entries else None


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """One circle of imports (first module repeated at the end) per strongly connected
    group of modules that import each other, directly or around."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 1000))
    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [_circle(sorted(group)[0], group, graph) for group in groups]


def _circle(start: str, group: set[str], graph: Mapping[str, set[str]]) -> list[str]:
    """A shortest path from ``start`` back to itself inside ``group``."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(f"{start} is in a cycle but no path returns to it")


def layer_violations(graph: Mapping[str, set[str]], layers: Mapping[str, int],
                     root: str) -> list[str]:
    """Each import of a lower layer's module from a higher one's (and each module without a
    layer), as a line naming both."""
    problems = []
    for module in sorted(graph):
        mine = layer_of(module, layers, root)
        if mine is None:
            problems.append(f"{module} has no layer in docs/architecture.md's table")
            continue
        for target in sorted(graph[module]):
            theirs = layer_of(target, layers, root)
            if theirs is not None and theirs > mine:
                problems.append(f"{module} (layer {mine}) imports {target} (layer {theirs})")
    return problems


def test_no_modules_import_each_other_around_a_circle() -> None:
    found = cycles(import_graph(PACKAGE))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_no_layer_imports_a_layer_below_it() -> None:
    problems = layer_violations(import_graph(PACKAGE), read_layers(ARCHITECTURE), "pipeoffload")
    assert not problems, "\n".join(problems)


def test_the_architecture_page_names_every_layer_once() -> None:
    layers = read_layers(ARCHITECTURE)
    assert sorted(set(layers.values())) == list(range(11)), layers
    modules = module_names(PACKAGE)
    assert all(name in modules for name in layers), set(layers) - set(modules)


@pytest.mark.parametrize("path", sorted(p for folder in PURE for p in (PACKAGE / folder).rglob(
    "*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_pure_layers_import_no_torch_side_package(path: Path) -> None:
    bad = {name for name in external_imports(path)
           if name.split(".")[0] == "torch"
           or any(name.startswith(f"pipeoffload.{side}") for side in TORCH_SIDE)}
    assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}"


def _closure(start: str, graph: Mapping[str, set[str]]) -> set[str]:
    """``start`` and every module it imports, directly or not, with the subpackages whose
    ``__init__`` importing them runs (the root's torch-side names are imported on first use,
    never on import: tests/test_pure_core.py)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo.extend(graph[module])
        parent = module.rpartition(".")[0]
        if "." in parent:
            todo.append(parent)
    return seen


@pytest.mark.parametrize("start", ["pipeoffload.distributed", "pipeoffload.hf"])
def test_the_library_imports_nothing_of_the_application(start: str) -> None:
    graph = import_graph(PACKAGE)
    reached = _closure(start, graph)
    bad = sorted(m for m in reached if m.startswith(("pipeoffload.training",
                                                     "pipeoffload.cli")))
    assert not bad, f"{start} reaches {bad}"


def test_the_training_config_imports_no_torch() -> None:
    """TrainConfig is torch-free: the command line builds and checks it before torch."""
    modules = module_names(PACKAGE)
    reached = _closure("pipeoffload.training.train", import_graph(PACKAGE))
    torch_side = sorted(m for m in reached if m != "pipeoffload"
                        and any(n.split(".")[0] == "torch"
                                for n in external_imports(modules[m])))
    assert not torch_side, f"pipeoffload.training.train reaches torch through {torch_side}"
    code = ("import sys\nfrom pipeoffload.training.train import TrainConfig, build_plan\n"
            "build_plan(TrainConfig(pp=2, steps=3))\n"
            "from pipeoffload.cli.train import config_from_args\n"
            "from pipeoffload.cli.train_options import train_parser\n"
            "config_from_args(train_parser().parse_args(['--pp', '2']))\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def _fake_package(root: Path, files: Mapping[str, str]) -> Path:
    package = root / "fake"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return package


def test_the_checks_see_every_kind_of_import(tmp_path: Path) -> None:
    """Imports inside functions, under TYPE_CHECKING and relative ones all count, so a circle
    or a downward import hidden there fails the tests above."""
    package = _fake_package(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from fake.low import b
            """,
        "low/b.py": """
            def f():
                from . import a
                import fake.high.c
            """,
        "high/__init__.py": "",
        "high/c.py": "import fake.low\n",
    })
    graph = import_graph(package)
    assert graph["fake.low.a"] == {"fake.low.b"}
    assert graph["fake.low.b"] == {"fake.low.a", "fake.high.c"}
    assert graph["fake.high.c"] == {"fake.low"}
    assert cycles(graph) == [["fake.low.a", "fake.low.b", "fake.low.a"]]
    layers = {"fake": 3, "fake.low": 1, "fake.high": 2}
    assert layer_violations(graph, layers, "fake") == [
        "fake.low.b (layer 1) imports fake.high.c (layer 2)"]
    assert layer_violations(graph, {"fake.low": 1}, "fake")[0] == (
        "fake has no layer in docs/architecture.md's table")
