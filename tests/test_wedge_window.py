"""The wedge's window, measured (slow): a cached run whose workflow task outlives its task timeout. tests/wedge.py's
reproduction holds the worker past the timeout in three ways (an activation stalled in the workflow's thread while
the SDK's core keeps polling; the worker SIGSTOPped at random moments while signals and claims flow; a Temporal
server restart while the worker holds its completion), then replays each history from scratch. None of them
wedges a run: the SDK evicts the run whenever a completion fails.

What does (docs/upstream/wedged-run.md): a status query dispatched as a query-only task while no workflow task is
pending, taken by the worker after new events were appended (`provoke_query`: the worker stopped across a server
restart, queries waiting, a signal, SIGCONT). The SDK applies those events for the query and never reports the
commands they produce with that task; the next workflow task sends them ahead of its update acceptances, and a
cold replay runs the updates first: `[TMPRL1100] ... Update machine does not handle this event: ... TimerStarted`.
The last two tests count that and show the repairer resetting such a run.

Two things are checked: the window opens at Temporal's default task timeout (10 s) for a stall as long as the chaos
run's longest SIGSTOP (12 s), and the run's task timeout (laminar.contract.WORKFLOW_TASK) closes it. How often a
history fails to replay is printed (the figures are in docs/upstream/wedged-run.md); with temporalio 1.35.0 the
SDK evicted the run in every try here, so the count is reported, not asserted."""

from __future__ import annotations

import os
import random
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from laminar import contract
from laminar.devstack.stack import DevStack, free_port
from tests import wedge

ROOT = Path(__file__).resolve().parents[1]
CHAOS_LONGEST_STOP_S = 12.0  # chaos/schedule.py HOLD_S["stop"][1]


async def _timed_out_tasks(handle) -> int:
    history = await handle.fetch_history()
    return sum(1 for e in history.events if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT)


@pytest.fixture
def own_server():
    stack = DevStack(Path(tempfile.mkdtemp(prefix="wedge-")))
    info = stack.up(ui=False, port=free_port())
    try:
        yield stack, info.temporal_address
    finally:
        stack.down()


async def _tries(address: str, mode: str, tries: int, task_timeout_s: float, hold_s: float, stack=None) -> dict:
    client = await Client.connect(address)
    queue = f"wedge-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen(wedge.worker_process(address, queue), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    out = {"mode": mode, "tries": tries, "task_timeout_s": task_timeout_s, "timed_out": 0, "replay_failures": 0}
    try:
        for i in range(tries):
            handle = await wedge.start(client, queue, f"{queue}-{i}", hold_s if mode == "stall" else 0.0,
                                       task_timeout_s)
            if mode == "stall":
                await wedge.provoke_stall(handle, hold_s)
            elif mode == "random":
                await wedge.provoke_random(client, handle, proc.pid, task_timeout_s, random.Random(i), 20)
            else:
                raise ValueError(mode)
            await wedge.finish(handle)
            out["timed_out"] += bool(await _timed_out_tasks(handle))
            out["replay_failures"] += bool(await wedge.replay_failure(handle))
    finally:
        proc.kill()
        proc.wait(timeout=30)
    print(out)
    return out


@pytest.mark.slow
async def test_the_run_task_timeout_closes_the_window(own_server):
    _, address = own_server
    default = await _tries(address, "stall", 2, 10.0, CHAOS_LONGEST_STOP_S)
    assert default["timed_out"] == 2  # the window opens: a 12 s stall outlives Temporal's default 10 s
    ours = await _tries(address, "stall", 2, contract.WORKFLOW_TASK.total_seconds(), CHAOS_LONGEST_STOP_S)
    assert ours["timed_out"] == 0 and ours["replay_failures"] == 0  # 30 s: the stalled task completes in time


@pytest.mark.slow
async def test_reproduction_rate_at_a_short_task_timeout(own_server):
    """The window held open on purpose (2 s task timeout): every stall try times out; the replay failures are
    counted and printed (temporalio 1.35.0: 0 of 10 stall tries and 0 of 20 random tries here)."""
    _, address = own_server
    stall = await _tries(address, "stall", 5, 2.0, 4.0)
    assert stall["timed_out"] == 5
    rand = await _tries(address, "random", 3, 2.0, 0.0)
    assert rand["timed_out"] >= 1  # random SIGSTOPs of 1-4 s against a 2 s timeout open the window too


async def _dead_holder_delay(address: str, task_timeout_s: float) -> float:
    """Seconds from SIGKILL of a worker that holds a workflow task (stalled in it) until a new worker has answered
    an update of that run: what a dead control worker costs at this task timeout."""
    import asyncio
    import time

    client = await Client.connect(address)
    queue = f"wedge-{uuid.uuid4().hex[:8]}"

    def worker(**env: str) -> subprocess.Popen:
        return subprocess.Popen(wedge.worker_process(address, queue), cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env={**os.environ, **env})

    proc = worker()
    try:
        handle = await wedge.start(client, queue, queue, 60.0, task_timeout_s)  # stalls 60 s: it holds the task
        await handle.execute_update(wedge.WedgeRepro.claim)
        await handle.signal(wedge.WedgeRepro.lose)
        await asyncio.sleep(1.0)  # the worker is in the stalled task now
        proc.kill()
        proc.wait(timeout=30)
        killed = time.monotonic()
        proc = worker(WEDGE_NO_STALL="1")  # restarted at once, as the launcher does
        await asyncio.wait_for(handle.execute_update(wedge.WedgeRepro.claim), 120)
        delay = time.monotonic() - killed
        await wedge.finish(handle)
        return delay
    finally:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.slow
