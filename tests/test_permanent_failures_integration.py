"""The real stack (worker processes, Temporal dev server, local store): a bad model.path ends the run
FAILED with the message instead of retrying init_trainer forever, and a corrupt newest checkpoint followed
by a trainer kill is a recorded fallback to the previous checkpoint, not a wedge."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError

from laminar.client.run_control import start_workflow
from laminar.contract import RunStatus
from laminar.storage import keys
from tests.fixtures.stack import quiet_status, small_config
from tests.fixtures.waiting import async_wait_until, wait_until


async def _status(handle) -> RunStatus:
    return await handle.query("status", result_type=RunStatus)


async def test_a_bad_model_path_fails_the_run_with_the_message(stack):
    handle = await start_workflow(stack.client, small_config("model.path=/nonexistent"))
    t0 = time.monotonic()
    with pytest.raises(WorkflowFailureError) as info:
        await asyncio.wait_for(handle.result(), timeout=60)
    cause = info.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "ConfigError" and cause.non_retryable
    assert "init_trainer failed: model.path='/nonexistent' is not a directory" in cause.message
    # one attempt, no retry loop: the failure is back well within the relay join and one init
    assert time.monotonic() - t0 < 60


async def test_a_corrupt_newest_checkpoint_and_a_trainer_kill_fall_back_to_the_previous_one(stack):
    cfg = small_config("run.steps=200", "trainer.checkpoint_every=2", "trainer.keep_last=2")
    handle = await start_workflow(stack.client, cfg)
    await async_wait_until(lambda: _has_checkpoints(handle, 2), 120, "two committed checkpoints")
    # Pause: the step in flight finishes, then the trainer idles, so nothing commits behind our back.
    await handle.execute_update("pause", result_type=str)
    before = await async_wait_until(lambda: quiet_status(handle), 60, "the in-flight step to finish")
    newest, previous = before.checkpoints[-1], before.checkpoints[-2]
    # Kill the trainer, flip a byte of the newest checkpoint's weights, restart the trainer.
    trainer = stack.launcher.processes["trainer"]
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.proc.wait(10)
    key = keys.checkpoint_part(cfg.run.run_id, newest.step, "model")
    data = bytearray(stack.store.get(key))
    data[-1] ^= 0xFF
    stack.store.put(key, bytes(data))
    wait_until(lambda: "trainer" in stack.launcher.supervise(), 10, "the launcher to restart the trainer")
    await handle.execute_update("resume", result_type=str)
    # The restarted trainer restores from the previous checkpoint, redoes the steps since, and goes on.
    await async_wait_until(lambda: _step_at_least(handle, before.step + 2), 120, "steps after the fallback")
    after = await _status(handle)
    fallback = [e for e in after.events if e.kind == "checkpoint_fallback"]
    assert [(e.subject, e.count) for e in fallback] == [(f"step-{newest.step}", previous.step)]
    assert newest not in after.checkpoints  # the corrupt checkpoint is no longer a restore point
    await handle.execute_update("stop", result_type=str)
    final: RunStatus = await handle.result()
    assert final.groups_consumed_twice == 0
    # steps from the previous checkpoint up to the step the run was paused at were redone
    assert final.steps_redone >= before.step - previous.step


async def _has_checkpoints(handle, n: int) -> bool:
    return len((await _status(handle)).checkpoints) >= n


async def _step_at_least(handle, n: int) -> bool:
    return (await _status(handle)).step >= n
