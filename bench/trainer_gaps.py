"""Where the trainer's `wait_control_plane` goes: each gap between two trainer activities of one run, split by
the run's workflow history into who held it (issue 37's profile).

A gap runs from the trainer's end of one activity's last step (its step record's `time`) to the start of the
next activity's first step (`time - busy_s`). In between, in order:
- `trainer_tail`: the trainer worker returns the result (serialise, stop the heartbeat thread, complete RPC);
- `to_workflow_task`: the server records the completion and the control worker picks up the workflow task that
  carries it; the control worker runs one task at a time, so claim and report updates queued before it are
  paid here (`updates_before` counts those accepted in between);
- `workflow_task`: the workflow code and the SDK on the control worker (commit the step, build the next input);
- `batch_not_ready`: that task scheduled no step (no complete batch yet): the workflow waited for a report;
- `schedule_to_start`: matching and the trainer worker's poll;
- `trainer_head`: the trainer worker starts the activity (deserialise, heartbeat thread) until the step begins.
A step the workflow scheduled before the previous one ended (issue 37's hand-ahead) has a gap of
`trainer_tail` + `schedule_to_start` + `trainer_head` only.

`python -m bench.trainer_gaps RUN_ID` (the LAMINAR_* settings name the Temporal and the store) prints the table.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

from temporalio.api.enums.v1 import EventType

from laminar import contract

TRAIN_ACTIVITIES = {contract.TRAIN_STEP, contract.TRAIN_STEPS}
PARTS = ("trainer_tail", "to_workflow_task", "workflow_task", "batch_not_ready", "schedule_to_start",
         "trainer_head")


@dataclass
class Activity:
    scheduled_id: int
    scheduled_at: float
    started_at: float | None = None
    completed_at: float | None = None
    completed_id: int | None = None


@dataclass
class Gap:
    parts: dict[str, float] = field(default_factory=dict)
    updates_before: dict[str, int] = field(default_factory=dict)  # updates accepted between completion and task
    workflow_tasks: int = 0  # workflow tasks completed between the completion and the next step's scheduling


def _ts(event: Any) -> float:
    return event.event_time.seconds + event.event_time.nanos / 1e9


def train_activities(events: list[Any]) -> tuple[list[Activity], list[Any]]:
    """The run's trainer activities in scheduling order, and the events (for gaps_of)."""
    acts: dict[int, Activity] = {}
    for e in events:
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            if e.activity_task_scheduled_event_attributes.activity_type.name in TRAIN_ACTIVITIES:
                acts[e.event_id] = Activity(e.event_id, _ts(e))
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            a = acts.get(e.activity_task_started_event_attributes.scheduled_event_id)
            if a is not None:
                a.started_at = _ts(e)
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            a = acts.get(e.activity_task_completed_event_attributes.scheduled_event_id)
            if a is not None:
                a.completed_at, a.completed_id = _ts(e), e.event_id
    return [a for _, a in sorted(acts.items())], events


def gaps_of(events: list[Any], acts: list[Activity], step_ends: list[tuple[float, float]]) -> list[Gap]:
    """One Gap per activity after the first: step_ends[i] = (start, end) of activity i's steps on the trainer's
    clock (the first step's start, the last step's end)."""
    out: list[Gap] = []
    by_id = {e.event_id: e for e in events}
    for prev, nxt, (_, prev_end), (nxt_start, _) in zip(acts, acts[1:], step_ends, step_ends[1:], strict=False):
        if prev.completed_id is None or nxt.started_at is None:
            continue
        g = Gap()
        if nxt.scheduled_id < prev.completed_id:  # scheduled ahead: no workflow task between the steps
            g.parts = {"trainer_tail": prev.completed_at - prev_end, "schedule_to_start": 0.0,
                       "trainer_head": nxt_start - max(prev.completed_at, nxt.started_at)}
            g.parts["schedule_to_start"] = max(0.0, nxt.started_at - prev.completed_at)
            out.append(g)
            continue
        wt_started = wt_completed = None
        for i in range(prev.completed_id + 1, nxt.scheduled_id):
            e = by_id.get(i)
            if e is None:
                continue
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED and wt_started is None:
                wt_started = _ts(e)
            elif e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
                g.workflow_tasks += 1
                if wt_completed is None:
                    wt_completed = _ts(e)
            elif e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED and wt_completed is None:
                name = e.workflow_execution_update_accepted_event_attributes.accepted_request.input.name
                g.updates_before[name] = g.updates_before.get(name, 0) + 1
        if wt_started is None or wt_completed is None:
            continue
        g.parts = {
            "trainer_tail": prev.completed_at - prev_end,
            "to_workflow_task": wt_started - prev.completed_at,
            "workflow_task": wt_completed - wt_started,
            "batch_not_ready": nxt.scheduled_at - wt_completed,
            "schedule_to_start": nxt.started_at - nxt.scheduled_at,
            "trainer_head": nxt_start - nxt.started_at,
        }
        out.append(g)
    return out


