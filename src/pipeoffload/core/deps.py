"""What each action waits for: the one dependency rule that the validator, the passes, the
simulator and the runtime all use.

Note: [data dependencies]
- F(s, m) needs stage s-1's output for m: RECV_F(s, m) where the schedule has explicit comms,
  else F(s-1, m) directly (a same-rank hand-off in V placement needs no communication).
- I(s, m) / B(s, m) need F(s, m), the output gradient (RECV_B(s, m), or the backward of s+1),
  the activations back on the device (RELOAD(s, m) if offloaded), readable from the host
  (FETCH(s, m)) or rebuilt (RECOMPUTE(s, m)).
- W(s, m) needs I(s, m). OFFLOAD needs F; RELOAD, FETCH and OFFLOAD_WAIT need OFFLOAD;
  RECOMPUTE needs F. (OFFLOAD_WAIT holds the rank's program until the copy out is done: it
  postpones a forward so that device memory is freed before the next allocation.)
- SEND_F / SEND_B follow the computation they send; RECV_x follows the peer's SEND_x.
"Stage s-1" and "stage s+1" are the neighbours on the microbatch's route: the first stage of a
route needs no input and its last no output gradient (Note: [routes], core/schedule.py).
"""

from __future__ import annotations

from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.schedule import Schedule


class Dependencies:
    """Answers ``of(action)`` for one schedule (which kinds are present changes the answer)."""

    def __init__(self, schedule: Schedule) -> None:
        self._present = {a for acts in schedule.ranks for a in acts}
        stages = range(schedule.num_stages)
        self._first = frozenset(s for s in stages if schedule.is_first_stage(s))
        self._last = frozenset(s for s in stages if schedule.is_last_stage(s))

    def has(self, action: Action) -> bool:
        return action in self._present

    def backward_of(self, stage: int, microbatch: int) -> Action:
        """The action that produces stage's input gradient: I if the schedule splits it, else B."""
        split = Action(stage, Kind.I, microbatch)
        return split if split in self._present else Action(stage, Kind.B, microbatch)

    def of(self, action: Action) -> tuple[Action, ...]:
        """The actions that must complete before ``action`` may start."""
        s, kind, m = action
        if kind is Kind.F:
            recv = Action(s, Kind.RECV_F, m)
            if recv in self._present:
                return (recv,)
            return (Action(s - 1, Kind.F, m),) if s not in self._first else ()
        if kind in (Kind.I, Kind.B):
            deps = [Action(s, Kind.F, m)]
            for local in (Action(s, Kind.RELOAD, m), Action(s, Kind.FETCH, m),
                          Action(s, Kind.RECOMPUTE, m)):
                if local in self._present:
                    deps.append(local)
            if s not in self._last:
                recv = Action(s, Kind.RECV_B, m)
                deps.append(recv if recv in self._present else self.backward_of(s + 1, m))
            return tuple(deps)
        if kind is Kind.W:
            return (Action(s, Kind.I, m),)
        if kind in (Kind.OFFLOAD, Kind.RECOMPUTE, Kind.SEND_F):
            return (Action(s, Kind.F, m),)
        if kind in (Kind.RELOAD, Kind.FETCH, Kind.OFFLOAD_WAIT):
            return (Action(s, Kind.OFFLOAD, m),)
        if kind is Kind.SEND_B:
            return (self.backward_of(s, m),)
        if kind is Kind.RECV_F:
            return (Action(s - 1, Kind.SEND_F, m),)
        if kind is Kind.RECV_B:
            return (Action(s + 1, Kind.SEND_B, m),)
        raise AssertionError(f"unhandled kind {kind}")
