"""A notice that reaches a worker before it serves (it is still importing or connecting: a preemption right after a
restart, as the 30-minute chaos run's seed 2 had) ends it with exit 0, like a notice once serving. A real worker
process, connecting to a listener that never answers, gets SIGTERM by pid."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_notice_while_the_worker_connects_exits_0(tmp_path, sig):
    with socket.socket() as hole:  # accepts the worker's connection and never speaks gRPC
        hole.bind(("127.0.0.1", 0))
        hole.listen()
        env = {**os.environ, "LAMINAR_HOME": str(tmp_path), "LAMINAR_LOG_FORMAT": "json",
               "LAMINAR_TEMPORAL_ADDRESS": f"127.0.0.1:{hole.getsockname()[1]}"}
        proc = subprocess.Popen([sys.executable, "-m", "laminar.cli.main", "worker", "control"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            hole.settimeout(120)
            conn, _ = hole.accept()  # the worker is past its imports and connecting
            time.sleep(0.2)
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=60)
            conn.close()
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, (proc.returncode, err[-2000:])
    assert f"notice ({sig.name}) before the worker serves" in err
