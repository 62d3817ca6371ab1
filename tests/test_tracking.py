"""Experiment trackers through their own libraries, read back with their own readers (services/tracking.py):
one tracker run per run id, a step rewritten after a restore read back once, a failing tracker counted and never
raised."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from laminar.config import RunConfig
from laminar.services.tracking import Trackers, config_params, step_scalars
from tests.fixtures.waiting import wait_until


def _cfg(tmp_path: Path, *extra: str) -> RunConfig:
    return RunConfig.load(None, [f"tracking.dir={tmp_path}", "run.run_id=r-track", *extra])


def _tb_scalars(directory: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def _mlflow_history(tmp_path: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("laminar")
    runs = client.search_runs([exp.experiment_id], filter_string=f"tags.`laminar.run_id` = '{run_id}'")
    assert len(runs) == 1, f"one MLflow run per run id, found {len(runs)}"
    return sorted((m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, key))


def test_step_scalars_worked_example():
    record = {"reward_mean": 0.5, "loss": 0.1, "staleness": {"0": 6, "2": 2}, "tokens": 400, "busy_s": 2.0,
              "wait_s": 0.25, "entropy": 1.5, "kl_behaviour": 0.01, "groups": {"g1": [0]}}
    s = step_scalars(record)
    # staleness mean (0*6 + 2*2) / 8 = 0.5, max 2; tokens/s 400 / 2.0 = 200
    assert s["train/staleness_mean"] == 0.5 and s["train/staleness_max"] == 2.0
    assert s["train/tokens_per_s"] == 200.0
    assert s["train/reward_mean"] == 0.5 and s["train/wait_s"] == 0.25 and s["train/entropy"] == 1.5
    assert "train/groups" not in s


def test_config_params_are_section_keys():
    params = config_params(RunConfig().to_json())
    assert params["trainer.lr"] == "0.002" and params["tracking.tensorboard"] == "False"


def test_a_restarted_writer_rewrites_steps_and_each_is_read_back_once(tmp_path):
    cfg = _cfg(tmp_path, "tracking.tensorboard=true", "tracking.mlflow=true")
    first = Trackers("r-track", cfg, tmp_path)
    for step in range(1, 6):
        first.log_step(step, {"train/reward_mean": float(step)})
    wait_until(lambda: all(s["written"] == 5 for s in first.stats().values()), 60, "the first writer's 5 steps")
    # the process dies without closing; its successor restored the checkpoint at step 3 and writes 4.. again
    second = Trackers("r-track", cfg, tmp_path)
    for step in range(4, 8):
        second.log_step(step, {"train/reward_mean": 10.0 * step})
    second.close(finished=True)
    tb = _tb_scalars(tmp_path / "tensorboard" / "r-track", "train/reward_mean")
    # TensorBoard: the rewritten steps win (4 -> 40, 5 -> 50); MLflow: the first write of a step stands
    assert tb == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0), (7, 70.0)]
    ml = _mlflow_history(tmp_path, "r-track", "train/reward_mean")
    assert ml == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0), (6, 60.0), (7, 70.0)]
    assert first.skipped == {} and second.skipped == {}


def test_a_rewind_in_the_same_process_rewrites_the_step(tmp_path):
    cfg = _cfg(tmp_path, "tracking.tensorboard=true")
    t = Trackers("r-track", cfg, tmp_path)
    for step, value in [(1, 1.0), (2, 2.0), (3, 3.0), (2, 20.0), (3, 30.0)]:
        t.log_step(step, {"train/reward_mean": value})
    t.close(finished=False)
    assert _tb_scalars(tmp_path / "tensorboard" / "r-track", "train/reward_mean") == [(1, 1.0), (2, 20.0), (3, 30.0)]


def test_a_failing_tracker_is_counted_and_the_others_still_write(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where MLflow wants a directory")
    cfg = _cfg(tmp_path, "tracking.tensorboard=true", "tracking.mlflow=true",
               f"tracking.mlflow_uri={(blocker / 'mlruns').as_uri()}")
    t = Trackers("r-track", cfg, tmp_path)
    for step in (1, 2, 3):
        t.log_step(step, {"train/reward_mean": float(step)})  # never raises
    t.close(finished=True)
    assert t.skipped == {"mlflow": 3}
    assert [s for s, _ in _tb_scalars(tmp_path / "tensorboard" / "r-track", "train/reward_mean")] == [1, 2, 3]


def test_no_tracker_asked_writes_nothing(tmp_path):
    t = Trackers("r-track", _cfg(tmp_path), tmp_path)
    t.log_step(1, {"train/reward_mean": 1.0})
    assert t.wanted == [] and not any(tmp_path.iterdir())


@pytest.mark.timeout(120)
def test_wandb_writes_an_offline_run_directory(tmp_path):
    cfg = _cfg(tmp_path, "tracking.wandb=true")
    t = Trackers("r-track", cfg, tmp_path)
    for step in (1, 2):
        t.log_step(step, {"train/reward_mean": float(step)})
    t.close(finished=True)
    assert t.skipped == {}
    runs = list((tmp_path / "wandb" / "wandb").glob("offline-run-*-r-track"))
    assert len(runs) == 1 and list(runs[0].glob("run-r-track.wandb")), list((tmp_path / "wandb").rglob("*"))


def test_a_write_after_close_opens_the_tracker_again(tmp_path):
    cfg = _cfg(tmp_path, "tracking.tensorboard=true")
    t = Trackers("r-track", cfg, tmp_path)
    for step in (1, 2):
        t.log_step(step, {"train/reward_mean": float(step)})
    t.close(finished=True)
    t.log_step(2, {"train/reward_mean": 20.0})  # a rewind after the run's last step: a resume at step 2
    t.log_step(3, {"train/reward_mean": 30.0})
    t.close(finished=True)
    assert t.skipped == {}
    assert _tb_scalars(tmp_path / "tensorboard" / "r-track", "train/reward_mean") == [(1, 1.0), (2, 20.0), (3, 30.0)]
