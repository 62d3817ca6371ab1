"""`laminar scale` on the real stack (SQLite-backed Temporal dev server, S3 server, worker processes): a run
scaled 2 -> 4 -> 2 rollout replicas and 2 -> 3 -> 2 relays while it trains keeps stepping, its status follows the
targets, removed replicas hand their groups on, and it ends with no group lost and none consumed twice. And a
rollout worker given the notice (SIGTERM) hands its replicas' groups on and exits 0 within the notice."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from laminar.client.connect import connect, store_for
from laminar.client.run_control import scale_run, scale_targets, start_workflow
from laminar.client.settings import Settings
from laminar.contract import RunStatus
from laminar.devstack.stack import DevStack
from laminar.workers.launcher import LocalLauncher, plan_processes
from tests.fixtures.s3 import free_port
from tests.fixtures.stack import small_config
from tests.fixtures.temporal import terminate_running
from tests.fixtures.waiting import async_wait_until

# The workers are laid out for 4 replicas on 3 hosts plus 1 spare slot each: (2 + 1) + (1 + 1) + (1 + 1) = 7
# rollout slots, so 4 replicas (and 2 removed ones still returning) always find a slot, and host-2 has a relay
# worker that idles until a run asks for a third relay. The run itself starts with 2 replicas and 2 relays.
STACK_OVERRIDES = ["rollout.replicas=4", "relay.relays=3"]
RUN_OVERRIDES = ["run.steps=1000", "rollout.replicas=2", "relay.relays=2"]
TIMEOUT_S = 180.0


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def scale_stack(tmp_path_factory, aws_test_env) -> AsyncIterator[tuple[Settings, Path, LocalLauncher]]:
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
        yield settings, home, launcher
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
    settings, home, _ = scale_stack
    client = await connect(settings)
    cfg = small_config(*RUN_OVERRIDES)
    handle = await start_workflow(client, cfg)
    st = await _settled(handle, 2, 0)
    assert st.replicas_target == 2

    # 2 -> 4 through the Python client: the lowest free ids start on the spare slots
    res = await scale_run(settings, cfg.run.run_id, 4)
    assert (res.replicas_target, res.started, res.removed) == (4, ["replica-2", "replica-3"], [])
    store = store_for(settings)  # the record `laminar run` follows to start worker processes, without a query
    assert scale_targets(store, cfg.run.run_id) == (4, 2)
    st4 = await _settled(handle, 4, st.step)
    assert st4.replicas_target == 4
    # the new replicas claimed and reported: 4 replica reports in the status
    await async_wait_until(lambda: _reports_at_least(handle, 4), TIMEOUT_S, "reports from 4 replicas")

    # 4 -> 2 through the command line (a real process): two replicas leave and return
    out = await _laminar(home, "scale", cfg.run.run_id, "--replicas", "2", timeout_s=120)
    assert out.returncode == 0, out.stderr
    assert "replicas_target=2" in out.stdout and "removed=replica-" in out.stdout, out.stdout
    removed = out.stdout.split("removed=")[1].split()[0].split(",")
    assert len(removed) == 2
    assert scale_targets(store, cfg.run.run_id) == (2, 2)

    async def left() -> RunStatus | None:  # their activities returned and the workflow retired them
        st = await _settled(handle, 2, st4.step)
        return st if all(("replica_left", r) in {(e.kind, e.subject) for e in st.events} for r in removed) else None
    st2 = await async_wait_until(left, TIMEOUT_S, f"{removed} retired")
    assert st2.replicas_target == 2
    kinds = {(e.kind, e.subject) for e in st2.events}
    # each removed replica handed its groups on as it left (moved to a replica of its version, or returned
    # with its prefixes); none was left holding leases for the workflow to take back when it returned
    departed = {e.subject.split("->")[0] for e in st2.events
                if e.kind in ("departure_moved", "departure_returned", "replica_departed")}
    assert set(removed) <= departed, (removed, kinds)
    assert st2.scale_groups_returned == 0

    # relays 2 -> 3 -> 2: host-2's relay joins the chain, then leaves it; steps go on throughout
    res3 = await scale_run(settings, cfg.run.run_id, relays=3)
    assert (res3.relays_target, res3.relays_started, res3.relays_removed) == (3, ["host-2"], [])
    assert scale_targets(store, cfg.run.run_id) == (2, 3)
    st3 = await async_wait_until(lambda: _chain_is(handle, ["host-0", "host-1", "host-2"]), TIMEOUT_S,
                                 "host-2's relay in the chain")
    st3 = await _settled(handle, 2, st3.step)
    res2 = await scale_run(settings, cfg.run.run_id, relays=2)
    assert (res2.relays_target, res2.relays_started, res2.relays_removed) == (2, [], ["host-2"])
    st2 = await async_wait_until(lambda: _chain_is(handle, ["host-0", "host-1"]), TIMEOUT_S, "host-2 out of the chain")
    assert st2.relays_target == 2

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


async def _laminar(home: Path, *args: str, timeout_s: float) -> subprocess.CompletedProcess:
    """The `laminar` command line in a real process, against this module's stack."""
    env = {**os.environ, "LAMINAR_HOME": str(home), "PYTHONPATH": os.getcwd()}
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "laminar.cli.main", *args], env=env,
                                   capture_output=True, text=True, timeout=timeout_s)


