"""Is a run's workflow wedged, and where would a reset repair it? Pure and clock-free: it reads a workflow
history as a list of workflow-task events and decides; `services/repair.py` fetches the history, checks the
chosen point by replaying the history up to it, and acts.

A run is wedged when its workflow tasks fail and cannot succeed: a nondeterminism error (`[TMPRL1100]`: the
history holds commands that a replay of the workflow's code does not produce, as when a cached run applied a
timed-out task in memory and the next task ran on the advanced instance), or any other error that keeps failing
the run's workflow tasks `FAILING_ATTEMPTS` times in a row. Temporal writes a task's first failure to the history
(and another each time a new event arrives) and counts the rest as attempts of the pending task
(DescribeWorkflowExecution's `pending_workflow_task.attempt`).

Where to reset: to the last workflow task completed before the bad one (`workflow_task_finish_event_id`; never
"the last workflow task", which may be the bad one). The bad task is the one whose commands include the event the
error names (`HistoryEvent(id: N`); where no event is named, the failing task itself. Tasks that timed out or
failed just before the bad one are part of it (the SDK merged them into it), so the reset goes before them too.

A reset that does not help fails the run instead of looping: when the history already holds a reset and no
workflow task has completed since, the same wedge is back at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NONDETERMINISM = "[TMPRL1100]"
FAILING_ATTEMPTS = 5  # workflow tasks failing this many times in a row with any other error: wedged too (no blip)
# kinds of workflow-task events; everything else in a history is "other"
SCHEDULED, STARTED, COMPLETED, TIMED_OUT, FAILED, OTHER = "scheduled", "started", "completed", "timed_out", \
    "failed", "other"
_EVENT_ID = re.compile(r"HistoryEvent\(id: (\d+)")


@dataclass(frozen=True)
class TaskEvent:
    """One history event as the verdict needs it."""

    event_id: int
    kind: str  # SCHEDULED, STARTED, COMPLETED, TIMED_OUT, FAILED or OTHER
    message: str = ""  # a failed task's failure message
    reset: bool = False  # a failed task that marks a reset (cause RESET_WORKFLOW)


@dataclass(frozen=True)
class Verdict:
    """A wedged run: why, the event the error names (or the failing task's), and where to reset."""

    error: str  # the failure message of the failing task (first line)
    nondeterminism: bool
    bad_event_id: int  # the first event that does not replay, or the failing task's scheduled event
    reset_to: int  # a WorkflowTaskCompleted event id (0: none: the run cannot be reset, only failed)
    candidates: tuple[int, ...]  # reset_to, then earlier completed tasks to try when a replay check fails
    give_up: str = ""  # non-empty: do not reset (the reason); fail the run loudly instead


def failures(events: list[TaskEvent], pending_attempt: int) -> int:
    """How many times the run's workflow tasks failed since the last one completed: the failures the history holds
    (a task's first failure, and each after a new event), plus the attempts of the pending task beyond its first
    (the server keeps those out of the history)."""
    streak = 0
    for e in reversed(events):
        if e.kind == COMPLETED or (e.kind == FAILED and e.reset):
            break
        if e.kind == FAILED:
            streak += 1
    return streak + max(0, pending_attempt - 2) if streak else 0


def named_event(message: str) -> int | None:
    """The event id a nondeterminism error names, if any."""
    m = _EVENT_ID.search(message)
    return int(m.group(1)) if m else None


def verdict(events: list[TaskEvent], pending_attempt: int, failing_attempts: int = FAILING_ATTEMPTS) -> Verdict | None:
    """None while the run is healthy; a Verdict when it is wedged.

    `pending_attempt`: the attempt of the pending workflow task (0 when none is pending); `failing_attempts`: how
    many failures of one task (any error but nondeterminism) make a wedge."""
    ends = [e for e in events if e.kind in (COMPLETED, TIMED_OUT, FAILED)]
    last = ends[-1] if ends else None
    if last is None or last.kind != FAILED or last.reset:
        return None  # the last task completed (or timed out: it is retried), or a reset is starting afresh
    nondeterminism = NONDETERMINISM in last.message or "nondeterminism" in last.message.lower()
    if not nondeterminism and failures(events, pending_attempt) < failing_attempts:
        return None  # one failure may be a blip (a worker shutting down mid-task); wait for the attempts
    error = last.message.splitlines()[0] if last.message else "workflow task failed"
    named = named_event(last.message) if nondeterminism else None
    failing_scheduled = _scheduled_before(events, last.event_id)
    bad = named if named is not None else failing_scheduled
    candidates = _reset_candidates(events, bad, named is not None)
    give_up = _did_not_help(events, last.event_id)
    return Verdict(error=error, nondeterminism=nondeterminism, bad_event_id=bad,
                   reset_to=candidates[0] if candidates else 0, candidates=tuple(candidates), give_up=give_up)


def _scheduled_before(events: list[TaskEvent], event_id: int) -> int:
    """The scheduled event of the task that ended at event_id."""
    return max((e.event_id for e in events if e.kind == SCHEDULED and e.event_id < event_id), default=1)


def _reset_candidates(events: list[TaskEvent], bad: int, named: bool) -> list[int]:
    """Completed-task event ids, latest first, that lie before the bad task and the un-completed tasks merged
    into it."""
    if named:  # the bad event is a command of the task that completed last before it
        produced_by = max((e.event_id for e in events if e.kind == COMPLETED and e.event_id < bad), default=0)
        start = _scheduled_before(events, produced_by) if produced_by else bad
    else:
        start = bad
    # walk back over tasks that timed out or failed right before: the SDK merges them into the next one
    ends = [e for e in events if e.kind in (COMPLETED, TIMED_OUT, FAILED) and e.event_id < start]
    while ends and ends[-1].kind != COMPLETED:
        start = _scheduled_before(events, ends[-1].event_id)
        ends.pop()
    return [e.event_id for e in reversed(ends) if e.kind == COMPLETED]


def _did_not_help(events: list[TaskEvent], failed_at: int) -> str:
    """Non-empty when the history holds a reset and no task completed between it and this failure."""
    resets = [e.event_id for e in events if e.kind == FAILED and e.reset and e.event_id < failed_at]
    if not resets:
        return ""
    since = [e for e in events if e.kind == COMPLETED and resets[-1] < e.event_id < failed_at]
    if since:
        return ""
    return (f"the run was reset (event {resets[-1]}) and its first workflow task failed again; a reset does not "
            "repair it")
