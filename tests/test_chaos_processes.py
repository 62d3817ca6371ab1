"""The chaos check `processes` identifies a process by its pid and its start time, with real processes: the
launcher's table records both for each incarnation, an incarnation that still runs is found, and a process that
has one of the table's pids but started at another time (the OS gave the pid to a later process) is neither a
leaked incarnation nor hidden from the strays."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from laminar.chaos.checker import check_processes
from laminar.chaos.command import incarnations, strays
from laminar.chaos.nemesis import alive
from laminar.workers.launcher import LocalLauncher, ManagedProcess, process_table

SLEEPER = "import time; time.sleep(60)"


@pytest.fixture
def sleeper(tmp_path):
    """A real process whose command line looks like a worker's (`laminar.cli.main worker`) of the LAMINAR_HOME tmp_path."""
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER, "laminar.cli.main", "worker"],
                            env={**os.environ, "LAMINAR_HOME": str(tmp_path)})
    yield proc
    proc.kill()
    proc.wait()


def test_the_launcher_table_records_each_incarnation_start_time(tmp_path):
    p = ManagedProcess(name="sleeper", argv=[sys.executable, "-c", SLEEPER], env=dict(os.environ),
                       log_path=tmp_path / "sleeper.log")
    launcher = LocalLauncher([p])
    launcher.start_all()
    try:
        (row,) = process_table([p])["processes"]
        assert row["pids"] == [p.proc.pid]
        assert row["create_times"] == [psutil.Process(p.proc.pid).create_time()]
        assert incarnations({"processes": [row]}) == {(p.proc.pid, row["create_times"][0])}
    finally:
        launcher.stop_all(timeout_s=5)


def test_a_reused_pid_is_not_the_incarnation(tmp_path, sleeper):
    started = psutil.Process(sleeper.pid).create_time()
    table = {"stopped": True, "processes": [{"name": "rollout-host-0", "pids": [sleeper.pid],
                                             "create_times": [started - 30.0]}]}  # the incarnation ran 30 s earlier
    known = incarnations(table)
    assert not alive(sleeper.pid, started - 30.0)  # the pid runs, but as another process: not leaked
    leaked = {pid for pid, created in known if alive(pid, created)}
    assert check_processes(table, leaked, []).ok
    assert strays(tmp_path, known) == [sleeper.pid]  # a worker of this home that is none of the incarnations


def test_an_incarnation_that_still_runs_is_leaked_and_a_dead_one_is_not(tmp_path, sleeper):
    table = {"stopped": True, "processes": [{"name": "rollout-host-0", "pids": [sleeper.pid],
                                             "create_times": [psutil.Process(sleeper.pid).create_time()]}]}
    known = incarnations(table)
    leaked = {pid for pid, created in known if alive(pid, created)}
    assert leaked == {sleeper.pid}
    check = check_processes(table, leaked, strays(tmp_path, known))
    assert not check.ok and f"rollout-host-0 (pid {sleeper.pid})" in check.detail and "outside" not in check.detail
    sleeper.kill()
    sleeper.wait()
    assert not alive(sleeper.pid, known.pop()[1])


def test_a_table_without_start_times_still_identifies_by_pid(tmp_path, sleeper):
    known = incarnations({"processes": [{"name": "x", "pids": [sleeper.pid]}]})  # written before create_times
    assert known == {(sleeper.pid, None)} and alive(sleeper.pid, None) and strays(tmp_path, known) == []
