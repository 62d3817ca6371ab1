"""RecoveryDrillWorkflow: inject one fault into a live run and report how it recovered.

plan (runner) -> inject (the target process's own fault queue, or the store outage on the runner)
-> observe (runner) -> report. The observing activities run in the `laminar drill` process, outside
everything a drill may kill; this workflow itself only sequences them, so a control-worker drill merely
delays it.
"""

from __future__ import annotations

import dataclasses
import typing
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from temporalio.converter import value_to_type

    from laminar import contract
    from laminar.contract import (
        FAULTS,
        PREEMPT_ROLES,
        DrillInput,
        DrillPlan,
        DrillReport,
        InjectFaultInput,
        InjectFaultResult,
        ObserveInput,
        fault_queue,
    )
    from laminar.errors import ConfigError
    from laminar.workflows import timeouts


@workflow.defn(name=contract.RECOVERY_DRILL_WORKFLOW)
class RecoveryDrillWorkflow:
    @workflow.run
    async def run(self, raw: Any) -> DrillReport:
        try:
            inp = parse_drill_input(raw)
        except ConfigError as e:  # a failed drill, never a workflow task retried forever
            raise ApplicationError(str(e), type="InvalidConfig", non_retryable=True) from None
        plan: DrillPlan = await workflow.execute_activity(
            contract.PLAN_DRILL, inp, result_type=DrillPlan, task_queue=inp.runner_queue,
            heartbeat_timeout=timeouts.DRILL_RUNNER_HEARTBEAT, start_to_close_timeout=timedelta(seconds=inp.timeout_s),
        )
        injected = await self._inject(inp, plan)
        return await workflow.execute_activity(
            contract.OBSERVE_RECOVERY, ObserveInput(drill=inp, plan=plan, injected=injected), result_type=DrillReport,
            task_queue=inp.runner_queue, heartbeat_timeout=timeouts.DRILL_RUNNER_HEARTBEAT,
            start_to_close_timeout=timedelta(seconds=inp.timeout_s + timeouts.OBSERVE_REPORT_MARGIN_S),
        )

    async def _inject(self, inp: DrillInput, plan: DrillPlan) -> InjectFaultResult:
        if plan.fault == "store":
            return await workflow.execute_activity(
                contract.INTERRUPT_STORE, inp, result_type=InjectFaultResult, task_queue=inp.runner_queue,
                start_to_close_timeout=timedelta(seconds=inp.outage_s + timeouts.STORE_RESTART_MARGIN_S),
                heartbeat_timeout=timeouts.DRILL_RUNNER_HEARTBEAT, retry_policy=timeouts.DRILL_ONE_ATTEMPT,
            )
        return await workflow.execute_activity(
            contract.INJECT_FAULT, InjectFaultInput(drill_id=inp.drill_id, fault=plan.fault, target=plan.target),
            result_type=InjectFaultResult, task_queue=fault_queue(plan.process),
            schedule_to_close_timeout=timeouts.FAULT_DELIVERY, retry_policy=timeouts.DRILL_ONE_ATTEMPT,
        )


# value rules of the drill input's fields: (check, what is allowed)
_ALLOWED: dict[str, tuple[typing.Callable[[Any], bool], str]] = {
    "fault": (lambda v: v in FAULTS, f"one of {', '.join(FAULTS)}"),
    "during": (lambda v: v in ("", "migration"), '"migration" or empty'),
    "runner_queue": (bool, "the task queue of the `laminar drill` process that serves the observing activities"),
    "at_step": (lambda v: v >= 0, ">= 0"),
    "timeout_s": (lambda v: v > 0, "> 0"),
    "outage_s": (lambda v: v >= 0, ">= 0"),
}


def parse_drill_input(raw: Any) -> DrillInput:
    """Validate the workflow input (a JSON object of DrillInput's fields); ConfigError names the field, the value
    and what is allowed. `laminar drill` always sends a valid one; this guards hand-written and stale starts."""
    hints = typing.get_type_hints(DrillInput)
    if not isinstance(raw, dict):
        raise ConfigError(f"drill input must be a JSON object with fields {sorted(hints)}, "
                          f"got {type(raw).__name__}: {str(raw)[:80]}")
    missing = [f.name for f in dataclasses.fields(DrillInput)
               if f.name not in raw and f.default is dataclasses.MISSING]
    unknown = sorted(set(raw) - set(hints))
    if missing or unknown:
        raise ConfigError(f"drill input: missing field(s) {missing}, unknown field(s) {unknown}; "
                          f"the fields are {sorted(hints)}")
    values = {}
    for name, value in raw.items():
        try:
            values[name] = value_to_type(hints[name], value)
        except (TypeError, ValueError):
            raise ConfigError(f"drill input {name}={value!r:.80} must be a {hints[name].__name__}") from None
    inp = DrillInput(**values)
    for name, (check, allowed) in _ALLOWED.items():
        if not check(getattr(inp, name)):
            raise ConfigError(f"drill input {name}={getattr(inp, name)!r:.80} is not allowed: use {allowed}")
    if inp.fault == "preempt" and inp.target.partition(":")[0] not in PREEMPT_ROLES:
        raise ConfigError(f"drill input target={inp.target!r:.80} is not allowed with fault=preempt: use "
                          f"{', '.join(PREEMPT_ROLES)} (rollout and relay may name one: rollout:replica-1)")
    return inp
