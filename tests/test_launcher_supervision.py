"""The launcher with real child processes. Restart backoff: a process that crashes again and again waits
longer each time (up to 30 s); one that had run healthily before it exited is restarted after 1 s, so an old
crash loop (a worker that could not reach Temporal during an outage, say) never delays a later restart. And
no child outlives its launcher, even one killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from laminar.workers.launcher import MAX_BACKOFF_S, LocalLauncher, ManagedProcess
from tests.fixtures.waiting import wait_until

HEALTHY_S = 3.0


def _process(tmp_path: Path, name: str, code: str) -> ManagedProcess:
    return ManagedProcess(name, [sys.executable, "-c", code], dict(os.environ), tmp_path / f"{name}.log")


def test_backoff_starts_over_after_a_healthy_run(tmp_path):
    crashing = _process(tmp_path, "crashing", "raise SystemExit(1)")  # exits at once: well under HEALTHY_S
    healthy = _process(tmp_path, "healthy", f"import time; time.sleep({HEALTHY_S + 1}); raise SystemExit(1)")
    launcher = LocalLauncher([crashing, healthy], healthy_s=HEALTHY_S)
    for p in (crashing, healthy):
        p.restarts = 5  # both have crashed five times before this start
    launcher.start_all()
    try:
        # The supervisor notices each exit (it polls every 0.5 s; here at once) and schedules the restart.
        wait_until(lambda: crashing.proc.poll() is not None, 10, "the crashing process to exit")
        assert launcher.supervise() == []
        # 2**5 = 32 s, capped at MAX_BACKOFF_S = 30 s.
        assert crashing.restarts == 5 and MAX_BACKOFF_S - 1 < crashing.restart_at - time.monotonic() <= MAX_BACKOFF_S
        wait_until(lambda: healthy.proc.poll() is not None, 30, "the healthy process to exit")
        assert launcher.supervise() == []
        # It ran for HEALTHY_S + 1 s: the count starts over, 2**0 = 1 s.
        assert healthy.restarts == 0 and 0 < healthy.restart_at - time.monotonic() <= 1.0
        assert wait_until(lambda: launcher.supervise() == ["healthy"], 5, "the healthy process's restart")
        assert healthy.restarts == 1 and crashing.restarts == 5
    finally:
        launcher.stop_all(timeout_s=5)


LAUNCH_AND_WAIT = """
import os, sys, time
from pathlib import Path
from laminar.workers.launcher import LocalLauncher, ManagedProcess
child = ManagedProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(300)"], dict(os.environ),
                       Path(sys.argv[1]))
launcher = LocalLauncher([child])
launcher.start_all()
launcher.start_supervision()
print(f"child_pid={child.pid}", flush=True)
time.sleep(300)
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def test_children_die_with_a_killed_launcher(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", LAUNCH_AND_WAIT, str(tmp_path / "sleeper.log")],
                              stdout=subprocess.PIPE, text=True)
    child_pid = None
    try:
        child_pid = int(next(line for line in parent.stdout if line.startswith("child_pid=")).split("=")[1])
        assert not _gone(child_pid)
        os.kill(parent.pid, signal.SIGKILL)  # no handler, no finally: only the kernel can stop the child now
        parent.wait(timeout=10)
        wait_until(lambda: _gone(child_pid), 10, f"launcher child {child_pid} to exit after its launcher died")
    finally:
        if parent.poll() is None:
            parent.kill()
        if child_pid is not None and not _gone(child_pid):
            os.kill(child_pid, signal.SIGKILL)
