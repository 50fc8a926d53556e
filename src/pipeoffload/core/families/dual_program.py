"""The per-rank program DualPipe and DualPipeV share (one rank's order of F, B, I and W).

From DeepSeek-AI, "DeepSeek-V3 Technical Report" (arXiv 2412.19437), section 3.2.1, and its
public code (github.com/deepseek-ai/DualPipe, ``DualPipe.step`` and ``DualPipeV.step``; torch
2.13 ships the latter as ``ScheduleDualPipeV``). A rank runs two *phases*, each one stage fed by
one stream of microbatches: phase 0 is the stage nearer the stream's entry. With ``n`` ranks on
the half pipeline and this rank at ``h`` (0 = the entry rank), the program is eight steps:
  1. 2(n-h-1) x F0            warm-up of phase 0
  2. (h+1) x F0 F1
  3. (n-h-1) x I1 W F1        zero bubble: the weight pass fills the wait for the next F1
  4. (c-2n+h+1) x F0 B1, F1 B0   the steady state: each F followed by an overlapped B
  5. (n-h-1) x B1, F1 B0
  6. (h+1) x B1 B0            halfway through, the rest split into I and a queued W
  7. (n-h-1) x W I0
  8. (h+1) x W
W passes run in the order their I's ran. ``F x`` then ``B y`` in steps 4 and 5 is DeepSeek's
overlapped forward-backward pair (Note: [overlapped pair], sim/simulator.py), except step 4's
first F0 B1 on the last rank (h = n-1), which DeepSeek runs apart "to further reduce bubble
size"; ``overlapped_forwards`` names the F that opens each pair (torch runs a pair as one
``OVERLAP_F_B`` action). The entry rank needs c >= 2n microbatches per phase.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from pipeoffload.core.actions import Action, Kind


def dual_program(n: int, h: int, stages: tuple[int, int],
                 streams: tuple[Sequence[int], Sequence[int]]) -> list[Action]:
    """One rank's actions: ``stages[k]`` runs phase k on the microbatches ``streams[k]`` in
    order (both streams of equal length c >= 2n), this rank ``h`` steps from the entry."""
    return _program(n, h, stages, streams)[0]


def overlapped_forwards(n: int, h: int, stages: tuple[int, int],
                        streams: tuple[Sequence[int], Sequence[int]]) -> frozenset[Action]:
    """The forwards of ``dual_program(n, h, stages, streams)`` that open an overlapped pair with
    the backward right after them."""
    return _program(n, h, stages, streams)[1]


def _program(n: int, h: int, stages: tuple[int, int],
             streams: tuple[Sequence[int], Sequence[int]]
             ) -> tuple[list[Action], frozenset[Action]]:
    c = len(streams[0])
    assert len(streams[1]) == c and 0 <= h < n and c >= 2 * n, (n, h, c)
    actions: list[Action] = []
    forwards, backwards = [0, 0], [0, 0]
    weights: deque[Action] = deque()
    pairs: set[Action] = set()

    def forward(phase: int, opens_pair: bool = False) -> None:
        actions.append(Action(stages[phase], Kind.F, streams[phase][forwards[phase]]))
        forwards[phase] += 1
        if opens_pair:
            pairs.add(actions[-1])

    def backward(phase: int, split: bool) -> None:
        mb = streams[phase][backwards[phase]]
        backwards[phase] += 1
        if split:
            actions.append(Action(stages[phase], Kind.I, mb))
            weights.append(Action(stages[phase], Kind.W, mb))
        else:
            actions.append(Action(stages[phase], Kind.B, mb))

    def weight() -> None:
        if weights:
            actions.append(weights.popleft())

    for _ in range(2 * (n - h - 1)):
        forward(0)
    for _ in range(h + 1):
        forward(0)
        forward(1)
    for _ in range(n - h - 1):
        backward(1, split=True)
        weight()
        forward(1)
    for i in range(c - 2 * n + h + 1):
        forward(0, opens_pair=not (i == 0 and h == n - 1))
        backward(1, split=False)
        forward(1, opens_pair=True)
        backward(0, split=False)
    for _ in range(n - h - 1):
        backward(1, split=False)
        forward(1, opens_pair=True)
        backward(0, split=False)
    split = False
    steps = h + 1
    for i in range(steps):
        # DeepSeek switches to split backwards halfway, one pass earlier on odd h.
        if i == steps // 2 and h % 2 == 1:
            split = True
        backward(1, split)
        if i == steps // 2 and h % 2 == 0:
            split = True
        backward(0, split)
    for _ in range(n - h - 1):
        weight()
        backward(0, split)
    for _ in range(h + 1):
        weight()
    assert not weights and forwards == backwards == [c, c]
    return actions, frozenset(pairs)
