"""The nemesis against real processes under the real local launcher (sleepers stand in for workers): the launcher
publishes its process table, the nemesis finds its targets there, injects, and every fault heals."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from laminar.chaos.nemesis import (
    NO_PACKET_FILTER,
    Nemesis,
    _partition_commands,
    data_ports,
    partition_tool,
    read_table,
    sweep_stale_rules,
)
from laminar.chaos.schedule import Fault, Schedule
from laminar.devstack.stack import DevStack, free_port
from laminar.errors import StoreError
from laminar.storage.objects import open_store
from laminar.workers.launcher import LocalLauncher, ManagedProcess
from tests.fixtures.waiting import wait_until

LISTENER = ("import os, socket, time\n"
            "a = socket.socket(); a.bind(('127.0.0.1', int(os.environ['LAMINAR_METRICS_PORT']))); a.listen()\n"
            "b = socket.socket(); b.bind(('127.0.0.1', 0)); b.listen()\n"
            "print(b.getsockname()[1], flush=True); time.sleep(60)")
# a relay stand-in for the partition: its data port accepts and echoes, its metrics port only listens
ECHO_RELAY = ("import os, socket, threading\n"
              "m = socket.socket(); m.bind(('127.0.0.1', int(os.environ['LAMINAR_METRICS_PORT']))); m.listen()\n"
              "d = socket.socket(); d.bind(('127.0.0.1', 0)); d.listen()\n"
              "def echo(c):\n"
              "    while (b := c.recv(64)):\n"
              "        c.sendall(b)\n"
              "while True:\n"
              "    threading.Thread(target=echo, args=(d.accept()[0],), daemon=True).start()\n")
SLEEPER = [sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
           "time.sleep(600)"]


@pytest.fixture
def launcher(tmp_path: Path):
    procs = [ManagedProcess(name, SLEEPER, {"PATH": "/usr/bin:/bin"}, tmp_path / f"{name}.log")
             for name in ("trainer", "rollout-host-0")]
    launcher = LocalLauncher(procs, healthy_s=60.0)
    launcher.table_path = tmp_path / "runs" / "r" / "processes.json"
    launcher.start_all()
    launcher.start_supervision(interval_s=0.1)
    yield launcher
    launcher.stop_all(timeout_s=5)


def _state(pid: int) -> str:
    return psutil.Process(pid).status()


def test_table_faults_and_heals(launcher, tmp_path):
    table = read_table(launcher.table_path)
    assert [r["name"] for r in table["processes"]] == ["trainer", "rollout-host-0"]
    trainer, rollout = (r["pid"] for r in table["processes"])
    schedule = Schedule(0, 10, ["kill", "stop", "preempt"], 1, 1, [
        Fault(0, "stop", "rollout-host-0", 0.0, 1.5),
        Fault(1, "kill", "trainer", 0.3, 0.0),  # overlaps the stop
    ])
    nemesis = Nemesis(launcher.table_path, None, None)
    t0 = time.time()
    nemesis.run(schedule, t0)
    stop, kill = nemesis.records
    assert stop.pid == rollout and stop.healed_at - stop.injected_at >= 1.5
    assert _state(rollout) != psutil.STATUS_STOPPED  # continued: the zombie woke up
    # the first restart comes after the launcher's backoff of 2**0 = 1 s
    assert kill.pid == trainer and kill.new_pid not in (None, trainer) and kill.healed_at > kill.injected_at
    row = next(r for r in read_table(launcher.table_path)["processes"] if r["name"] == "trainer")
    assert row["pids"] == [trainer, kill.new_pid] and row["restarts"] == 1
    # preempt: SIGTERM; the sleeper exits 0 and the launcher starts it again
    nemesis = Nemesis(launcher.table_path, None, None)
    nemesis.run(Schedule(0, 5, ["preempt"], 1, 0, [Fault(0, "preempt", "rollout-host-0", 0.0, 0.0)]), time.time())
    assert nemesis.records[0].new_pid not in (None, rollout)


def test_stopped_process_is_continued_when_the_nemesis_stops_early(launcher):
    pid = read_table(launcher.table_path)["processes"][1]["pid"]
    nemesis = Nemesis(launcher.table_path, None, None)
    schedule = Schedule(0, 60, ["stop"], 1, 0, [Fault(0, "stop", "rollout-host-0", 0.0, 60.0)])

    th = threading.Thread(target=nemesis.run, args=(schedule, time.time()))
    th.start()
    deadline = time.time() + 10
    while _state(pid) != psutil.STATUS_STOPPED and time.time() < deadline:
        time.sleep(0.05)
    assert _state(pid) == psutil.STATUS_STOPPED
    nemesis.stop()  # the chaos run ends (or fails) with the fault held: it is healed at once
    th.join(timeout=10)
    assert _state(pid) != psutil.STATUS_STOPPED and nemesis.records[0].healed_at is not None


def test_stop_all_marks_the_table_and_every_incarnation_is_gone(launcher):
    pids = [r["pid"] for r in read_table(launcher.table_path)["processes"]]
    launcher.stop_all(timeout_s=5)
    table = json.loads(launcher.table_path.read_text())
    assert table["stopped"] and not any(psutil.pid_exists(p) and _state(p) != psutil.STATUS_ZOMBIE for p in pids)


def test_unknown_target_is_skipped_with_a_reason(launcher):
    nemesis = Nemesis(launcher.table_path, None, None)
    nemesis.run(Schedule(0, 5, ["kill", "store"], 1, 0, [Fault(0, "kill", "relay-host-9", 0.0, 0.0),
                                                          Fault(1, "store", "store", 0.0, 1.0)]), time.time())
    assert all(r.skipped for r in nemesis.records)
    assert "no live process" in nemesis.records[0].detail and "S3" in nemesis.records[1].detail


def test_data_ports_leave_out_the_metrics_port_and_partition_rules_are_symmetric(tmp_path):
    metrics = free_port()
    child = subprocess.Popen([sys.executable, "-c", LISTENER], env={"LAMINAR_METRICS_PORT": str(metrics)},
                             stdout=subprocess.PIPE, text=True)
    try:
        data = int(child.stdout.readline())  # the child listens on both before it prints
        assert data_ports(child.pid) == [data]
    finally:
        child.kill()
        child.wait()
    add, remove = _partition_commands("iptables", 7000, True), _partition_commands("iptables", 7000, False)
    assert [c[1] for c in add] == ["-I", "-I"] and [c[1] for c in remove] == ["-D", "-D"]
    assert [c[2:] for c in add] == [c[2:] for c in remove]  # the same rules, removed exactly
    assert _partition_commands("nft", 7000, False, owner=42) == [
        ["nft", "delete", "table", "inet", "laminar_chaos_42_7000"]]
    assert all(f"laminar-chaos pid={os.getpid()}" in c for c in add)  # each rule names the nemesis that owns it


def _echo(port: int, timeout_s: float = 1.0) -> bool:
    """Whether a new connection to the port echoes a byte back within timeout_s."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as c:
            c.settimeout(timeout_s)
            c.sendall(b"x")
            return c.recv(1) == b"x"
    except OSError:
        return False


