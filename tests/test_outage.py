"""A Temporal outage is a pause, not the end of the run: `laminar run` and its workers ride out a stopped dev
server and carry on when it is back; `laminar run --run-id` attaches to a run that is still going; `laminar
status|stop` answer in bounded time when no control worker is up, and `laminar stop --force` terminates.

All through the real `laminar` entry point (subprocesses) against a real dev stack (SQLite-backed Temporal).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from temporalio.client import Client, WorkflowExecutionStatus

from laminar.client.run_control import CONTROL_ANSWER_S
from laminar.contract import RunStatus, workflow_id_for
from laminar.drills.rules import groups_lost
from tests.fixtures.devhome import Dev, own_dev_stack
from tests.fixtures.stack import TEST_OVERRIDES
from tests.fixtures.waiting import async_wait_until

LAMINAR = [sys.executable, "-m", "laminar.cli.main"]
OVERRIDES = [f"--{o}" for o in TEST_OVERRIDES if not o.startswith("run.steps")]
# Longer than the SDK's retry window for one client call (RetryConfig: 10 s in all), after which the old
# `laminar run` died with an RPCError. Worker polls retry without limit in temporalio 1.35; the test shows it.
OUTAGE_S = 25.0


@pytest.fixture(scope="module")
def dev(tmp_path_factory) -> Iterator[Dev]:
    """A dev stack with no workers: every worker a test needs comes from the `laminar run` it starts."""
    with own_dev_stack(tmp_path_factory.mktemp("outage-home"), columns=200) as d:
        yield d


@pytest_asyncio.fixture(loop_scope="session")
async def client(dev: Dev) -> AsyncIterator[Client]:
    yield await dev.client()


def laminar(dev: Dev, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LAMINAR, *args], env=dev.env, capture_output=True, text=True, timeout=timeout)


def one_line(out: subprocess.CompletedProcess[str]) -> str:
    return " ".join((out.stdout + out.stderr).split())


@pytest.mark.slow  # 26 s; `make test` stays under 15 minutes (run with -m slow)
async def test_status_and_stop_are_bounded_without_a_control_worker_and_force_terminates(dev, client):
    started = laminar(dev, "start", "examples/tiny.toml", "--run-id", "t-no-control", *OVERRIDES)
    assert started.returncode == 0, started.stderr
    handle = client.get_workflow_handle(workflow_id_for("t-no-control"))
    # No control worker polls: each command gives up after CONTROL_ANSWER_S (10 s), plus its own start-up
    # (~2 s), well inside 30 s; before, `laminar stop` waited on the update for good.
    for command in ("status", "stop"):
        t0 = time.monotonic()
        out = laminar(dev, command, "t-no-control")
        took = time.monotonic() - t0
        assert out.returncode == 1, one_line(out)
        assert f"no control worker answered within {CONTROL_ANSWER_S:.0f} s" in one_line(out)
        assert "laminar stop --force t-no-control" in one_line(out)
        assert CONTROL_ANSWER_S <= took < 30, f"`laminar {command}` took {took:.1f} s"
    forced = laminar(dev, "stop", "--force", "t-no-control")
    assert forced.returncode == 0, one_line(forced)
    assert "phase=terminated" in forced.stdout
    assert (await handle.describe()).status == WorkflowExecutionStatus.TERMINATED
    # The finished run keeps its id: `laminar run` refuses it before starting any process.
    rerun = laminar(dev, "run", "examples/tiny.toml", "--run-id", "t-no-control", *OVERRIDES)
    assert rerun.returncode == 1, one_line(rerun)
    assert "already ran and is terminated; pick another --run-id" in one_line(rerun)
    assert not (Path(dev.env["LAMINAR_HOME"]) / "logs" / "t-no-control").exists()  # no worker was started
    # An unknown run is named as such, quickly.
    missing = laminar(dev, "status", "t-no-such-run")
    assert missing.returncode == 1 and "t-no-such-run: no such run" in one_line(missing)


async def _status(client: Client, run_id: str) -> RunStatus | None:
    try:
        return await client.get_workflow_handle(workflow_id_for(run_id)).query("status", result_type=RunStatus)
    except Exception:
        return None


async def _step(client: Client, run_id: str) -> int:
    st = await _status(client, run_id)
    return st.step if st is not None else -1


@pytest.mark.slow  # 48 s
async def test_laminar_run_attaches_and_rides_out_a_temporal_outage(dev, client, tmp_path):
    run_id = "t-outage"
    # A run started with no workers (as if an earlier `laminar run` had died): `laminar run` attaches to it.
    started = laminar(dev, "start", "examples/tiny.toml", "--run-id", run_id, "--steps", "1000", *OVERRIDES)
    assert started.returncode == 0, started.stderr
    log = tmp_path / "run.log"
    summary = tmp_path / "summary.json"
    with open(log, "w") as out:
        run = subprocess.Popen([*LAMINAR, "run", "examples/tiny.toml", "--run-id", run_id, "--summary", str(summary),
                                *OVERRIDES], env={**dev.env, "FORCE_COLOR": "1"}, stdout=out,
                               stderr=subprocess.STDOUT)
    try:
        await async_wait_until(lambda: _stepped(client, run_id, 1), 180, "the first step", interval_s=1.0)
        before = await _step(client, run_id)

        dev.stack.down()  # the Temporal dev server is gone; its SQLite state stays
        time.sleep(OUTAGE_S)
        assert run.poll() is None, f"`laminar run` exited during the outage:\n{log.read_text()[-3000:]}"
        dev.stack.up(port=dev.port, ui=False)  # the same port and state file
        client = await dev.client()
        # Stepping again: two steps past the last one seen before the outage.
        await async_wait_until(lambda: _stepped(client, run_id, before + 2), 120,
                               f"step {before + 2} after the restart", interval_s=1.0)
        assert run.poll() is None, log.read_text()[-3000:]

        stopped = laminar(dev, "stop", run_id)
        assert stopped.returncode == 0, one_line(stopped)
        assert run.wait(timeout=120) == 0, log.read_text()[-3000:]
    except AssertionError as e:  # a wait that timed out: show where the run was
        raise AssertionError(f"{e}\n--- laminar run output (end):\n{log.read_text()[-3000:]}") from None
    finally:
        if run.poll() is None:
            run.terminate()
            run.wait(timeout=60)
    text = log.read_text()
    assert f"run {run_id} is already running: attached to it" in text
    assert "Temporal unreachable for" in text  # the progress bar showed the outage
    final: RunStatus = await client.get_workflow_handle(workflow_id_for(run_id), result_type=RunStatus).result()
    assert final.phase == "finished" and final.step >= before + 2
    assert groups_lost(final) == 0 and final.groups_consumed_twice == 0
    assert json.loads(summary.read_text())["groups_consumed_twice"] == 0


async def _stepped(client: Client, run_id: str, n: int) -> bool:
    return await _step(client, run_id) >= n
