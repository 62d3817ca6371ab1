"""services/tracking.py EvalTrackers: eval rounds that close out of order (2 after 4), and one recorded twice (a
retried record_eval), read back by TensorBoard's own reader and MLflow's client once each, in version order, in
tracker runs of their own (the trainer's are untouched)."""

from __future__ import annotations

import os

import pytest

from laminar.config import RunConfig
from services.tracking import EVAL_MLFLOW_TAG, EvalTrackers, eval_scalars


@pytest.mark.slow  # ~20 s on a loaded machine, most of it importing MLflow
def test_eval_rounds_out_of_order_read_back_once_each(tmp_path):
    cfg = RunConfig.load(None, [f"tracking.dir={tmp_path}", "tracking.tensorboard=true", "tracking.mlflow=true"])
    records = {v: {"accuracy": a, "accuracy_stderr": 0.05, "pass_at_k": a, "mean_at_k": a, "mean_reward": a,
                   "response_len_mean": 5.0, "failures": 0, "prompts": 36} for v, a in ((0, 0.25), (4, 0.5), (2, 0.4))}
    trackers, series = EvalTrackers("r1", cfg, tmp_path), {}
    for v in (0, 4, 2, 2):  # closed out of order; version 2 recorded twice
        series[v] = eval_scalars(records[v])
        trackers.log(v, dict(series))
    assert trackers.skipped == {}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard" / "r1" / "eval"))
    acc.Reload()
    assert [(e.step, round(e.value, 3)) for e in acc.Scalars("eval/accuracy")] == [(0, 0.25), (2, 0.4), (4, 0.5)]
    assert len(list((tmp_path / "tensorboard" / "r1" / "eval").glob("events.out.tfevents.*"))) == 1

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    ml = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    exp = ml.get_experiment_by_name("laminar")
    runs = ml.search_runs([exp.experiment_id], filter_string=f"tags.`{EVAL_MLFLOW_TAG}` = 'r1'")
    assert len(runs) == 1
    history = sorted((m.step, m.value) for m in ml.get_metric_history(runs[0].info.run_id, "eval/accuracy"))
    assert history == [(0, 0.25), (2, 0.4), (4, 0.5)]
    # the trainer's search for its own run (tag laminar.run_id) does not find the eval run
    assert ml.search_runs([exp.experiment_id], filter_string="tags.`laminar.run_id` = 'r1'") == []


@pytest.mark.slow  # wandb starts its service process for each round (seconds)
def test_eval_rounds_go_to_a_wandb_run_of_their_own_once_each(tmp_path):
    cfg = RunConfig.load(None, [f"tracking.dir={tmp_path}", "tracking.wandb=true"])
    trackers = EvalTrackers("r2", cfg, tmp_path)
    series = {}
    for v, a in ((0, 0.25), (4, 0.5), (2, 0.4), (2, 0.4)):  # out of order; version 2 recorded twice
        series[v] = eval_scalars({"accuracy": a, "accuracy_stderr": 0.05, "pass_at_k": a, "mean_at_k": a,
                                  "mean_reward": a, "response_len_mean": 5.0, "failures": 0, "prompts": 36})
        trackers.log(v, dict(series))
    assert trackers.skipped == {}
    runs = list((tmp_path / "wandb" / "wandb").glob("offline-run-*-r2-eval"))
    assert runs and all(list(r.glob("run-r2-eval.wandb")) for r in runs), list((tmp_path / "wandb").rglob("*"))
    assert (tmp_path / "wandb" / "r2-eval.versions.json").read_text() == "[0, 2, 4]"
    assert not list((tmp_path / "wandb" / "wandb").glob("offline-run-*-r2"))  # the trainer's run is not touched
