"""The repairer (services/repair_verdict.py decides, services/repair.py acts) against the chaos run's wedged
history and against real wedged runs on a real Temporal dev server, their worker a real process killed by pid.

The wedge is injected with tests.wedge's interceptors: a live run issues a command its replay does not (the
failure the chaos run left: `[TMPRL1100]`), so every cold replay fails until the run is reset."""

from __future__ import annotations

import asyncio
import gzip
import os
import subprocess
import uuid
from pathlib import Path

import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowHistory
from temporalio.worker import Replayer

from laminar.client.converter import DATA_CONVERTER
from laminar.services import repair_verdict
from laminar.services.repair import Repairer, prefix_through, task_events
from laminar.services.repair_verdict import COMPLETED, FAILED, OTHER, SCHEDULED, STARTED, TIMED_OUT
from laminar.workflows.training_run import TrainingRunWorkflow
from tests import wedge
from tests.fixtures.temporal import temporal_address
from tests.fixtures.waiting import async_wait_until

HISTORY = Path(__file__).parent / "fixtures" / "chaos_nondeterminism_history.json.gz"
ROOT = Path(__file__).resolve().parents[1]


def _fixture() -> WorkflowHistory:
    return WorkflowHistory.from_json("run/run-20261201-193317", gzip.decompress(HISTORY.read_bytes()).decode())


# -- the verdict (pure) ---------------------------------------------------------------------------------------


def test_verdict_on_the_chaos_history_resets_before_the_timed_out_task():
    v = repair_verdict.verdict(task_events(_fixture()), pending_attempt=3)
    assert v is not None and v.nondeterminism and "[TMPRL1100]" in v.error
    assert v.bad_event_id == 132  # the first TimerStarted of completion 131, named by the error
    # 131 completed task 129, into which the SDK merged task 124 (timed out at 126); the completed task before
    # 124 is the one at 117
    assert v.reset_to == 117 and v.candidates[:3] == (117, 112, 107)
    assert v.give_up == ""


async def test_the_chosen_point_replays_and_the_bad_one_does_not():
    history = _fixture()
    replayer = Replayer(workflows=[TrainingRunWorkflow], data_converter=DATA_CONVERTER)
    good = await replayer.replay_workflow(prefix_through(history, 117), raise_on_replay_failure=False)
    assert good.replay_failure is None
    # through 131's commands (132-145) it fails as the live run did
    bad = await replayer.replay_workflow(prefix_through(history, 131), raise_on_replay_failure=False)
    assert bad.replay_failure is not None and "TMPRL1100" in str(bad.replay_failure)


E = repair_verdict.TaskEvent


def _task(first: int, end: str, message: str = "", reset: bool = False) -> list[repair_verdict.TaskEvent]:
    return [E(first, SCHEDULED), E(first + 1, STARTED), E(first + 2, end, message, reset)]


def test_a_healthy_run_has_no_verdict():
    events = _task(2, COMPLETED) + [E(5, OTHER)] + _task(6, COMPLETED)
    assert repair_verdict.verdict(events, pending_attempt=1) is None
    # a task that timed out is retried by the server: not a wedge
    assert repair_verdict.verdict(events + _task(9, TIMED_OUT), pending_attempt=2) is None


def test_another_error_is_a_wedge_only_once_it_keeps_failing():
    events = _task(2, COMPLETED) + _task(5, FAILED, "boom")
    # the first failure is in the history; a pending attempt N means N - 2 more failed since (kept out of it)
    assert repair_verdict.verdict(events, pending_attempt=repair_verdict.FAILING_ATTEMPTS) is None  # 4 failures
    v = repair_verdict.verdict(events, pending_attempt=repair_verdict.FAILING_ATTEMPTS + 1)  # 5
    # no event named: the failing task (scheduled at 5) is the bad one; reset to the completion before it
    assert v is not None and not v.nondeterminism and v.bad_event_id == 5 and v.reset_to == 4


