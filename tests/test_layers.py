"""Imports point one way (design.md "Layers"): nothing below the command line imports it, and
the pure layers import no torch-side package. Checked on the source text, every module."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "pipeoffload"
PURE = ("core", "sim", "offload", "planner")
TORCH_SIDE = ("runtime", "integrations", "training", "cli")


def imported_modules(path: Path) -> set[str]:
    """Every absolute module a file imports, at any depth (function-level imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def modules_in(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (PACKAGE / folder).rglob("*.py"))


def library_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.relative_to(PACKAGE).parts[0] != "cli")


@pytest.mark.parametrize("path", library_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_nothing_below_the_cli_imports_it(path: Path) -> None:
    bad = {name for name in imported_modules(path) if name.startswith("pipeoffload.cli")}
    assert not bad, f"{path.relative_to(PACKAGE)} imports the command line: {sorted(bad)}"


@pytest.mark.parametrize("path", modules_in(*PURE), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_pure_layers_import_no_torch_side_package(path: Path) -> None:
    bad = {name for name in imported_modules(path)
           if name.split(".")[0] == "torch"
           or any(name.startswith(f"pipeoffload.{side}") for side in TORCH_SIDE)}
    assert not bad, f"{path.relative_to(PACKAGE)} imports {sorted(bad)}"


def test_the_checks_see_imports() -> None:
    """The walk finds function-level imports, so the two tests above can fail."""
    found = imported_modules(PACKAGE / "cli" / "main.py")
    assert "pipeoffload.cli.train" in found and "pipeoffload.cli.preflight" in found
