"""Numeric flags of `simulate` and `plan` under hypothesis: 0, negatives, nan, inf and huge
values are refused with an `error:` line naming the flag, or (where legal, e.g. a zero cost)
answered with a result whose every number is finite; never a traceback."""

from __future__ import annotations

import json
import math
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeoffload.cli.main import main

PLAN = ["plan", "--model", "pipeoffload-42.9b", "--layers", "8", "--hidden", "1024", "--seq",
        "512", "--quiet"]


def finite_numbers(value: object) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(finite_numbers(v) for v in value.values())
    if isinstance(value, list):
        return all(finite_numbers(v) for v in value)
    return True


BAD_NUMBERS = st.one_of(
    st.sampled_from(["0", "-0", "-1", "-0.5", "nan", "-nan", "inf", "-inf", "1e308", "1e400",
                     str(2**63), str(10**30), "0.0"]),
    st.integers(max_value=0).map(str),
    st.integers(min_value=2**22).map(str),
    st.floats(max_value=0.0, allow_nan=False).map(repr),
    st.floats(min_value=1e13).map(repr),
)
SIMULATE_FLAGS = ["--pp", "--microbatches", "--chunks", "--group-size", "--offload-ratio",
                  "--cost-f", "--cost-i", "--cost-w", "--p2p", "--activation-bytes",
                  "--ranks-per-link", "--width"]
PLAN_FLAGS = ["--gpus", "--seq", "--layers", "--hidden", "--memory", "--global-batch", "--top",
              "--tp", "--pp", "--micro-batch-sizes", "--reserve"]


def check_answer(code: int, out: str, err: str, flag: str) -> None:
    """Refused with the flag named, or a result whose every number is finite."""
    assert "Traceback" not in err
    if code != 0:
        assert any("error:" in line and flag in line for line in err.splitlines()), err
        return
    assert finite_numbers(json.loads(out)), out


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(flag=st.sampled_from(SIMULATE_FLAGS), value=BAD_NUMBERS)
def test_simulate_numeric_flags_never_crash_or_go_silently_wrong(flag, value) -> None:
    capture = _Capture()
    with capture:
        code = _main_code(["simulate", "--schedule", "po-f", "--pp", "4", "--microbatches", "8",
                           "--json", f"{flag}={value}"])
    check_answer(code, capture.out, capture.err, flag)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(flag=st.sampled_from(PLAN_FLAGS), value=BAD_NUMBERS)
def test_plan_numeric_flags_never_crash_or_go_silently_wrong(flag, value) -> None:
    capture = _Capture()
    with capture:
        code = _main_code([*PLAN, "--gpus", "8", "--pp", "2", "--tp", "1", "--schedules", "1f1b",
                           "--micro-batch-sizes", "1", "--json", f"{flag}={value}"])
    if code == 3:  # searched, nothing fits: a result, said so on stderr
        assert "error: no configuration fits" in capture.err
        code = 0
    check_answer(code, capture.out, capture.err, flag)


def _main_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


class _Capture:
    """stdout / stderr of one in-process run (hypothesis cannot use function fixtures)."""

    def __enter__(self) -> None:
        import io

        self._saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = io.StringIO(), io.StringIO()

    def __exit__(self, *exc: object) -> None:
        self.out, self.err = sys.stdout.getvalue(), sys.stderr.getvalue()
        sys.stdout, sys.stderr = self._saved