def table(gaps: list[Gap], steps: int) -> str:
    lines = [f"{len(gaps)} gaps between trainer activities over {steps} steps "
             f"({len(gaps) / max(1, steps):.2f} a step)",
             f"{'part':<20}{'total s':>9}{'mean ms':>9}{'p50 ms':>8}{'p99 ms':>8}  held by"]
    held = {"trainer_tail": "trainer worker", "to_workflow_task": "server + control worker queue",
            "workflow_task": "control worker", "batch_not_ready": "replicas (report)",
            "schedule_to_start": "server (matching) + trainer poll", "trainer_head": "trainer worker"}
    total = 0.0
    for p in PARTS:
        xs = sorted(g.parts[p] for g in gaps if p in g.parts and g.parts[p] == g.parts[p])  # NaN: no step record
        if not xs:
            continue
        total += sum(xs)
        lines.append(f"{p:<20}{sum(xs):>9.2f}{1e3 * statistics.fmean(xs):>9.1f}{1e3 * xs[len(xs) // 2]:>8.1f}"
                     f"{1e3 * xs[min(len(xs) - 1, int(len(xs) * 0.99))]:>8.1f}  {held[p]}")
    lines.append(f"{'sum':<20}{total:>9.2f}")
    ups: dict[str, int] = {}
    for g in gaps:
        for k, v in g.updates_before.items():
            ups[k] = ups.get(k, 0) + v
    n = max(1, len(gaps))
    lines.append("updates the control worker took before the trainer's task, per gap: "
                 + ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(ups.items())))
    lines.append(f"workflow tasks completed between a step's end and the next step's scheduling, per gap: "
                 f"{sum(g.workflow_tasks for g in gaps) / n:.2f}")
    return "\n".join(lines)


async def _main(run_id: str) -> None:
    from laminar.client.connect import connect, store_for
    from laminar.client.settings import Settings
    from laminar.storage import keys

    settings = Settings.from_env()
    client = await connect(settings)
    events: list[Any] = []
    # every segment of the run (continue-as-new): follow the chain from the first run
    desc = [w async for w in client.list_workflows(f"WorkflowId = 'run/{run_id}'")]
    for w in sorted(desc, key=lambda w: w.start_time):
        hist = await client.get_workflow_handle(w.id, run_id=w.run_id).fetch_history()
        events.extend(_renumber(hist.events, len(events)))
    store = store_for(settings)
    records = []
    for key in store.list(keys.step_metrics_prefix(run_id)):
        records.append(json.loads(store.get(key)))
    records.sort(key=lambda r: r["step"])
    acts, events = train_activities(events)
    # the steps of each activity: records in order, as many as each activity's result held (one, or a run of them)
    ends: list[tuple[float, float]] = []
    for a in acts:  # a record's scheduled_at is its activity's first scheduling (within float rounding)
        rs = [r for r in records if abs((r.get("scheduled_at") or 0.0) - a.scheduled_at) < 0.002]
        ends.append((rs[0]["time"] - rs[0]["busy_s"], rs[-1]["time"]) if rs else (float("nan"), float("nan")))
    print(table(gaps_of(events, acts, ends), len(records)))


def _renumber(events: list[Any], offset: int) -> list[Any]:
    """Event ids unique across segments (each segment's history starts at 1)."""
    out = []
    for e in events:
        e.event_id += offset
        attrs = (e.activity_task_started_event_attributes, e.activity_task_completed_event_attributes)
        for a in attrs:
            if a.scheduled_event_id:
                a.scheduled_event_id += offset
        out.append(e)
    return out


if __name__ == "__main__":
    asyncio.run(_main(sys.argv[1]))
