"""The makespan of a schedule without transfers, by one pass over its dependency graph: the
simulator's arithmetic for compute alone, without its timeline, memory curves or queues.

A planner prices one schedule under many cost models (TP degree, microbatch size, recompute
change the stage times, not the order). ``ComputeGraph`` keeps what does not depend on the
costs (each action's rank, its dependencies and whether they cross ranks, an order in which
every action comes after its dependencies and its rank's previous action) and ``makespan``
replays it per cost model. With every action on a rank's compute lane and no host-link queues,
the simulator places each action at max(its rank's previous end, each dependency's end + the
P2P latency if it crossed ranks) and ends it a duration later; this pass does the same
additions and comparisons, so it returns the simulator's makespan exactly
(tests/test_simulator.py checks equality over the zoo and random costs). Schedules with
transfers, communication actions or overlapped F&B pairs need the simulator.
"""

from __future__ import annotations

from pipeoffload.core.actions import Action, Kind
from pipeoffload.core.deps import numbering
from pipeoffload.core.errors import ScheduleError
from pipeoffload.core.schedule import Schedule
from pipeoffload.sim.costs import CostModel

#: The kinds this pass handles: compute on the rank's lane, nothing queued.
COMPUTE_KINDS = frozenset({Kind.F, Kind.I, Kind.W, Kind.B, Kind.RECOMPUTE})


class ComputeGraph:
    """The cost-independent part of simulating a compute-only ``schedule`` (see the module
    docstring). Raises ScheduleError for other kinds or a deadlock."""

    def __init__(self, schedule: Schedule) -> None:
        kinds = {a[1] for actions in schedule.ranks for a in actions}
        if not kinds <= COMPUTE_KINDS:
            others = ", ".join(sorted(k.value for k in kinds - COMPUTE_KINDS))
            raise ScheduleError(f"ComputeGraph: {schedule.name} has {others} actions; "
                                "simulate it instead")
        self.schedule = schedule
        numbered = numbering(schedule)  # kept with the schedule: numbered once
        if numbered.repeated:
            raise ScheduleError(f"ComputeGraph: {schedule.name} has an action twice; "
                                "pipeoffload.core.validate.validate(schedule) says where")
        actions, owner, needs = numbered.actions, numbered.owner, numbered.needs
        self.actions = actions
        # A topological order that keeps each rank's program order: the validator's walk.
        order, _ = numbered.walk
        if len(order) != len(actions):
            raise ScheduleError(f"ComputeGraph: {schedule.name} deadlocks; "
                                "pipeoffload.core.validate.validate(schedule) says where")
        passes = {Kind.F, Kind.I, Kind.W, Kind.B}  # what compute time counts
        counted = [a[1] in passes for a in actions]
        # Per action in that order: its index, rank, whether it counts as compute, and the
        # indices of its dependencies.
        self.steps = [(i, owner[i], counted[i], needs[i]) for i in order]
        self.owner = owner

    def durations(self, costs: CostModel) -> list[float]:
        """Each action's duration under ``costs``, by index."""
        took = {kind: [costs.compute_time(Action(s, kind, 0))
                       for s in range(self.schedule.num_stages)] for kind in COMPUTE_KINDS}
        return [took[kind][stage] for stage, kind, _ in self.actions]

    def makespan(self, costs: CostModel) -> tuple[float, tuple[float, ...]]:
        """(the makespan, each rank's compute time) under ``costs``, as ``simulate`` finds
        them (compute time: each F, I, W, B's end - start, summed in program order)."""
        if costs.overlap_f_b is not None:
            raise ValueError("ComputeGraph.makespan: overlapped F&B pairs need the simulator")
        duration = self.durations(costs)
        p2p = costs.p2p_time
        end = [0.0] * len(duration)
        last = [0.0] * self.schedule.num_ranks
        compute = [0.0] * self.schedule.num_ranks
        owner = self.owner
        for i, rank, counted, deps in self.steps:
            ready = last[rank]
            for dep in deps:
                at = end[dep]
                if owner[dep] != rank:
                    at += p2p
                if at > ready:
                    ready = at
            end[i] = last[rank] = done = ready + duration[i]
            if counted:
                compute[rank] += done - ready
        return max(last, default=0.0), tuple(compute)
