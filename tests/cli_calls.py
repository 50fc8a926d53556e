"""`pipeoffload` called in this process, as tests of its refusals call it."""

from __future__ import annotations

import pytest

from pipeoffload.cli.main import main


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The exit status and standard error of ``pipeoffload ARGV``."""
    try:
        code = main(argv)
    except SystemExit as exit:
        code = exit.code
    return code, capsys.readouterr().err
