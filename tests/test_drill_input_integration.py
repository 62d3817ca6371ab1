"""The real stack (control worker process, Temporal dev server): a malformed RecoveryDrillWorkflow input ends
the drill FAILED at once with an error naming the field, instead of a workflow task that fails and is retried
forever (a typed input the converter cannot decode wedges the task; the workflow takes it untyped and
validates it itself, as TrainingRunWorkflow does)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError

from laminar.contract import CONTROL_UNCACHED_QUEUE

# A valid input, as `laminar drill` sends it (the run need not exist: validation comes first); each case spoils one field.
GOOD = {"run_id": "no-such-run", "drill_id": "d", "fault": "rollout", "runner_queue": "laminar-drill-test"}


@pytest.mark.parametrize(("spoil", "expected"), [
    ({"timeout_s": "soon"}, "drill input timeout_s='soon' must be a float"),
    ({"fault": "disk"}, "drill input fault='disk' is not allowed: use one of rollout"),
    ({"runner_queue": ""}, "drill input runner_queue='' is not allowed"),
    ({"timeout": 30}, "unknown field(s) ['timeout']"),
    ({"fault": "preempt", "target": "control"}, "drill input target='control' is not allowed with fault=preempt: "
                                                "use rollout, relay, trainer"),
])
async def test_a_malformed_drill_input_fails_the_drill_naming_the_field(stack, spoil, expected):
    handle = await stack.client.start_workflow(
        "RecoveryDrillWorkflow", {**GOOD, **spoil}, id=f"drill/bad-input-{uuid.uuid4().hex[:8]}",
        task_queue=CONTROL_UNCACHED_QUEUE,
    )
    t0 = time.monotonic()
    with pytest.raises(WorkflowFailureError) as info:
        # One workflow task on the (already running) control worker; 60 s is generous on 2 loaded cores.
        await asyncio.wait_for(handle.result(), timeout=60)
    cause = info.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "InvalidConfig" and cause.non_retryable
    assert expected in cause.message
    assert time.monotonic() - t0 < 60
    # Failed by the workflow itself in its first task: no failed workflow task, no activity scheduled.
    kinds = [e.event_type for e in (await handle.fetch_history()).events]
    assert EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED not in kinds
    assert EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED not in kinds
    assert kinds[-1] == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_FAILED
