"""Loading the recording scripts of tests/data (the golden files' writers) as modules, so a test
checks the current code against what the script recorded, with the script's own cases."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

DATA = Path(__file__).resolve().parent / "data"


def load_data_script(name: str) -> ModuleType:
    """tests/data/``name``.py as a module."""
    spec = importlib.util.spec_from_file_location(name, DATA / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
