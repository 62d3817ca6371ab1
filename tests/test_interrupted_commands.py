"""An interrupted command ends what it started (issue 31, deliverable 6): SIGTERM of `laminar bench throughput` and
of `laminar simulate --validate` mid-run leaves no run workflow Running, and `laminar list` names the owner of each
run, marking a run whose owning command is gone as orphaned with the command that ends it.

Real parts: the `laminar` entry point as a subprocess, a dev stack of the test's own (so the commands find it and
leave it up, and the test can look at what they left in it), the modelled engine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from temporalio.client import Client, WorkflowExecutionStatus

from laminar import contract
from laminar.client.connect import connect
from laminar.client.run_control import start_workflow
from laminar.client.settings import Settings
from laminar.config import RunConfig
from laminar.contract import RunStatus, workflow_id_for
from laminar.devstack.stack import DevStack
from tests.fixtures.s3 import free_port
from tests.fixtures.waiting import async_wait_until

LAMINAR = [sys.executable, "-m", "laminar.cli.main"]
FAST = ["--modelled.response_p50_tokens=64", "--modelled.max_response_tokens=512"]
COMMANDS = {
    "bench throughput": ["bench", "throughput", "--modes", "laminar,sync", "--replicas", "2", "--iterations", "20",
                         "--workload", "long_tail", *FAST, "--modelled.speedup=20"],
    "simulate --validate": ["simulate", "--validate", "--modes", "laminar,sync", "--workloads", "long_tail",
                            "--replicas", "2", "--iterations", "20"],
}


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Iterator[dict[str, str]]:
    home: Path = tmp_path_factory.mktemp("interrupt-home")
    stack = DevStack(home)
    stack.up(port=free_port(), ui=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAMINAR_")}
    env.update(LAMINAR_HOME=str(home), LAMINAR_LOG_LEVEL="warning", COLUMNS="400")
    try:
        yield env
    finally:
        stack.down()


@pytest_asyncio.fixture(loop_scope="session")
async def client(env) -> AsyncIterator[Client]:
    yield await connect(Settings.from_env(env))


async def _running_runs(client: Client) -> list[str]:
    where = f"WorkflowType = '{contract.TRAINING_RUN_WORKFLOW}' AND ExecutionStatus = 'Running'"
    return [wf.id async for wf in client.list_workflows(where)]


async def _mid_run(client: Client, seen: set[str]) -> str | None:
    """A run the command started that has trained a step (its workers are up and working), else None."""
    for wid in await _running_runs(client):
        seen.add(wid)
        try:
            st = await client.get_workflow_handle(wid).query("status", result_type=RunStatus)
        except Exception:  # its control worker is still starting
            continue
        if st.step >= 1:
            return wid
    return None


@pytest.mark.slow  # 10-15 s each on 2 cores
@pytest.mark.timeout(400)
@pytest.mark.parametrize("command", list(COMMANDS))
async def test_sigterm_mid_run_leaves_no_run_workflow_running(env, client, tmp_path, command):
    log = tmp_path / "out.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*LAMINAR, *COMMANDS[command]], env=env, stdout=out, stderr=subprocess.STDOUT)
    seen: set[str] = set()
    try:
        wid = await async_wait_until(lambda: _mid_run(client, seen), 240, f"a run of `laminar {command}` at step 1",
                                     interval_s=1.0)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    text = log.read_text()
    assert code == 130, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    # terminated by the command, or cancelled (watch_run asks first) if the control worker got to it before
    ended = (await client.get_workflow_handle(wid).describe()).status
    assert ended in (WorkflowExecutionStatus.TERMINATED, WorkflowExecutionStatus.CANCELED), (ended, text[-2000:])
    for other in seen:  # every run it started is closed, and no run at all is left Running
        assert (await client.get_workflow_handle(other).describe()).status != WorkflowExecutionStatus.RUNNING
    assert await _running_runs(client) == []
    assert f"ended run {wid.removeprefix('run/')}" in text or "were ended" in text, text[-2000:]


@pytest.mark.timeout(120)
async def test_list_marks_a_run_whose_owning_command_is_gone_as_orphaned(env, client):
    """A run's memo names the command that owns it; `laminar list` checks that process on this host. A process that
    exited (here: a child that ran `true`) stands for a command killed before it could end its run."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    run_id = f"t-orphan-{int(time.time())}"
    cfg = RunConfig.load(None, ["run.steps=5"]).with_run_id(run_id)
    await start_workflow(client, cfg, owner="laminar bench throughput")  # owned by this (live) test process
    orphan = f"{run_id}-b"
    handle = await client.start_workflow(
        contract.TRAINING_RUN_WORKFLOW, {"config": cfg.with_run_id(orphan).to_json()}, id=workflow_id_for(orphan),
        task_queue="no-worker-polls-this", memo={"laminar_owner": {"command": "laminar bench throughput",
                                                                   "pid": gone.pid, "host": os.uname().nodename}})
    try:
        out = subprocess.run([*LAMINAR, "list"], env=env, capture_output=True, text=True, timeout=60)
        text = " ".join(out.stdout.split())
        assert out.returncode == 0, out.stderr
        assert f"ORPHANED: laminar bench throughput (pid {gone.pid}) is gone; end it: laminar stop --force {orphan}" \
            in text, text
        assert f"laminar bench throughput (pid {os.getpid()})" in text, text
    finally:
        await handle.terminate()
        await client.get_workflow_handle(workflow_id_for(run_id)).terminate()


def test_owner_line_marks_only_a_running_run_of_a_gone_process_on_this_host_as_orphaned():
    from laminar.cli.report import owner_line

    gone = subprocess.Popen(["true"])
    gone.wait()
    here, me = os.uname().nodename, os.getpid()
    bench = {"command": "laminar bench throughput", "pid": gone.pid, "host": here}
    assert owner_line("r", "running", bench) == (f"ORPHANED: laminar bench throughput (pid {gone.pid}) is gone; end it: "
                                                 "laminar stop --force r")
    assert owner_line("r", "terminated", bench) == f"laminar bench throughput (pid {gone.pid})"  # ended: no orphan
    assert owner_line("r", "running", {**bench, "pid": me}) == f"laminar bench throughput (pid {me})"
    assert owner_line("r", "running", {**bench, "host": "elsewhere"}) == (
        f"laminar bench throughput (pid {gone.pid} on elsewhere)")  # another host's process cannot be checked here
    assert owner_line("r", "running", {"command": "laminar start", "pid": 0, "host": here}) == "laminar start"
    assert owner_line("r", "running", None) == "-"  # started without an owner (the temporal CLI, tests)
