"""Shared test set-up: the token cache (training/token_cache.py) lives in a temporary folder,
never in the user's ~/.cache, for this process and the processes it starts; ``no_training``
for tests of what `pipeoffload train` refuses before any work."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def _token_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    before = os.environ.get("PIPEOFFLOAD_CACHE")
    os.environ["PIPEOFFLOAD_CACHE"] = str(tmp_path_factory.mktemp("token-cache"))
    yield
    if before is None:
        os.environ.pop("PIPEOFFLOAD_CACHE", None)
    else:
        os.environ["PIPEOFFLOAD_CACHE"] = before


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records any attempt to start training (in this process or as local processes)."""
    from pipeoffload.cli import train as train_cli

    started: list[str] = []
    monkeypatch.setattr(train_cli, "run_worker", lambda *a, **k: started.append("run") or 0)
    monkeypatch.setattr(train_cli, "_self_launch", lambda *a, **k: started.append("launch") or 0)
    return started
