"""What a user reads: docs that cite only what ships, help that shows defaults, a clear line
where PyTorch is missing, and a train picture that says when copies take no time (issue 25,
point 17)."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

from pipeoffload.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_docs_cite_no_file_users_do_not_have():
    for page in SHIPPED:
        assert "paper-notes" not in page.read_text(), page.name


def test_every_cited_section_of_the_method_page_exists():
    headings = set(re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "method.md").read_text(),
                              re.MULTILINE))
    assert headings == {str(n) for n in range(1, 7)}
    sources = [*SHIPPED, *ROOT.glob("src/**/*.py"), *ROOT.glob("benchmarks/*.py"),
               *ROOT.glob("tests/*.py")]
    cited = set()
    for source in sources:
        for match in re.finditer(r"docs/method\.md sections? (\d+)(?: (?:and|/) (\d+))?",
                                 source.read_text()):
            cited.update(n for n in match.groups() if n)
    assert cited and cited <= headings, cited - headings


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("command", ["simulate", "train"])
def test_every_option_with_a_default_says_it(command):
    missing = []
    for action in _subcommands()[command]._actions:
        if (not action.option_strings or action.help == argparse.SUPPRESS
                or action.default is None or action.default is False
                or isinstance(action, argparse._HelpAction)):
            continue
        if "default" not in (action.help or ""):
            missing.append(action.option_strings[0])
    assert missing == []


def test_microbatch_defaults_say_why_they_differ():
    helps = {name: next(a.help for a in parser._actions if "--microbatches" in a.option_strings)
             for name, parser in _subcommands().items() if name in ("simulate", "train")}
    assert "4 * pp" in helps["simulate"] and "steady state" in helps["simulate"]
    assert "2 * pp" in helps["train"] and "batch of 16" in helps["train"]


@pytest.mark.parametrize("command", [["train", "--pp", "2"], ["probe"]])
def test_a_command_that_needs_torch_says_so_without_it(monkeypatch, capsys, command):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now fails, as uninstalled
    assert main(command) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pipeoffload {command[0]}: error: {command[0]} runs on PyTorch, "
                          "which is not installed: pip install 'pipeoffload[torch]'")
    assert "Traceback" not in err


def test_the_picture_says_when_copies_take_no_time():
    from pipeoffload.api import plan_schedule
    from pipeoffload.sim.render_png import _free_copies, _title

    free = plan_schedule("po-f", 4, 8)  # no offload ratio, no bandwidths: train's CPU model
    timed = plan_schedule("po-f", 4, 8, offload_ratio=0.5)  # the README table's
    plain = plan_schedule("1f1b", 4, 8)
    assert _free_copies(free.result) and "copies take no time" in _title(free.result, None)
    assert not _free_copies(timed.result) and not _free_copies(plain.result)
    # ... which is why po-f holds one chunk there and 1.5 M_a in the README table.
    assert max(free.result.peak_activation) == pytest.approx(0.5, abs=0.02)
    assert timed.result.peak_activation[0] == pytest.approx(1.5)


def test_free_copies_are_drawn_as_ticks(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from pipeoffload.api import plan_schedule
    from pipeoffload.sim import render_png

    drawn: list[str] = []

    class Recording:
        def __init__(self, ax):
            self._ax = ax

        def vlines(self, x, *args, **kwargs):
            drawn.extend(["tick"] * len(x))  # one call draws a lane's ticks of one colour
            return self._ax.vlines(x, *args, **kwargs)

        def __getattr__(self, name):
            return getattr(self._ax, name)

    original = render_png._draw_gantt

    def draw(ax, *args):
        return original(Recording(ax), *args)

    plan = plan_schedule("po-f", 2, 4)
    reloads = sum(t.action.kind.value == "RELOAD" for row in plan.result.timeline for t in row)
    monkeypatch.setattr(render_png, "_draw_gantt", draw)
    render_png.render_png(plan.result, tmp_path / "free.png")
    assert reloads and len(drawn) >= reloads
