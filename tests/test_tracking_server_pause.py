"""A real `mlflow server` stopped (SIGSTOP) for 60 s: the caller's steps go on (no log_step call waits on it), and
once it answers again every step reaches it (services/tracking_writer.py). `mlflow server` imports SQLAlchemy, Alembic, sqlparse and
aiohttp, which mlflow-skinny does not install: without them the test is skipped, saying so. Its job runner (huey, not
installed either) is turned off."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from laminar.config import RunConfig
from laminar.services.tracking import Trackers
from tests.fixtures.s3 import free_port
from tests.fixtures.waiting import wait_until

PAUSE_S = 60.0


def _work() -> None:
    """A stand-in for a training step's compute: torch matrix products, which release the interpreter lock as a
    trainer's do."""
    import torch

    a = torch.ones(384, 384)
    for _ in range(8):
        a = torch.mm(a, a) / 384


def _rate(t: Trackers, first: int, seconds: float) -> tuple[int, float, float]:
    """Steps for `seconds`: the next step, steps/s, and the longest log_step call (s)."""
    step, start, longest = first, time.perf_counter(), 0.0
    while time.perf_counter() - start < seconds:
        _work()
        called = time.perf_counter()
        t.log_step(step, {"train/reward_mean": float(step)})
        longest = max(longest, time.perf_counter() - called)
        step += 1
    return step, (step - first) / (time.perf_counter() - start), longest


@pytest.mark.slow  # the 60 s pause, plus the server's start
@pytest.mark.timeout(400)
def test_a_paused_mlflow_server_does_not_slow_the_steps(tmp_path: Path):
    missing = [m for m in ("sqlalchemy", "alembic", "sqlparse", "aiohttp") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"`mlflow server` needs {missing}, which mlflow-skinny does not install")
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                               f"sqlite:///{tmp_path / 'mlflow.db'}", "--default-artifact-root",
                               str(tmp_path / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
                               "--workers", "1"], stdout=open(tmp_path / "server.log", "wb"),
                              stderr=subprocess.STDOUT, env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            try:
                return urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200
            except OSError:
                return False

        wait_until(healthy, 120, "mlflow server to answer /health", interval_s=0.5)
        cfg = RunConfig.load(None, [f"tracking.dir={tmp_path}", "run.run_id=r-pause", "tracking.mlflow=true",
                                    f"tracking.mlflow_uri={uri}", "tracking.close_timeout_s=120"])
        t = Trackers("r-pause", cfg, tmp_path)
        step, before, _ = _rate(t, 1, 10.0)
        os.killpg(server.pid, signal.SIGSTOP)
        try:
            step, during, longest = _rate(t, step, PAUSE_S)
            assert t.stats()["mlflow"]["pending"] > 0, "the paused server held writes back"
        finally:
            os.killpg(server.pid, signal.SIGCONT)
        # the trainer's call never waits on the hung server; the rates are printed, not asserted: on a shared
        # machine they move with the other load more than with the server
        assert longest < 0.05, f"a log_step call took {longest:.3f} s while the server was stopped"
        print(f"steps/s before the pause {before:.1f}, during it {during:.1f}; longest call {longest * 1e3:.2f} ms")
        last = step - 1
        t.close(finished=True)
        assert t.skipped == {}, t.stats()

        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name("laminar")
        runs = client.search_runs([exp.experiment_id], filter_string="tags.`laminar.run_id` = 'r-pause'")
        assert len(runs) == 1
        steps = sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "train/reward_mean"))
        assert steps == list(range(1, last + 1)), (len(steps), last)
    finally:
        os.killpg(server.pid, signal.SIGCONT)
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
