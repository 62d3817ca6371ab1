"""Trackers on a real tmpfs that fills and is freed (services/tracking.py, services/tracking_writer.py): steps go on
being queued, MLflow's store stays readable and holds every step, TensorBoard's reader finds one event file with no
step twice, and the log holds one `tracker_write_failed` per tracker for the outage."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import structlog

from laminar.config import RunConfig
from laminar.services.tracking import Trackers
from tests.fixtures.waiting import wait_until

SIZE = "3m"


@pytest.fixture
def tmpfs(tmp_path: Path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def _fill(directory: Path) -> Path:
    """Fill the filesystem to its last byte with one file (unbuffered writes, smaller as they fail)."""
    ballast = directory / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for size in (65536, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return ballast


@pytest.mark.timeout(180)
def test_a_disk_that_fills_and_frees_leaves_readable_trackers_with_every_step(tmpfs):
    cfg = RunConfig.load(None, [f"tracking.dir={tmpfs}", "run.run_id=r-full", "tracking.tensorboard=true",
                                "tracking.mlflow=true", "tracking.retry_max_s=0.5"])
    t = Trackers("r-full", cfg, tmpfs)
    scalars = {f"train/m{i}": 0.0 for i in range(12)}
    with structlog.testing.capture_logs() as logs:
        for step in range(1, 21):
            t.log_step(step, {**scalars, "train/reward_mean": float(step)})
        wait_until(lambda: all(s["written"] == 20 for s in t.stats().values()), 60, "20 steps before the disk fills")
        ballast = _fill(tmpfs)
        step = 20

        def one_more_step_then_both_failing() -> bool:
            # MLflow's small metric files take appends into their last page until it is full: keep stepping
            nonlocal step
            step += 1
            t.log_step(step, {**scalars, "train/reward_mean": float(step)})
            return all(s["failing"] for s in t.stats().values())

        wait_until(one_more_step_then_both_failing, 120, "both trackers to fail on the full disk")
        ballast.unlink()  # space returns
        freed_at, last = step + 1, step + 40
        for after in range(freed_at, last + 1):
            t.log_step(after, {**scalars, "train/reward_mean": float(after)})
        t.close(finished=True)
    stats = t.stats()
    assert t.skipped == {}, stats
    assert all(s["missing_steps"] == "" and s["outages"] == 1 for s in stats.values()), stats
    failed = [e for e in logs if e["event"] == "tracker_write_failed"]
    assert sorted(e["tracker"] for e in failed) == ["mlflow", "tensorboard"], failed  # one per tracker
    assert all(e["errno"] == "ENOSPC" for e in failed), failed

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmpfs / "mlruns").as_uri())
    exp = client.get_experiment_by_name("laminar")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`laminar.run_id` = 'r-full'")
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(runs[0].info.run_id, "train/reward_mean"))
    assert steps == list(range(1, last + 1)), steps  # missed points written once the space returned, none twice

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_dir = tmpfs / "tensorboard" / "r-full"
    assert len(list(tb_dir.glob("events.out.tfevents.*"))) == 1
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    tb = [(e.step, e.value) for e in acc.Scalars("train/reward_mean")]
    assert [s for s, _ in tb] == list(range(1, last + 1)), [s for s, _ in tb]
    assert all(v == float(s) for s, v in tb)
