"""RecoveryDrillWorkflow: inject one fault into a live run and report how it recovered (docs/architecture.md,
'Recovery drills').

plan (runner) -> inject (the target process's own fault queue, or the store outage on the runner)
-> observe (runner) -> report. The observing activities run in the `laminar drill` process, outside
everything a drill may kill; this workflow itself only sequences them, so a control-worker drill merely
delays it.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from laminar.messages import (
        DrillInput,
        DrillPlan,
        DrillReport,
        InjectFaultInput,
        InjectFaultResult,
        ObserveInput,
        fault_queue,
    )

ONCE = RetryPolicy(maximum_attempts=1)


@workflow.defn(name="RecoveryDrillWorkflow")
class RecoveryDrillWorkflow:
    @workflow.run
    async def run(self, inp: DrillInput) -> DrillReport:
        plan: DrillPlan = await workflow.execute_activity(
            "plan_drill", inp, result_type=DrillPlan, task_queue=inp.runner_queue,
            start_to_close_timeout=timedelta(seconds=inp.timeout_s), heartbeat_timeout=timedelta(seconds=10),
        )
        injected = await self._inject(inp, plan)
        return await workflow.execute_activity(
            "observe_recovery", ObserveInput(drill=inp, plan=plan, injected=injected), result_type=DrillReport,
            task_queue=inp.runner_queue, start_to_close_timeout=timedelta(seconds=inp.timeout_s + 60),
            heartbeat_timeout=timedelta(seconds=10),
        )

    async def _inject(self, inp: DrillInput, plan: DrillPlan) -> InjectFaultResult:
        if plan.fault == "store":
            return await workflow.execute_activity(
                "interrupt_store", inp, result_type=InjectFaultResult, task_queue=inp.runner_queue,
                start_to_close_timeout=timedelta(seconds=inp.outage_s + 120), heartbeat_timeout=timedelta(seconds=10),
                retry_policy=ONCE,
            )
        return await workflow.execute_activity(
            "inject_fault", InjectFaultInput(drill_id=inp.drill_id, fault=plan.fault, target=plan.target),
            result_type=InjectFaultResult, task_queue=fault_queue(plan.process),
            schedule_to_close_timeout=timedelta(seconds=60), retry_policy=ONCE,
        )
