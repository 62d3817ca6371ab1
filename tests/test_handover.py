"""Continue-as-new on the real stack: bounded by the server's limits, never a barrier, and a paused run's
control traffic bounded by work (not by wall time)."""

from __future__ import annotations

import asyncio

import pytest

from laminar.client.run_control import start_workflow
from laminar.contract import RunStatus
from tests.fixtures.stack import quiet_status, small_config
from tests.fixtures.temporal import history_chain
from tests.fixtures.waiting import async_wait_until

RUN_TIMEOUT_S = 240
PAUSE_S = 24.0


async def _status(handle) -> RunStatus:
    return await handle.query("status", result_type=RunStatus)


async def _step_at_least(handle, n: int) -> bool:
    return (await _status(handle)).step >= n


def _updates(history) -> int:
    return sum(e.HasField("workflow_execution_update_accepted_event_attributes") for e in history.events)


@pytest.mark.slow  # 36 s; `make test` stays under 15 minutes (run with -m slow)
async def test_a_long_pause_continues_as_new_and_resumes(stack):
    """The segment holds at most 20 updates. While paused, replicas back off (0.5, 1, 2, 4, 8, 10, 10 s
    between empty claims: about 7 claims each in 24 s, 14 for both), so a pause of 24 s needs at most
    one continue-as-new; polling every 0.5 s (what replicas did before) sends 2 * 48 = 96 updates, which
    at 20 per segment is 4 or more. The hand-over happens with no trainer step at all, and the run
    resumes and finishes with nothing lost or consumed twice."""
    # 20 steps: the steps already dispatched at the pause (up to 3) still finish, and must not end the run
    cfg = small_config("run.steps=20", "run.updates_per_segment=20")
    handle = await start_workflow(stack.client, cfg)
    await async_wait_until(lambda: _step_at_least(handle, 2), RUN_TIMEOUT_S, "step 2")
    assert await handle.execute_update("pause", result_type=str) == "paused"
    await asyncio.sleep(2.0)  # in-flight groups finish; the replicas go idle
    before = await async_wait_until(lambda: quiet_status(handle), 60, "the in-flight step to finish")
    await asyncio.sleep(PAUSE_S)
    during = await _status(handle)
    assert during.phase == "paused" and during.step == before.step  # no step while paused
    assert 0 <= during.continued_as_new - before.continued_as_new <= 1, (before.continued_as_new,
                                                                         during.continued_as_new)
    assert await handle.execute_update("resume", result_type=str) == "running"
    final: RunStatus = await handle.result()
    assert final.phase == "finished" and final.step == cfg.run.steps
    assert final.groups_consumed_twice == 0
    assert final.groups_generated == final.groups_consumed + final.ready_groups
    # no history segment ever exceeded the update budget (plus the few in flight when it closed)
    for h in await history_chain(stack.client, handle.id):
        assert _updates(h) <= 20 + 8


@pytest.mark.slow  # 34 s
async def test_update_budget_alone_forces_continue_as_new_while_paused(stack):
    """With a budget of 20 updates, a run paused from its start still continues as new: the workflow
    does not wait for a trainer step to check its limits."""
    cfg = small_config("run.steps=3", "run.updates_per_segment=20")
    handle = await start_workflow(stack.client, cfg)
    assert await handle.execute_update("pause", result_type=str) in ("paused", "starting")

    async def continued() -> bool:
        return (await _status(handle)).continued_as_new >= 1

    await async_wait_until(continued, 120, "a continue-as-new while paused")
    st = await _status(handle)
    assert st.step == 0 and st.phase == "paused"
    assert await handle.execute_update("resume", result_type=str) in ("running", "starting")
    final: RunStatus = await handle.result()
    assert final.step == 3 and final.groups_consumed_twice == 0