async def test_what_a_dead_control_worker_costs_at_each_task_timeout(own_server):
    _, address = own_server
    delays = {t: await _dead_holder_delay(address, t) for t in (10.0, contract.WORKFLOW_TASK.total_seconds())}
    print({f"task_timeout={t:g}s": f"{d:.1f}s" for t, d in delays.items()})
    for t, d in delays.items():  # the held task moves only when its timeout fires (minus the 1 s it was held)
        assert t - 2.0 <= d <= t + 15.0, (t, d)


async def _query_try(client: Client, stack, queue: str, pid: int, i: int):
    handle = await wedge.start(client, queue, f"{queue}-{i}", 0.0, 10.0)
    await wedge.provoke_query(client, stack, handle, pid)
    return handle, await wedge.replay_failure(handle)


def _worker(address: str, queue: str) -> subprocess.Popen:
    return subprocess.Popen(wedge.worker_process(address, queue), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


QUERY_TRIES = 5  # 14 of 18 tries failed to replay (docs/upstream/wedged-run.md): 5 with none failing: ~0.1 %


@pytest.mark.slow
async def test_a_query_task_carrying_new_events_wedges_the_run(own_server):
    """The reproduction: the run's own history, written by one cached worker, fails to replay with the chaos run's
    error in at least one of QUERY_TRIES tries (the order in which matching hands out the queries and the signal's
    workflow task is not ours to pin)."""
    stack, address = own_server
    client = await Client.connect(address)
    queue = f"wedge-{uuid.uuid4().hex[:8]}"
    proc = _worker(address, queue)
    failures = []
    try:
        for i in range(QUERY_TRIES):
            handle, failure = await _query_try(client, stack, queue, proc.pid, i)
            await wedge.finish(handle)  # the cached worker still serves it: the live run never notices
            if failure:
                failures.append(failure)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    print({"mode": "query", "tries": QUERY_TRIES, "replay_failures": len(failures)})
    assert failures, f"no history of {QUERY_TRIES} failed to replay"
    for f in failures:
        assert "TMPRL1100" in f and "Update machine does not handle this event" in f and "TimerStarted" in f, f


@pytest.mark.slow
async def test_the_repairer_resets_a_reproduced_wedge(own_server):
    """A reproduced wedge seen as the chaos run saw it: the cached worker dies, a fresh one replays the run and every
    workflow task fails; the repairer (services/repair.py) resets it to the last task completed before the bad one,
    and the run goes on: claims answered, the signal applied exactly once (0 lost, 0 twice), the history replays."""
    from laminar.services.repair import Repairer

    stack, address = own_server
    client = await Client.connect(address)
    queue = f"wedge-{uuid.uuid4().hex[:8]}"
    proc = _worker(address, queue)
    try:
        for i in range(2 * QUERY_TRIES):
            handle, failure = await _query_try(client, stack, queue, proc.pid, i)
            if failure:
                break
            await wedge.finish(handle)
        else:
            pytest.fail(f"no history of {2 * QUERY_TRIES} tries failed to replay")
        proc.kill()  # the control worker dies (the chaos run's SIGSTOP of it, then another worker took the run)
        proc.wait(timeout=30)
        proc = _worker(address, queue)
        import asyncio

        stuck = asyncio.create_task(asyncio.wait_for(handle.execute_update(wedge.WedgeRepro.claim), 120))
        repairer = Repairer(client, [wedge.WedgeRepro], workflow_type=wedge.WORKFLOW)
        outcome = None
        for _ in range(90):  # the fresh worker takes the task once the dead one's sticky queue times out (~10 s)
            outcome = await repairer.check(handle.id, handle.result_run_id)
            if outcome is not None:
                break
            await asyncio.sleep(1.0)
        assert outcome is not None and outcome.action == "reset", outcome
        rec = outcome.record
        assert "TMPRL1100" in rec.error and rec.reset_to < rec.bad_event_id, rec
        print({"bad_event_id": rec.bad_event_id, "reset_to": rec.reset_to, "new_run_id": rec.new_run_id})
        await asyncio.gather(stuck, return_exceptions=True)  # its run was reset: updates are not reapplied
        current = client.get_workflow_handle(handle.id)
        assert isinstance(await asyncio.wait_for(current.execute_update(wedge.WedgeRepro.claim), 60), list)  # goes on
        losses = await asyncio.wait_for(current.execute_update(wedge.WedgeRepro.finish), 60)
        assert losses == 1  # the one `lose` signal: reapplied by the reset once, not lost, not twice
        await asyncio.wait_for(current.result(), 60)
        assert await wedge.replay_failure(current) == ""
    finally:
        proc.kill()
        proc.wait(timeout=30)
