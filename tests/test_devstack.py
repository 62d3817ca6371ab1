"""The dev stack through the real `laminar dev` entry point: a real Temporal dev server and moto S3."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import boto3
import psutil
import pytest
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client, WorkflowExecutionStatus

from laminar.client.settings import Settings
from laminar.devstack.stack import S3_CREDENTIALS, DevStack
from laminar.errors import DevStackError
from tests.fixtures.s3 import free_port
from tests.fixtures.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
# what a user runs: the console script's entry (cli.main.main leaves without interpreter finalisation, which the
# Temporal client's native threads can crash: `dev_app()` called directly exited -11 after a finished `dev up` in CI)
LAMINAR = [sys.executable, "-m", "laminar.cli.main"]


def pid_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    home = tmp_path / "laminar-home"
    yield home
    DevStack(home).down()  # whatever a test started, stopped by the recorded pids


def dev(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAMINAR_")}
    env.update(LAMINAR_HOME=str(home), COLUMNS="200")
    return subprocess.run(
        [*LAMINAR, "dev", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def dev_ok(home: Path, *args: str) -> str:
    result = dev(home, *args)
    assert result.returncode == 0, (
        f"laminar dev {' '.join(args)}: rc={result.returncode}\n{result.stdout}{result.stderr}"
    )
    return result.stdout


def record(home: Path) -> dict:
    return json.loads((home / "dev.json").read_text())


async def test_up_status_down_twice_keeps_state(home: Path) -> None:
    port = free_port()
    workflow_id = "devstack-persistence-probe"
    pids = []
    for round_ in (1, 2):
        out = dev_ok(home, "up", "--port", str(port))
        assert "dev stack started" in out
        assert f"127.0.0.1:{port}" in out
        rec = record(home)
        pids.append(rec["temporal_pid"])
        assert rec["temporal_address"] == f"127.0.0.1:{port}"
        assert rec["ui_url"].startswith("http://127.0.0.1:")  # port + 1000 unless that one is taken

        again = dev_ok(home, "up")
        assert "already running" in again
        assert record(home)["temporal_pid"] == rec["temporal_pid"]  # no second server

        status = dev_ok(home, "status")
        for shown in (rec["temporal_address"], "default", rec["ui_url"], rec["store_url"]):
            assert shown in status

        client = await Client.connect(rec["temporal_address"], namespace="default")
        described = await client.workflow_service.describe_namespace(
            DescribeNamespaceRequest(namespace="default")
        )
        assert described.namespace_info.name == "default"
        with urllib.request.urlopen(rec["ui_url"], timeout=5) as resp:
            assert resp.status == 200
        if round_ == 1:  # no worker polls this queue: the workflow just stays RUNNING in SQLite
            await client.start_workflow("NoSuchWorkflow", id=workflow_id, task_queue="devstack-nobody")
        else:  # the server restarted on the same SQLite file, so the execution is still there
            desc = await client.get_workflow_handle(workflow_id).describe()
            assert desc.status == WorkflowExecutionStatus.RUNNING

        down = dev_ok(home, "down")
        assert f"temporal (pid {rec['temporal_pid']})" in down
        wait_until(
            lambda pid=rec["temporal_pid"]: pid_gone(pid), 10, f"temporal pid {rec['temporal_pid']} to exit"
        )
        assert not (home / "dev.json").exists()
        assert Path(rec["db_file"]).is_file()  # state survives `down`

        stopped = dev(home, "status")
        assert stopped.returncode == 1
        assert "dev stack is not running; start it with `laminar dev up`" in stopped.stdout
    assert pids[0] != pids[1]
    assert "was not running" in dev_ok(home, "down")


def test_up_with_s3_creates_bucket_and_settings_point_at_it(home: Path) -> None:
    port = free_port()
    out = dev_ok(home, "up", "--s3", "--port", str(port), "--no-ui")
    rec = record(home)
    assert rec["ui_url"] is None
    assert rec["store_url"] == "s3://laminar"
    assert rec["s3_endpoint"] in out

    s3 = boto3.client("s3", endpoint_url=rec["s3_endpoint"], **S3_CREDENTIALS)
    s3.head_bucket(Bucket="laminar")  # raises if absent

    settings = Settings.from_env({"LAMINAR_HOME": str(home)})
    assert (settings.temporal_address, settings.store_url, settings.s3_endpoint) == (
        f"127.0.0.1:{port}",
        "s3://laminar",
        rec["s3_endpoint"],
    )
    assert rec["s3_endpoint"] in dev_ok(home, "status")

    down = dev_ok(home, "down")
    assert f"s3 (pid {rec['s3_pid']})" in down
    for pid in (rec["temporal_pid"], rec["s3_pid"]):
        wait_until(lambda pid=pid: pid_gone(pid), 10, f"pid {pid} to exit")


def test_s3_is_added_to_a_running_stack(home: Path) -> None:
    dev_ok(home, "up", "--port", str(free_port()), "--no-ui")
    temporal_pid = record(home)["temporal_pid"]
    assert record(home)["s3_pid"] is None
    assert "already running" in dev_ok(home, "up", "--s3")
    rec = record(home)
    assert rec["temporal_pid"] == temporal_pid
    assert rec["s3_pid"] is not None
    boto3.client("s3", endpoint_url=rec["s3_endpoint"], **S3_CREDENTIALS).head_bucket(Bucket="laminar")


def test_stale_record_is_replaced_and_foreign_pid_left_alone(home: Path) -> None:
    # A live process that is not ours (pid reuse): its cmdline names neither temporal nor moto_server.
    foreign = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        home.mkdir(parents=True)
        stale = {"home": str(home), "temporal_pid": foreign.pid, "temporal_address": "127.0.0.1:1",
                 "namespace": "default", "ui_url": None, "db_file": str(home / "temporal.db"),
                 "temporal_log": "x", "store_url": "file:///x", "started_at": "2026-01-01T00:00:00+00:00",
                 "s3_pid": foreign.pid}  # fmt: skip
        (home / "dev.json").write_text(json.dumps(stale))
        assert "not running" in dev(home, "status").stdout

        port = free_port()
        assert "dev stack started" in dev_ok(home, "up", "--port", str(port), "--no-ui")
        rec = record(home)
        assert rec["temporal_pid"] != foreign.pid
        assert rec["temporal_address"] == f"127.0.0.1:{port}"
        assert foreign.poll() is None  # untouched

        assert "dev stack was not running" not in dev_ok(home, "down")
        assert foreign.poll() is None
    finally:
        os.kill(foreign.pid, signal.SIGKILL)
        foreign.wait()


def test_ensure_up_in_process_and_port_conflict(home: Path) -> None:
    stack = DevStack(home)
    port = free_port()
    info, started = stack.ensure_up(port=port, ui=False)
    assert started
    same, started_again = stack.ensure_up()
    assert (same, started_again) == (info, False)
    assert stack.status() == info

    with pytest.raises(DevStackError, match=f"already runs Temporal at 127.0.0.1:{port}.*laminar dev down"):
        stack.ensure_up(port=free_port())

    assert stack.down() == [f"temporal (pid {info.temporal_pid})"]
    assert pid_gone(info.temporal_pid)  # our child: down reaps it
    assert stack.status() is None
    assert stack.down() == []


def test_port_in_use_is_a_clear_error(home: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = dev(home, "up", "--port", str(port))
    assert result.returncode == 1
    # the one-line error every command prints, on stderr
    assert f"port {port} on 127.0.0.1 is in use" in result.stderr and result.stderr.startswith("error: ")
    assert not (home / "dev.json").exists()


def test_s3_state_survives_down_up_and_an_interrupt(tmp_path):
    stack = DevStack(tmp_path / "home")
    try:
        info = stack.up(s3=True, port=free_port(), ui=False)
        s3 = boto3.client("s3", endpoint_url=info.s3_endpoint, **S3_CREDENTIALS)
        s3.put_object(Bucket="laminar", Key="a/one", Body=b"1" * 1000)
        s3.put_object(Bucket="laminar", Key="a/two", Body=b"2")
        s3.delete_object(Bucket="laminar", Key="a/two")
        stack.down()
        info = stack.up(s3=True, port=free_port(), ui=False)
        s3 = boto3.client("s3", endpoint_url=info.s3_endpoint, **S3_CREDENTIALS)
        assert s3.get_object(Bucket="laminar", Key="a/one")["Body"].read() == b"1" * 1000
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket="laminar").get("Contents", [])]
        assert keys == ["a/one"]  # the delete was replayed too
        s3.put_object(Bucket="laminar", Key="a/three", Body=b"3")
        stopped_at, back_at = stack.interrupt_s3(outage_s=0.5)
        assert back_at - stopped_at >= 0.5
        assert stack.status().s3_endpoint == info.s3_endpoint  # same port after the interrupt
        assert s3.get_object(Bucket="laminar", Key="a/three")["Body"].read() == b"3"
    finally:
        stack.down()


def test_an_interrupted_s3_that_fails_to_start_is_started_again(tmp_path):
    """A drill's restart of S3 that fails once (here: its port held by another socket until the first start has
    failed on it) is tried again, so the stack never stays without S3 and the state written before is served."""
    stack = DevStack(tmp_path / "home")
    try:
        info = stack.up(s3=True, port=free_port(), ui=False)
        s3 = boto3.client("s3", endpoint_url=info.s3_endpoint, **S3_CREDENTIALS)
        s3.put_object(Bucket="laminar", Key="kept", Body=b"k")
        port = int(info.s3_endpoint.rsplit(":", 1)[1])
        log_file = Path(info.s3_log)
        held: dict[str, object] = {}

        def squat() -> None:  # take the port once the server let it go; give it back after one start failed on it
            wait_until(lambda: not psutil.pid_exists(info.s3_pid), timeout_s=30, what="the S3 server to stop")
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen()
            held["bound"] = True
            failures = log_file.read_text().count("Address already in use")
            wait_until(lambda: log_file.read_text().count("Address already in use") > failures, timeout_s=60,
                       what="a start of the S3 server to fail on the held port")
            sock.close()

        squatter = threading.Thread(target=squat, daemon=True)
        squatter.start()
        stack.interrupt_s3(outage_s=2.0)
        squatter.join(timeout=5)
        assert held.get("bound"), "the port was never held: the first start did not meet a taken port"
        assert log_file.read_text().count("Address already in use") >= 1
        assert stack.status().s3_endpoint == info.s3_endpoint
        assert s3.get_object(Bucket="laminar", Key="kept")["Body"].read() == b"k"
    finally:
        stack.down()