def test_a_reset_that_did_not_help_gives_up():
    nd = "[TMPRL1100] Nondeterminism error: HistoryEvent(id: 9, TimerStarted)"
    before = _task(2, COMPLETED) + _task(5, COMPLETED) + [E(8, OTHER), E(9, OTHER)]
    first = repair_verdict.verdict(before + _task(10, FAILED, nd), pending_attempt=2)
    assert first is not None and first.give_up == "" and first.reset_to == 4
    # the reset run: events up to the point, the reset marker, then the same failure before any completion
    after = _task(2, COMPLETED) + [E(5, SCHEDULED), E(6, STARTED),
                                          E(7, FAILED, "reset", reset=True)] + _task(8, FAILED, nd)
    again = repair_verdict.verdict(after, pending_attempt=2)
    assert again is not None and "does not repair" in again.give_up
    # a later, separate wedge (a task completed since the reset) is reset again
    later = after[:-1] + [E(10, COMPLETED)] + _task(11, FAILED, nd.replace("9,", "12,"))
    assert repair_verdict.verdict(later, pending_attempt=2).give_up == ""


def test_failures_count_the_history_and_the_pending_attempts():
    # two failures in the history (the second after a new event), the pending task on its 3rd attempt: 2 + 1
    events = _task(2, COMPLETED) + _task(5, FAILED, "boom") + _task(8, FAILED, "boom")
    assert repair_verdict.failures(events, pending_attempt=3) == 3
    assert repair_verdict.failures(events, pending_attempt=1) == 2
    assert repair_verdict.failures(_task(2, COMPLETED), pending_attempt=0) == 0
    assert repair_verdict.verdict(events, pending_attempt=3, failing_attempts=3) is not None
    assert repair_verdict.verdict(events, pending_attempt=1, failing_attempts=3) is None


def test_a_reset_marker_alone_is_not_a_wedge():
    events = _task(2, COMPLETED) + _task(5, FAILED, "reset", reset=True)
    assert repair_verdict.verdict(events, pending_attempt=1) is None


# -- real wedged runs on a real server --------------------------------------------------------------------------


