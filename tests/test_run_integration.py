"""The real stack end to end: dev server, worker processes, torch engine, relays, local store.

Covers a short run through the Python client, a start with the `temporal` CLI binary, invalid input
ending the workflow FAILED, pause/resume, continue-as-new, and history replay; every run's histories
are checked for payloads over 256 KB.
"""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.worker import Replayer

from laminar.client.converter import DATA_CONVERTER
from laminar.client.run_control import start_workflow
from laminar.contract import CONTROL_QUEUE, RunStatus, workflow_id_for
from laminar.reporting.summary import build_summary
from laminar.workers.processes import TRAINER_SLOTS
from laminar.workflows.training_run import TrainingRunWorkflow
from tests.fixtures.stack import quiet_status, small_config
from tests.fixtures.temporal import assert_payloads_small, history_chain, temporal_address, temporal_binary
from tests.fixtures.waiting import async_wait_until

RUN_TIMEOUT_S = 240


async def _status(handle) -> RunStatus:
    return await handle.query("status", result_type=RunStatus)


def _check_accounting(final: RunStatus, steps: int, groups_per_step: int) -> None:
    assert final.phase == "finished"
    assert final.step == steps
    assert final.groups_consumed == steps * groups_per_step
    assert final.groups_consumed_twice == 0
    # Every group generated is consumed or still waiting: none lost, none counted twice.
    assert final.groups_generated == final.groups_consumed + final.ready_groups


async def test_short_run_through_python_client(stack):
    cfg = small_config()
    handle = await start_workflow(stack.client, cfg)
    final: RunStatus = await handle.result(rpc_timeout=None)
    _check_accounting(final, cfg.run.steps, cfg.trainer.groups_per_step)
    # Asynchrony: the staleness histogram has entries and sums to every consumed sample.
    total = sum(final.staleness_histogram.values())
    assert total == final.groups_consumed * cfg.rollout.group_size
    assert final.checkpoints and final.checkpoints[-1].step == cfg.run.steps
    summary = build_summary(final, stack.store, wall_s=1.0)
    assert len(summary["reward_per_step"]) == cfg.run.steps
    assert summary["response_len_p99"] >= summary["response_len_p50"] > 0
    await assert_payloads_small(stack.client, handle)


async def test_start_with_temporal_cli(stack):
    cfg = small_config("run.steps=3")
    wf_id = workflow_id_for(cfg.run.run_id)
    cmd = [
        temporal_binary(), "workflow", "start",
        "--address", temporal_address(stack.client), "--namespace", "default",
        "--type", "TrainingRunWorkflow", "--task-queue", CONTROL_QUEUE, "--workflow-id", wf_id,
        "--input", json.dumps({"config": cfg.to_json()}),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)
    handle = stack.client.get_workflow_handle(wf_id, result_type=RunStatus)
    final = await handle.result()
    _check_accounting(final, 3, cfg.trainer.groups_per_step)


async def test_invalid_cli_input_fails_the_workflow(stack):
    wf_id = "run/t-invalid-config"
    cmd = [
        temporal_binary(), "workflow", "start",
        "--address", temporal_address(stack.client), "--namespace", "default",
        "--type", "TrainingRunWorkflow", "--task-queue", CONTROL_QUEUE, "--workflow-id", wf_id,
        "--input", json.dumps({"config": {"rollout": {"group_size": 1}}}),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)
    handle = stack.client.get_workflow_handle(wf_id)
    with pytest.raises(WorkflowFailureError) as info:
        await handle.result()
    message = str(info.value.cause)
    assert "rollout.group_size=1" in message and "greater than or equal to 2" in message


async def test_pause_and_resume(stack):
    # Steps on the test stack take tens of milliseconds, and a pause lets the steps already dispatched finish (the
    # running one and TRAINER_SLOTS - 1 behind it): a run of 5 steps paused at step 2 finished while paused, and
    # the test then waited for a paused phase that never came. 20 steps leave room for the pause to land late.
    cfg = small_config("run.steps=20")
    handle = await start_workflow(stack.client, cfg)
    await async_wait_until(lambda: _step_at_least(handle, 1), RUN_TIMEOUT_S, "the first trainer step")
    assert await handle.execute_update("pause", result_type=str) == "paused"
    at_pause = await _status(handle)
    paused_at = at_pause.step
    assert paused_at + TRAINER_SLOTS < cfg.run.steps, (
        f"the pause landed at step {paused_at}: the steps already dispatched may finish the run of {cfg.run.steps}")
    # A pause grants no new lease and starts no step: what was leased before it finishes and is reported (its
    # groups become ready), the step in flight commits, and then the run is still. How many groups were in
    # flight at the pause is a race (the trainer may just have taken them all), so the test waits for the
    # leases to close rather than for a count of ready groups.
    held = await async_wait_until(lambda: _still(handle), RUN_TIMEOUT_S, "the paused run's leases and step to finish")
    # at most the steps already dispatched when the pause landed: the one running and those scheduled ahead
    # (the trainer worker's TRAINER_SLOTS, workers/processes.py)
    assert held.step <= paused_at + TRAINER_SLOTS
    # Replicas kept contacting the run while it was paused (their reports closed the leases): none got a new
    # prompt, and the ready groups stay unconsumed.
    await asyncio.sleep(3)
    later = await _status(handle)
    assert (later.phase, later.step, later.prompts_issued, later.open_leases, later.ready_groups) == (
        "paused", held.step, at_pause.prompts_issued, 0, held.ready_groups)
    assert await handle.execute_update("resume", result_type=str) == "running"
    final = await handle.result()
    _check_accounting(final, cfg.run.steps, cfg.trainer.groups_per_step)
    # The history shows no train_step scheduled between the pause and the resume.
    events = [e for h in await history_chain(stack.client, handle.id) for e in h.events]
    names = [_event_name(e) for e in events]
    i_pause, i_resume = names.index("update:pause"), names.index("update:resume")
    assert "train_step" not in names[i_pause + 1 : i_resume]


async def _still(handle) -> RunStatus | None:
    """The status once a paused run has no step in flight and no open lease, else None."""
    st = await quiet_status(handle)
    return st if st is not None and st.open_leases == 0 else None


async def test_continue_as_new_carries_state(stack):
    cfg = small_config("run.steps=7", "run.continue_as_new_every=3")
    handle = await start_workflow(stack.client, cfg)
    final: RunStatus = await handle.result()
    _check_accounting(final, 7, cfg.trainer.groups_per_step)
    # a segment asks for a hand-over at step 3 and the trainer keeps stepping while replicas hand over, so
    # the segment closes at step 3 or a little later; 7 steps -> 1 or 2 continue-as-new, one run each more.
    assert final.continued_as_new in (1, 2)
    histories = await history_chain(stack.client, handle.id)
    assert len(histories) == final.continued_as_new + 1
    # Replay every segment against the current workflow code: nondeterminism would raise here.
    replayer = Replayer(workflows=[TrainingRunWorkflow], data_converter=DATA_CONVERTER)
    for h in histories:
        await replayer.replay_workflow(h)
    await assert_payloads_small(stack.client, handle)


async def _step_at_least(handle, n: int) -> bool:
    return (await _status(handle)).step >= n


def _event_name(event) -> str:
    attrs = event.workflow_execution_update_accepted_event_attributes
    if event.HasField("workflow_execution_update_accepted_event_attributes"):
        return f"update:{attrs.accepted_request.input.name}"
    if event.HasField("activity_task_scheduled_event_attributes"):
        return event.activity_task_scheduled_event_attributes.activity_type.name
    return ""