def test_partition_drops_the_relays_data_port_then_heals(tmp_path):
    """The real packet filter (iptables or nft; `make setup` installs iptables as root): a relay stand-in in the
    launcher's table, its data port partitioned for the hold (new connections and an open one both go silent; the
    metrics port still answers), then reachable again, and no rule of ours left behind."""
    tool = partition_tool()
    if tool is None:
        pytest.skip(NO_PACKET_FILTER)
    metrics = free_port()
    relay = ManagedProcess("relay-host-0", [sys.executable, "-c", ECHO_RELAY],
                           {"PATH": "/usr/bin:/bin", "LAMINAR_METRICS_PORT": str(metrics)}, tmp_path / "relay.log")
    launcher = LocalLauncher([relay], healthy_s=60.0)
    launcher.table_path = tmp_path / "runs" / "r" / "processes.json"
    launcher.start_all()
    try:
        pid = read_table(launcher.table_path)["processes"][0]["pid"]
        (port,) = wait_until(lambda: data_ports(pid), 30, "the relay stand-in listening on its data port")
        assert _echo(port)
        held = socket.create_connection(("127.0.0.1", port), timeout=2)  # open before the partition
        nemesis = Nemesis(launcher.table_path, None, None, tool)
        th = threading.Thread(target=nemesis.run, args=(
            Schedule(0, 10, ["partition"], 1, 0, [Fault(0, "partition", "relay-host-0", 0.0, 3.0)]), time.time()))
        th.start()
        wait_until(lambda: nemesis.records and nemesis.records[0].injected_at, 10, "the partition injected")
        assert not _echo(port)  # a new connection goes unanswered
        held.settimeout(1.0)
        held.sendall(b"y")
        with pytest.raises(TimeoutError):
            held.recv(1)  # and so does the open one: a gray failure, not a reset
        socket.create_connection(("127.0.0.1", metrics), timeout=1).close()  # the metrics port is not touched
        th.join(timeout=30)
        rec = nemesis.records[0]
        assert not rec.skipped and rec.pid == pid and str(port) in rec.detail, rec
        assert rec.healed_at - rec.injected_at >= 3.0
        assert _echo(port, timeout_s=5.0)  # healed
        held.settimeout(10.0)
        assert held.recv(1) == b"y"  # TCP retransmits the byte dropped meanwhile: the open connection lives on
        held.close()
        rules = subprocess.run(["iptables", "-S"] if tool == "iptables" else ["nft", "list", "ruleset"],
                               capture_output=True, text=True, check=True).stdout
        assert str(port) not in rules, rules
    finally:
        launcher.stop_all(timeout_s=5)