async def _reports_at_least(handle, n: int) -> bool:
    return len((await _status(handle)).replicas) >= n


async def _chain_is(handle, relay_ids: list[str]) -> RunStatus | None:
    st = await _status(handle)
    return st if sorted(r.relay_id for r in st.relays) == relay_ids else None


NOTICE_S = 30.0  # LAMINAR_NOTICE_S's default: the worker must be gone well within it


async def test_a_rollout_worker_given_the_notice_hands_its_groups_on_and_exits_0(scale_stack):
    settings, _, launcher = scale_stack
    client = await connect(settings)
    cfg = small_config(*RUN_OVERRIDES)
    handle = await start_workflow(client, cfg)
    st = await _settled(handle, 2, 1)
    await async_wait_until(lambda: _reports_at_least(handle, 2), TIMEOUT_S, "reports from 2 replicas")
    st = await _status(handle)
    host = sorted(r.host_id for r in st.replicas)[0]  # a host that runs a replica of this run
    mine = sorted(r.replica_id for r in st.replicas if r.host_id == host)
    proc = launcher.processes[f"rollout-{host}"]
    assert proc.proc is not None and proc.proc.poll() is None

    # `laminar drain rollout-<host>` (a real process) finds the worker by name and gives it the notice (SIGTERM)
    t0 = time.monotonic()
    out = await _laminar(settings.home, "drain", f"rollout-{host}", timeout_s=NOTICE_S + 30)
    took = time.monotonic() - t0
    assert out.returncode == 0 and f"worker=rollout-{host} pid={proc.pid} left in" in out.stdout, (out.stdout, out.stderr)
    code = await asyncio.to_thread(proc.proc.wait, 5)
    assert code == 0 and took < NOTICE_S, (code, took)
    # the workflow learnt of each departure at once (no heartbeat timeout): its groups moved on or went back
    # with their prefixes
    after = await _status(handle)
    departed = {e.subject.split("->")[0] for e in after.events
                if e.kind in ("departure_moved", "departure_returned", "replica_departed")}
    assert set(mine) <= departed, (mine, [(e.kind, e.subject) for e in after.events[-12:]])
    # the replicas continue elsewhere (the other hosts' spare slots) and the run steps on
    await _settled(handle, 2, after.step + 1)
    launcher._start(proc)  # the stack's host comes back for the tests after this one

    await handle.execute_update("stop", result_type=str)
    final: RunStatus = await asyncio.wait_for(handle.result(), TIMEOUT_S)
    assert final.phase == "finished" and final.groups_consumed_twice == 0
    assert final.prompts_issued == (final.groups_generated + final.groups_failed + final.open_leases
                                    + final.returned_leases)
    assert final.groups_generated == final.groups_consumed + final.ready_groups