def _worker(address: str, queue: str, interceptor: str, marker: Path | None = None) -> subprocess.Popen:
    env = {**os.environ, "LAMINAR_WORKER_INTERCEPTORS": f"tests.wedge:{interceptor}",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if marker is not None:
        env[wedge.DIVERGE_FILE] = str(marker)
    return subprocess.Popen(wedge.worker_process(address, queue), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=30)


async def _wedged(client, handle) -> bool:
    """The run's workflow task fails on a second attempt or later (it no longer answers updates)."""
    raw = (await handle.describe()).raw_description
    return raw.HasField("pending_workflow_task") and raw.pending_workflow_task.attempt >= 2


async def test_a_wedged_run_is_reset_and_goes_on(temporal_env, tmp_path):
    client = temporal_env.client
    address = temporal_address(client)
    queue = f"wedge-{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "diverge"
    proc = _worker(address, queue, "DivergeOnce", marker)
    try:
        handle = await wedge.start(client, queue, f"wedge/{queue}", 0.0, 10.0)
        for _ in range(3):
            assert await handle.execute_update(wedge.WedgeRepro.claim) == ["r0", "r1"]
        marker.write_text("")
        await handle.execute_update(wedge.WedgeRepro.claim)  # the live run issues its extra timer here
        assert not marker.exists()
        await handle.signal(wedge.WedgeRepro.lose)
        # in one task with the signal, the update runs before the main loop empties the chain; in a later one, during
        # the 2 s backoff, the chain is empty
        assert await handle.execute_update(wedge.WedgeRepro.claim) in (["r0", "r1"], [])
        _stop(proc)  # the cache goes with the process: the next task replays from scratch
        proc = _worker(address, queue, "DivergeOnce")
        stuck = asyncio.create_task(handle.execute_update(wedge.WedgeRepro.claim))
        await async_wait_until(lambda: _wedged(client, handle), 60, "the run's workflow task failing again")
        assert not stuck.done()

        repairer = Repairer(client, [wedge.WedgeRepro], workflow_type=wedge.WORKFLOW)
        outcomes = await repairer.sweep()
        mine = [o for o in outcomes if o.workflow_id == handle.id]
        assert [o.action for o in mine] == ["reset"], mine
        record = mine[0].record
        assert "TMPRL1100" in record.error and record.old_run_id != record.new_run_id
        assert record.reset_to < record.bad_event_id

        current = client.get_workflow_handle(handle.id)
        assert (await current.describe()).run_id == record.new_run_id
        # the run goes on: a new claim is answered, the stuck caller's update was not reapplied
        assert await asyncio.wait_for(current.execute_update(wedge.WedgeRepro.claim), 60) in (["r0", "r1"], [])
        assert await repairer.sweep() == []  # healthy now: nothing more to do
        await current.execute_update(wedge.WedgeRepro.finish)
        assert await asyncio.wait_for(current.result(), 60) >= 0
        history = await current.fetch_history()
        replayed = await Replayer(workflows=[wedge.WedgeRepro], workflow_runner=wedge.UnsandboxedWorkflowRunner()
                                  ).replay_workflow(history, raise_on_replay_failure=False)
        assert replayed.replay_failure is None
        stuck.cancel()
    finally:
        _stop(proc)


async def _attempts(handle) -> int:
    raw = (await handle.describe()).raw_description
    return raw.pending_workflow_task.attempt if raw.HasField("pending_workflow_task") else 0


async def _failed_times(handle, times: int) -> bool:
    """The run's workflow tasks failed at least `times` times in a row (laminar.services.repair_verdict.failures)."""
    return repair_verdict.failures(task_events(await handle.fetch_history()), await _attempts(handle)) >= times


@pytest.mark.slow  # make test stays under 15 min; run with -m slow
async def test_a_reset_that_does_not_help_fails_the_run_loudly(temporal_env):
    """A bug in the workflow's code (a signal after which every attempt of the task raises) is no SDK wedge: the
    reset reapplies the signal and the task fails again at once. The repairer resets once, then fails the run."""
    client = temporal_env.client
    address = temporal_address(client)
    queue = f"wedge-{uuid.uuid4().hex[:8]}"
    proc = _worker(address, queue, "DivergeOnce")
    try:
        handle = await wedge.start(client, queue, f"wedge/{queue}", 0.0, 10.0)
        await handle.execute_update(wedge.WedgeRepro.claim)
        await handle.signal(wedge.WedgeRepro.poison)
        stuck = asyncio.create_task(handle.execute_update(wedge.WedgeRepro.claim))
        await async_wait_until(lambda: _attempts(handle), 120, "the task failing", interval_s=0.5)
        # 3 failures make a wedge here (5 by default; the server spaces a failing task's attempts out, and the
        # threshold is what the pure tests above check): one failure, or two, may be a blip, so no verdict yet
        repairer = Repairer(client, [wedge.WedgeRepro], workflow_type=wedge.WORKFLOW, failing_attempts=3)
        await async_wait_until(lambda: _failed_times(handle, 3), 180, "the task failing 3 times", interval_s=0.5)
        first = [o for o in await repairer.sweep() if o.workflow_id == handle.id]
        assert [o.action for o in first] == ["reset"]
        current = client.get_workflow_handle(handle.id)
        await async_wait_until(lambda: _failed_times(current, 1), 180, "the reset run failing again", interval_s=0.5)
        second = [o for o in await repairer.sweep() if o.workflow_id == handle.id]
        assert [o.action for o in second] == ["failed"], second
        assert "cannot be repaired" in second[0].reason and "does not repair" in second[0].reason
        desc = await current.describe()
        assert desc.status == WorkflowExecutionStatus.TERMINATED
        stuck.cancel()
    finally:
        _stop(proc)
