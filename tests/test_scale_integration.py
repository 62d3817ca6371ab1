"""`laminar scale` on the real stack (SQLite-backed Temporal dev server, S3 server, worker processes): a run
scaled 2 -> 4 -> 2 rollout replicas while it trains keeps stepping, its status follows the target, and it ends
with no group lost and none consumed twice."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from client.connect import connect, store_for
from client.run_control import scale_run, start_workflow
from client.settings import Settings
from devstack.stack import DevStack
from laminar.messages import RunStatus
from tests.fixtures.s3 import free_port
from tests.fixtures.stack import small_config
from tests.fixtures.temporal import terminate_running
from tests.fixtures.waiting import async_wait_until
from workers.launcher import LocalLauncher, plan_processes

# The workers are laid out for 4 replicas on 2 hosts plus 1 spare slot each: 2 * (2 + 1) = 6 rollout slots, so
# 4 replicas (and 2 removed ones still returning) always find a slot. The run itself starts with 2.
STACK_OVERRIDES = ["rollout.replicas=4"]
RUN_OVERRIDES = ["run.steps=1000", "rollout.replicas=2"]
TIMEOUT_S = 180.0


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def scale_stack(tmp_path_factory, aws_test_env) -> AsyncIterator[tuple[Settings, Path]]:
    home: Path = tmp_path_factory.mktemp("scale-home")
    dev = DevStack(home)
    dev.up(s3=True, port=free_port(), ui=False)
    launcher = None
    try:
        settings = Settings.from_env({"LAMINAR_HOME": str(home), "LAMINAR_LOG_LEVEL": "info"})
        assert settings.store_url.startswith("s3://")
        store_for(settings)  # the dev S3 server's credentials, inherited by the worker processes
        launcher = LocalLauncher(plan_processes(small_config(*STACK_OVERRIDES), settings, home / "logs", spare_slots=1))
        launcher.start_all()
        yield settings, home
        await terminate_running(await connect(settings))
    finally:
        if launcher is not None:
            launcher.stop_all()
        dev.down()


async def _status(handle) -> RunStatus:
    return await handle.query("status", result_type=RunStatus)


async def _settled(handle, target: int, after_step: int) -> RunStatus:
    """Wait until exactly `target` replica activities run (removed ones have returned) and a step beyond
    `after_step` has been taken."""
    async def ok() -> RunStatus | None:
        st = await _status(handle)
        return st if st.replicas_running == target and st.step > after_step else None
    return await async_wait_until(ok, TIMEOUT_S, f"{target} replicas running and a step past {after_step}",
                                  interval_s=0.3)


async def test_scale_up_and_down_while_training(scale_stack):
    settings, home = scale_stack
    client = await connect(settings)
    cfg = small_config(*RUN_OVERRIDES)
    handle = await start_workflow(client, cfg)
    st = await _settled(handle, 2, 0)
    assert st.replicas_target == 2

    # 2 -> 4 through the Python client: the lowest free ids start on the spare slots
    res = await scale_run(settings, cfg.run.run_id, 4)
    assert (res.replicas_target, res.started, res.removed) == (4, ["replica-2", "replica-3"], [])
    st4 = await _settled(handle, 4, st.step)
    assert st4.replicas_target == 4
    # the new replicas claimed and reported: 4 replica reports in the status
    await async_wait_until(lambda: _reports_at_least(handle, 4), TIMEOUT_S, "reports from 4 replicas")

    # 4 -> 2 through the command line (a real process): two replicas leave and return
    env = {**os.environ, "LAMINAR_HOME": str(home), "PYTHONPATH": os.getcwd()}
    out = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "workers.cli", "scale", cfg.run.run_id,
                                                   "--replicas", "2"], env=env, capture_output=True, text=True,
                                  timeout=120)
    assert out.returncode == 0, out.stderr
    assert "replicas_target=2" in out.stdout and "removed=replica-" in out.stdout, out.stdout
    st2 = await _settled(handle, 2, st4.step)
    assert st2.replicas_target == 2
    kinds = {(e.kind, e.subject) for e in st2.events}
    removed = out.stdout.split("removed=")[1].split()[0].split(",")
    assert len(removed) == 2 and all(("replica_left", r) in kinds for r in removed), (removed, kinds)

    # steps continue after the scale-down
    await _settled(handle, 2, st2.step + 1)
    await handle.execute_update("stop", result_type=str)
    final: RunStatus = await asyncio.wait_for(handle.result(), TIMEOUT_S)
    assert final.phase == "finished"
    assert final.groups_consumed_twice == 0
    # 0 lost: every prompt issued is generated, failed, leased or back in the pool
    assert final.prompts_issued == (final.groups_generated + final.groups_failed + final.open_leases
                                    + final.returned_leases)
    assert final.groups_generated == final.groups_consumed + final.ready_groups


async def _reports_at_least(handle, n: int) -> bool:
    return len((await _status(handle)).replicas) >= n
