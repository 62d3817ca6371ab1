"""The repairer: finds training runs whose workflow is wedged and resets them (services/repair_verdict.py decides).

Every control worker runs one (workers/processes.py), so a repairer lives as long as any process that serves the
runs: `laminar run` and `laminar workers` both start a control worker. Each sweep lists the running training runs,
and for each whose pending workflow task is on its second attempt or later, or whose newest workflow-task end is a
failure (a healthy run's is a completion), reads its history and asks `services.repair_verdict.verdict`. For a wedged run it:
- checks the reset point by replaying the history up to it (and that point's commands) with this worker's own
  workflow code; an earlier completed task is tried when it does not replay;
- resets the run to that point without reapplying the updates that came after it (their callers have gone: a
  replica's claim is leased again by the ledger, a report of a lease the reset run does not hold is a duplicate);
  signals are reapplied;
- signals the new run `workflow_reset` (the status and the run's events show it), writes a record under the run in
  the store (the chaos checker counts them), counts it in `laminar_control_workflow_resets_total`, and logs
  `workflow_reset` with the error, the event ids and the steps redone;
- fails the run loudly (terminates it with the reason) when a reset did not help: the same wedge came back before
  any workflow task completed.

Several control workers may find the same wedge: the reset's request id is derived from (run, reset point), and a
repairer resets only the run that is still the workflow id's current run, so one reset happens.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType, ResetReapplyExcludeType, WorkflowTaskFailedCause
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.client import Client, WorkflowHistory
from temporalio.service import RPCError
from temporalio.worker import Replayer

from laminar import contract
from laminar.contract import WorkflowReset
from laminar.logs import get_logger
from laminar.services import repair_verdict
from laminar.storage import keys
from laminar.storage.objects import ObjectStore

log = get_logger(__name__)

SWEEP_S = contract.REPAIR_SWEEP_S  # how often the repairer looks: a wedged run is repaired within about this long
_KIND = {
    EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED: repair_verdict.SCHEDULED,
    EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED: repair_verdict.STARTED,
    EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED: repair_verdict.COMPLETED,
    EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT: repair_verdict.TIMED_OUT,
    EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED: repair_verdict.FAILED,
}
_RESET_CAUSE = WorkflowTaskFailedCause.WORKFLOW_TASK_FAILED_CAUSE_RESET_WORKFLOW


def task_events(history: WorkflowHistory) -> list[repair_verdict.TaskEvent]:
    """The history as laminar.services.repair_verdict reads it."""
    out = []
    for e in history.events:
        kind = _KIND.get(e.event_type, repair_verdict.OTHER)
        if kind == repair_verdict.FAILED:
            a = e.workflow_task_failed_event_attributes
            out.append(repair_verdict.TaskEvent(e.event_id, kind, a.failure.message, a.cause == _RESET_CAUSE))
        else:
            out.append(repair_verdict.TaskEvent(e.event_id, kind))
    return out


def prefix_through(history: WorkflowHistory, completed_event_id: int) -> WorkflowHistory:
    """The history up to a completed workflow task and its commands (the events before the next task)."""
    ids = [e.event_id for e in history.events]
    later = [e.event_id for e in history.events if e.event_id > completed_event_id
             and e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED]
    end = later[0] - 1 if later else ids[-1]
    return WorkflowHistory(history.workflow_id, [e for e in history.events if e.event_id <= end])


@dataclass
class Outcome:
    """What one repair did: `reset` (with the record), `failed` (the run was terminated: reason), or `skipped`."""

    workflow_id: str
    action: str
    reason: str = ""
    record: WorkflowReset | None = None


class Repairer:
    """Sweeps the running training runs of one namespace and repairs the wedged ones."""

    def __init__(self, client: Client, workflows: Sequence[type], store: ObjectStore | None = None,
                 on_reset: Callable[[WorkflowReset], None] | None = None, data_converter=None,
                 workflow_type: str = contract.TRAINING_RUN_WORKFLOW,
                 failing_attempts: int = repair_verdict.FAILING_ATTEMPTS) -> None:
        self.client = client
        self.failing_attempts = failing_attempts
        self.workflow_type = workflow_type
        self.store = store
        self.on_reset = on_reset
        self.replayer = Replayer(workflows=list(workflows),
                                 data_converter=data_converter or client.data_converter)

    async def forever(self, sweep_s: float = SWEEP_S) -> None:
        """Sweep every sweep_s until cancelled; an error in one sweep is logged and the next one runs."""
        while True:
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the server restarting, a list call refused: the next sweep retries
                log.warning("repair_sweep_failed", error=str(e))
            await asyncio.sleep(sweep_s)

    async def sweep(self) -> list[Outcome]:
        query = f'WorkflowType = "{self.workflow_type}" AND ExecutionStatus = "Running"'
        found = [(wf.id, wf.run_id) async for wf in self.client.list_workflows(query)]
        outcomes = []
        for workflow_id, run_id in found:
            try:
                outcome = await self.check(workflow_id, run_id)
            except RPCError as e:  # this run ended or moved meanwhile; the others are still looked at
                log.warning("repair_check_failed", workflow_id=workflow_id, run_id=run_id, error=str(e)[:300])
                continue
            if outcome is not None:
                outcomes.append(outcome)
        return outcomes

    async def check(self, workflow_id: str, run_id: str) -> Outcome | None:
        """Repair this run if it is wedged; None when it is healthy."""
        handle = self.client.get_workflow_handle(workflow_id, run_id=run_id)
        desc = await handle.describe()
        raw = desc.raw_description
        attempt = raw.pending_workflow_task.attempt if raw.HasField("pending_workflow_task") else 0
        if attempt < 2 and not await self._failing_lately(workflow_id, run_id):
            return None  # its last workflow task did not fail: healthy
        history = await handle.fetch_history()
        v = repair_verdict.verdict(task_events(history), attempt, self.failing_attempts)
        if v is None:
            return None
        step = max(_search_int(desc, "LaminarStep"), self._newest_step(workflow_id))
        if v.give_up or not v.candidates:
            return await self._fail(handle, v, v.give_up or "no completed workflow task to reset to")
        reset_to = await self._replayable(history, v.candidates)
        if reset_to is None:
            return await self._fail(handle, v, f"no workflow task among {list(v.candidates[:5])} replays")
        return await self._reset(handle, v, reset_to, step)

    async def _failing_lately(self, workflow_id: str, run_id: str, tail: int = 30) -> bool:
        """The newest workflow-task end among the history's last `tail` events is a failure (not a reset's)."""
        from temporalio.api.workflowservice.v1 import GetWorkflowExecutionHistoryReverseRequest

        resp = await self.client.workflow_service.get_workflow_execution_history_reverse(
            GetWorkflowExecutionHistoryReverseRequest(
                namespace=self.client.namespace, maximum_page_size=tail,
                execution=WorkflowExecution(workflow_id=workflow_id, run_id=run_id)))
        for e in resp.history.events:  # newest first
            kind = _KIND.get(e.event_type)
            if kind in (repair_verdict.COMPLETED, repair_verdict.TIMED_OUT):
                return False
            if kind == repair_verdict.FAILED:
                return e.workflow_task_failed_event_attributes.cause != _RESET_CAUSE
        return False

    async def _replayable(self, history: WorkflowHistory, candidates: Sequence[int], tries: int = 5) -> int | None:
        for c in candidates[:tries]:
            result = await self.replayer.replay_workflow(prefix_through(history, c), raise_on_replay_failure=False)
            if result.replay_failure is None:
                return c
            log.warning("reset_point_does_not_replay", workflow_id=history.workflow_id, event_id=c,
                        error=str(result.replay_failure)[:300])
        return None

    async def _reset(self, handle, v: repair_verdict.Verdict, reset_to: int, step_before: int) -> Outcome:
        wid, old_run = handle.id, handle.run_id
        current = await self.client.get_workflow_handle(wid).describe()
        if current.run_id != old_run:  # another repairer (or an operator) got here first
            return Outcome(wid, "skipped", f"run {old_run} is no longer current ({current.run_id})")
        request = ResetWorkflowExecutionRequest(
            namespace=self.client.namespace,
            workflow_execution=WorkflowExecution(workflow_id=wid, run_id=old_run),
            reason=f"laminar repair: {v.error[:300]}",
            workflow_task_finish_event_id=reset_to,
            request_id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"laminar-reset/{wid}/{old_run}/{reset_to}")),
            reset_reapply_exclude_types=[ResetReapplyExcludeType.RESET_REAPPLY_EXCLUDE_TYPE_UPDATE],
            identity="laminar-repairer",
        )
        resp = await self.client.workflow_service.reset_workflow_execution(request)
        new = self.client.get_workflow_handle(wid, run_id=resp.run_id)
        step_after = await _step_of(new, default=step_before)
        record = WorkflowReset(run_id=wid.removeprefix("run/"), error=v.error[:500], bad_event_id=v.bad_event_id, reset_to=reset_to,
                               old_run_id=old_run, new_run_id=resp.run_id, step_before=step_before,
                               step_after=step_after, at=time.time())
        try:
            await new.signal(contract.WORKFLOW_RESET, record)
        except RPCError as e:  # the status misses it; the store record and the log still hold it
            log.warning("workflow_reset_not_signalled", workflow_id=wid, error=str(e))
        self._write(wid, record)
        if self.on_reset is not None:
            self.on_reset(record)
        log.warning("workflow_reset", workflow_id=wid, error=v.error[:300], bad_event_id=v.bad_event_id,
                    reset_to=reset_to, old_run_id=old_run, new_run_id=resp.run_id, step_before=step_before,
                    step_after=step_after, steps_redone=max(0, step_before - step_after))
        return Outcome(wid, "reset", record=record)

    async def _fail(self, handle, v: repair_verdict.Verdict, why: str) -> Outcome:
        reason = (f"laminar repair: the run's workflow is wedged ({v.error[:300]}; bad event {v.bad_event_id}) "
                  f"and cannot be repaired: {why}. Start a new run from its newest checkpoint.")
        log.error("workflow_wedged_run_failed", workflow_id=handle.id, run_id=handle.run_id, reason=reason)
        await handle.terminate(reason=reason)
        return Outcome(handle.id, "failed", reason)

    def _newest_step(self, workflow_id: str) -> int:
        """The trainer's newest step record in the store (the search attribute lags by up to 5 s, or is not
        registered); 0 without a store."""
        if self.store is None:
            return 0
        try:
            found = self.store.list(keys.step_metrics_prefix(workflow_id.removeprefix("run/")))
        except Exception:
            return 0
        steps = [int(s) for s in (k.rsplit("/", 1)[-1].split(".")[0].rpartition("-")[2] for k in found) if s.isdigit()]
        return max(steps, default=0)

    def _write(self, workflow_id: str, record: WorkflowReset) -> None:
        if self.store is None:
            return
        try:
            self.store.put(keys.workflow_reset(record.run_id, record.new_run_id), json.dumps(asdict(record)).encode())
        except Exception as e:  # the store is down: the signal and the log hold the reset
            log.warning("workflow_reset_record_not_written", workflow_id=workflow_id, error=str(e))


def _search_int(desc, name: str) -> int:
    values = desc.search_attributes.get(name) or []
    try:
        return int(values[0]) if values else 0
    except (TypeError, ValueError):
        return 0


async def _step_of(handle, default: int, timeout_s: float = 30.0) -> int:
    """The reset run's step (a query replays it to the reset point); `default` if it does not answer."""
    try:
        st = await asyncio.wait_for(handle.query(contract.STATUS), timeout=timeout_s)
        return int(st["step"] if isinstance(st, dict) else st.step)
    except Exception:
        return default
