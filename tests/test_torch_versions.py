"""The table of torch versions pipeoffload.torch was tested on (pure Python: no torch needed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeoffload.errors import IntegrationError
from pipeoffload.integrations.torch_versions import (
    SUPPORTED_TORCH,
    TESTED,
    check_torch_version,
    torch_pipelining,
)


@pytest.mark.parametrize("version", ["2.12.1", "2.13.1+cpu", "2.14.1", "2.15.0+cu132"])
def test_tested_versions_are_accepted_with_their_row(version):
    check_torch_version(version)
    row = torch_pipelining(version)
    assert version.startswith(row.version + ".")
    assert row.send_waits == (row.version == "2.15")


@pytest.mark.parametrize("version", ["2.11.0", "2.10.0", "2.7.0", "2.16.0", "3.0.0", "2.1.0+cpu"])
def test_untested_versions_are_refused_naming_the_tested_range(version):
    with pytest.raises(IntegrationError, match=rf"tested on torch 2\.12 to 2\.15; this is torch "
                                               rf"{re.escape(version)}\. .*pipeoffload\.Pipeline"):
        check_torch_version(version)


def test_the_table_is_ordered_and_the_declared_floor_is_its_first_row():
    versions = [tuple(int(p) for p in row.version.split(".")) for row in TESTED]
    assert versions == sorted(set(versions))
    assert SUPPORTED_TORCH == tuple(row.version for row in TESTED)
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert re.findall(r'^torch = \["torch>=([0-9.]+)"\]', pyproject, re.M) == [TESTED[0].version]