@pytest.mark.slow  # make test stays under 15 minutes; run with pytest -m slow
def test_readonly_store_refuses_writes_for_the_hold(tmp_path, aws_test_env):
    """The readonly fault against the dev stack's real S3 server: writes denied while it holds, counted by the
    server and recorded by the nemesis; reads served; writes accepted after it."""
    stack = DevStack(tmp_path / "home")
    info = stack.up(s3=True, port=free_port(), ui=False)
    try:
        store = open_store(info.store_url, endpoint_url=info.s3_endpoint)
        store.put("runs/r/kept", b"kept")
        nemesis = Nemesis(tmp_path / "processes.json", stack.interrupt_s3, stack.restart_temporal,
                          readonly_store=stack.readonly_s3)
        th = threading.Thread(target=nemesis.run, args=(
            Schedule(0, 30, ["readonly"], 1, 0, [Fault(0, "readonly", "store", 0.0, 10.0)]), time.time()))
        th.start()
        wait_until(lambda: nemesis.records and nemesis.records[0].injected_at, 10, "the store made read-only")

        def refused(key: str) -> bool:
            try:
                store.put(key, b"x")
            except StoreError as e:
                return "AccessDenied" in str(e)
            return False

        # the record is written as the switch is thrown: the first refusal marks it on (a probe write that lands
        # before it is deleted below, with the other probes)
        probes = wait_until(lambda: refused(f"runs/r/probe-{time.monotonic_ns()}"), 5, "a write refused") and 1
        denied = sum(refused(f"runs/r/new-{i}") for i in range(3))  # well inside the 10 s hold
        assert denied == 3 and store.get("runs/r/kept") == b"kept"
        th.join(timeout=40)
        rec = nemesis.records[0]
        assert not rec.skipped and rec.refused >= 3 + probes and rec.healed_at - rec.injected_at >= 10.0, rec
        for key in store.list("runs/r/probe-"):
            store.delete(key)
        store.put("runs/r/after", b"a")
        assert store.list("runs/r/") == ["runs/r/after", "runs/r/kept"]
    finally:
        stack.down()


def test_rules_of_a_killed_nemesis_are_swept_those_of_a_live_one_kept():
    """A `laminar chaos` killed mid-partition leaves its DROP rules; the next nemesis removes them (their owner is
    dead) and leaves a live owner's rules (another chaos run) alone."""
    tool = partition_tool()
    if tool is None:
        pytest.skip(NO_PACKET_FILTER)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid names an owner that no longer runs
    dead_port, live_port = free_port(), free_port()
    listing = ["iptables", "-S"] if tool == "iptables" else ["nft", "list", "tables"]
    try:
        for cmd in (*_partition_commands(tool, dead_port, True, owner=dead.pid),
                    *_partition_commands(tool, live_port, True)):
            subprocess.run(cmd, check=True, capture_output=True)
        removed = sweep_stale_rules(tool)
        rules = subprocess.run(listing, capture_output=True, text=True, check=True).stdout
        assert removed and all(str(dead_port) in r or str(dead.pid) in r for r in removed), removed
        assert str(dead_port) not in rules and str(live_port) in rules, rules
    finally:
        for cmd in (*_partition_commands(tool, dead_port, False, owner=dead.pid),
                    *_partition_commands(tool, live_port, False)):
            subprocess.run(cmd, capture_output=True)
    assert str(live_port) not in subprocess.run(listing, capture_output=True, text=True).stdout


def test_a_pid_given_to_another_process_is_not_signalled(tmp_path):
    """The table's newest incarnation died and the OS gave its pid to an unrelated process before the launcher
    recorded the restart: the nemesis must skip the fault, not kill the stranger. Here the stranger is a real
    process whose table row carries a start time 30 s before its own."""
    stranger = subprocess.Popen(SLEEPER)
    try:
        started = psutil.Process(stranger.pid).create_time()
        table = tmp_path / "processes.json"
        table.write_text(json.dumps({"processes": [
            {"name": "trainer", "pid": stranger.pid, "pids": [stranger.pid], "create_times": [started - 30.0]}]}))
        nemesis = Nemesis(table, None, None)
        nemesis.run(Schedule(0, 5, ["kill"], 1, 1, [Fault(0, "kill", "trainer", 0.0, 0.0)]), time.time())
        (rec,) = nemesis.records
        assert rec.skipped and f"pid {stranger.pid}" in rec.detail, rec
        assert stranger.poll() is None  # untouched
        # the same row with the stranger's own start time is its incarnation: signalled
        table.write_text(json.dumps({"processes": [
            {"name": "trainer", "pid": stranger.pid, "pids": [stranger.pid], "create_times": [started]}]}))
        nemesis = Nemesis(table, None, None)
        nemesis.run(Schedule(0, 5, ["stop"], 1, 1, [Fault(0, "stop", "trainer", 0.0, 0.2)]), time.time())
        assert not nemesis.records[0].skipped and nemesis.records[0].pid == stranger.pid
        assert nemesis.records[0].healed_at is not None
    finally:
        if stranger.poll() is None:
            stranger.kill()
