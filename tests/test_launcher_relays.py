"""LocalLauncher.match_relays (`laminar scale --relays M`) with real child processes: a new host's relay starts
with host-0's argv and settings and its own LAMINAR_HOST_ID; a host beyond M has its relay and rollout workers
given the notice (SIGTERM; they exit 0 here), and they are never restarted."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from laminar.workers.launcher import LocalLauncher, ManagedProcess
from tests.fixtures.waiting import wait_until

# A worker stand-in: says which host it serves, and on SIGTERM (the notice) says so and exits 0.
WORKER = ("import os, signal, sys, time\n"
          "def notice(*_):\n"
          "    print('notice', flush=True); sys.exit(0)\n"
          "signal.signal(signal.SIGTERM, notice)\n"
          "print('host', os.environ['LAMINAR_HOST_ID'], flush=True)\n"
          "while True: time.sleep(0.1)\n")


def _proc(tmp_path: Path, name: str, host: str, role: str) -> ManagedProcess:
    return ManagedProcess(name, [sys.executable, "-c", WORKER, role], {**os.environ, "LAMINAR_HOST_ID": host},
                          tmp_path / f"{name}.log")


def _says(p: ManagedProcess, line: str) -> bool:
    return p.log_path.exists() and line in p.log_path.read_text().splitlines()


def test_match_relays_starts_new_hosts_and_retires_gone_ones(tmp_path):
    procs = [_proc(tmp_path, "relay-host-0", "host-0", "relay"), _proc(tmp_path, "rollout-host-0", "host-0", "rollout"),
             _proc(tmp_path, "relay-host-1", "host-1", "relay"), _proc(tmp_path, "rollout-host-1", "host-1", "rollout")]
    launcher = LocalLauncher(procs)
    launcher.start_all()
    try:
        with pytest.raises(ValueError, match=r"relays=0: a run needs at least one relay"):
            launcher.match_relays(0)
        # 2 -> 3 hosts: host-2's relay, with host-0's argv and host-2 as its host.
        assert launcher.match_relays(3) == (["relay-host-2"], [])
        new = launcher.processes["relay-host-2"]
        assert new.argv == procs[0].argv and new.env["LAMINAR_HOST_ID"] == "host-2"
        wait_until(lambda: _says(new, "host host-2"), 20, "host-2's relay to start")
        assert launcher.match_relays(3) == ([], [])  # nothing to do
        # 3 -> 1 host: host-1's and host-2's workers get the notice, exit 0, and are no longer supervised.
        started, stopped = launcher.match_relays(1, notice_s=10)
        assert (started, sorted(stopped)) == ([], ["relay-host-1", "relay-host-2", "rollout-host-1"])
        gone = [procs[2], procs[3], new]
        wait_until(lambda: all(p.proc.poll() is not None for p in gone), 20, "the retired workers to exit")
        assert [p.proc.returncode for p in gone] == [0, 0, 0]
        assert all(_says(p, "notice") for p in gone)
        assert sorted(launcher.processes) == ["relay-host-0", "rollout-host-0"]  # no longer supervised
        assert all(p.proc.poll() is None for p in procs[:2])  # host-0 untouched
    finally:
        launcher.stop_all(timeout_s=5)
