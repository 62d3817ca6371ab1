"""The control plane's own cost in the simulator: one run is one workflow, and every claim and report is an update
that takes one workflow task. Pure and clock-free: the simulator passes the time in.

What is modelled (workflows/training_run.py, `_continue_as_new`):
- one server: a run's workflow tasks run one at a time (Temporal serialises a workflow's tasks), so updates queue
  behind each other, FIFO. An update sent at t is answered at max(t, server free) + task_s, plus rtt_s on the wire;
- continue-as-new every `updates_per_segment` updates: the new run's first task waits `continue_as_new_s`, and every
  replica's generation stops for `handover_s`. As the stack ships (run.handover_keep) a replica parks with its groups
  in its engine and the new run's activity adopts it, so that is all it costs; with `writes_out`
  (run.handover_keep = false) it also writes its in-flight groups to its pool and prefills them again in the new run;
- a step's trainer activity, when the trainer waited for its batch, starts `dispatch_s` after the report that
  completed the batch was answered (the activity's schedule-to-start and the trainer's head).

Where each figure comes from is in sim/params.py (CONTROL_PLANE_*). A saturated server (updates arrive faster than
1 / task_s) shows as answers that come later and later: the queue is the simulator's, not a formula's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ControlPlaneCost:
    task_s: float  # one workflow task: the control worker's and the server's time per update, serial per run
    rtt_s: float  # the update's round trip outside the queue (client, frontend, history service)
    dispatch_s: float  # a trainer activity scheduled after a report: schedule-to-start plus the trainer's head
    updates_per_segment: int  # run.updates_per_segment: continue-as-new after this many updates
    continue_as_new_s: float  # the new run's first workflow task (state carried over) and its start
    handover_s: float  # each replica at a continue-as-new: from its park (or pool write) to its first claim answered
    writes_out: bool = False  # run.handover_keep = false: in-flight groups written out and prefilled again

    def __post_init__(self) -> None:
        for name in ("task_s", "rtt_s", "dispatch_s", "continue_as_new_s", "handover_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"ControlPlaneCost.{name}={getattr(self, name)}: give seconds >= 0")
        if self.updates_per_segment < 1:
            raise ValueError(f"ControlPlaneCost.updates_per_segment={self.updates_per_segment}: give 1 or more")

    def scaled(self, factor: float) -> ControlPlaneCost:
        """The same costs in the modelled engine's seconds (a wall second is `factor` modelled ones: its speedup)."""
        return replace(self, task_s=self.task_s * factor, rtt_s=self.rtt_s * factor, dispatch_s=self.dispatch_s * factor,
                       continue_as_new_s=self.continue_as_new_s * factor, handover_s=self.handover_s * factor)


@dataclass
class ControlServer:
    """The run's workflow as a FIFO server of updates. `send(now)` returns (answered_at, handover): the time the
    update's answer reaches its replica, and whether this update ended a segment (every replica hands over)."""

    cost: ControlPlaneCost
    free_at: float = 0.0  # when the workflow can take its next task
    updates: int = 0  # updates in the current segment
    total: int = 0
    segments: int = 1
    busy_s: float = 0.0  # workflow task time spent (utilisation = busy_s / elapsed)
    queued_s: float = 0.0  # time updates waited behind others
    max_queued_s: float = 0.0

    def send(self, now: float) -> tuple[float, bool]:
        c = self.cost
        start = max(now, self.free_at)
        waited = start - now
        self.queued_s += waited
        self.max_queued_s = max(self.max_queued_s, waited)
        self.free_at = start + c.task_s
        self.busy_s += c.task_s
        self.updates += 1
        self.total += 1
        handover = self.updates >= c.updates_per_segment
        if handover:
            self.updates = 0
            self.segments += 1
            self.free_at += c.continue_as_new_s
        return self.free_at + c.rtt_s, handover

    def task(self, now: float) -> None:
        """A workflow task nobody waits for (an activity's result): it holds the server, it is not an update."""
        start = max(now, self.free_at)
        self.free_at = start + self.cost.task_s
        self.busy_s += self.cost.task_s

    def stats(self, elapsed_s: float) -> dict[str, float]:
        return {"updates": self.total, "segments": self.segments,
                "utilisation": round(self.busy_s / elapsed_s, 4) if elapsed_s > 0 else 0.0,
                "queued_mean_s": round(self.queued_s / self.total, 6) if self.total else 0.0,
                "queued_max_s": round(self.max_queued_s, 6)}
