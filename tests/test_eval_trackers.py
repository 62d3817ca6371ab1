"""services/tracking.py EvalTrackers: eval rounds that close out of order (2 after 4), and one recorded twice (a
retried record_eval), read back by TensorBoard's own reader and MLflow's client once each, in version order, in
tracker runs of their own (the trainer's are untouched)."""

from __future__ import annotations

import os
import time

import pytest

from laminar.config import RunConfig
from laminar.services.tracking import EVAL_MLFLOW_TAG, EvalTrackers, eval_scalars


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


def _mlflow_client(tmp_path):
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient, (tmp_path / "mlruns").resolve().as_uri()


def _active_eval_runs(client, run_id: str) -> list[str]:
    exp = client.get_experiment_by_name("laminar")
    return [r.info.run_id for r in client.search_runs([exp.experiment_id],
                                                      filter_string=f"tags.`{EVAL_MLFLOW_TAG}` = '{run_id}'")]


@pytest.mark.slow  # MLflow's import and file store: seconds
def test_two_control_workers_recording_at_once_share_one_mlflow_eval_run(tmp_path):
    """MLflow has no create-if-absent. Each interleaving of two processes that both find no eval run: the other's
    run created just before ours (ours is deleted, the other's kept), just after ours (ours kept), and four threads
    at once: every caller gets the same run, and one run stays."""
    import threading

    from laminar.services.tracking import mlflow_eval_run

    MlflowClient, uri = _mlflow_client(tmp_path)

    class OtherWorkerFirst(MlflowClient):  # the other process creates its run between our search and our create
        other: str | None = None

        def create_run(self, experiment_id, **kw):
            self.other = super().create_run(experiment_id, **kw).info.run_id
            time.sleep(0.01)  # a later start time for ours
            return super().create_run(experiment_id, **kw)

    first = OtherWorkerFirst(tracking_uri=uri)
    kept = mlflow_eval_run(first, "laminar", "a")
    assert [kept] == [first.other] == _active_eval_runs(first, "a")

    class OtherWorkerAfter(MlflowClient):  # the other process creates its run just after ours
        def create_run(self, experiment_id, **kw):
            ours = super().create_run(experiment_id, **kw)
            time.sleep(0.01)
            super().create_run(experiment_id, **kw)
            return ours

    after = OtherWorkerAfter(tracking_uri=uri)
    ours = mlflow_eval_run(after, "laminar", "b")
    assert ours == min((r.info.start_time, r.info.run_id) for r in after.search_runs(
        [after.get_experiment_by_name("laminar").experiment_id],
        filter_string=f"tags.`{EVAL_MLFLOW_TAG}` = 'b'"))[1]  # the other process deletes its own when it looks

    got: list[str] = []
    start = threading.Barrier(4)

    def record() -> None:
        start.wait()
        got.append(mlflow_eval_run(MlflowClient(tracking_uri=uri), "laminar", "c"))

    threads = [threading.Thread(target=record) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4 and set(got) == set(_active_eval_runs(MlflowClient(tracking_uri=uri), "c")), got
    assert len(set(got)) == 1
