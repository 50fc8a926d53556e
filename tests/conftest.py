"""Shared test set-up: the token cache (training/token_cache.py) lives in a temporary folder,
never in the user's ~/.cache, for this process and the processes it starts."""

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
