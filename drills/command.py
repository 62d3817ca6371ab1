"""`laminar drill RUN_ID --fault ...`: run one recovery drill against a live run and report it.

This process serves the drill's observing activities on its own queue for the drill's duration, starts
RecoveryDrillWorkflow on the control queue, and prints (and optionally writes) the report.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from rich.table import Table
from temporalio.worker import Worker

from laminar import contract
from laminar.client.connect import connect, store_for
from laminar.client.settings import Settings
from laminar.contract import CONTROL_UNCACHED_QUEUE, FAULTS, DrillInput, DrillReport
from laminar.devstack.stack import DevStack
from laminar.drills.observer import DrillActivities
from laminar.drills.rules import parse_preempt_target
from laminar.errors import ConfigError
from laminar.reporting.tool_calls import count_tool_calls


async def run_drill(settings: Settings, inp: DrillInput, report_path: Path | None = None) -> DrillReport:
    if inp.fault not in FAULTS:
        raise ConfigError(f"--fault {inp.fault!r} is not one of {', '.join(FAULTS)}")
    if inp.during not in ("", "migration"):
        raise ConfigError(f"--during {inp.during!r}: use migration (or leave it out)")
    if inp.fault == "preempt":
        parse_preempt_target(inp.target)  # a bad --target fails here, before anything starts
    drill_id = inp.drill_id or f"{inp.fault}-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"
    inp = dataclasses.replace(inp, drill_id=drill_id, runner_queue=f"laminar-drill-{drill_id}-{os.getpid()}")
    client = await connect(settings)
    interrupt = DevStack(settings.home).interrupt_s3 if inp.fault == "store" else None
    acts = DrillActivities(client, store_for(settings), interrupt)
    worker = Worker(client, task_queue=inp.runner_queue,
                    activities=[acts.plan_drill, acts.interrupt_store, acts.observe_recovery])
    async with worker:
        handle = await client.start_workflow(
            contract.RECOVERY_DRILL_WORKFLOW, inp, id=f"drill/{inp.run_id}/{inp.drill_id}",
            task_queue=CONTROL_UNCACHED_QUEUE,
            result_type=DrillReport,
        )
        report: DrillReport = await handle.result()
    log_dir = settings.home / "logs" / inp.run_id  # the local launcher's (cli/run.py make_launcher)
    if log_dir.is_dir():
        calls = count_tool_calls(log_dir)
        report = dataclasses.replace(report, tool_calls_rerun=calls.rerun, notes=(
            f"{report.notes}; " if report.notes else "") + f"tool calls: {calls.executions} runs of {calls.keys} "
            f"calls, {calls.rerun} run again, {calls.rerun_after_failure} run again by a failure's retry")
    if report_path is not None:
        report_path.parent.mkdir(parents=True, exist_ok=True)
        report_path.write_text(json.dumps(asdict(report), indent=2))
    return report


def render_report(r: DrillReport) -> Table:
    def rel(t: float | None) -> str:
        return "-" if t is None else f"{t:.3f} (+{t - r.injected_at:.2f}s)"

    t = Table(title=f"drill {r.drill_id} on run {r.run_id}", show_header=False)
    rows = [
        ("fault", r.fault), ("target", r.target), ("injected at", f"{r.injected_at:.3f}"),
        ("detected at", rel(r.detected_at)), ("recovered at", rel(r.recovered_at)),
        ("trainer steps during outage", r.steps_during_outage), ("trainer stall (s)", r.trainer_stall_s),
        ("groups lost", r.groups_lost), ("groups consumed twice", r.groups_consumed_twice),
        ("tokens regenerated", r.tokens_regenerated), ("tokens lost", r.tokens_lost),
        ("throughput restored at", rel(r.throughput_restored_at)), ("trainer steps redone", r.steps_redone),
        ("tool calls run again", "not counted" if r.tool_calls_rerun is None else r.tool_calls_rerun),
        ("recovered", r.recovered),
    ]
    if r.notes:
        rows.append(("notes", r.notes))
    for k, v in rows:
        t.add_row(k, str(v))
    return t
