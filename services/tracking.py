"""Experiment trackers (TensorBoard, MLflow, wandb offline), written through their own libraries by one process:
the trainer (docs/evaluation.md 'Trackers').

Invariants (tests/test_tracking.py, tests/test_tracking_integration.py):
- One tracker run per run id: TensorBoard's directory <dir>/tensorboard/<run id>, the MLflow run tagged
  `laminar.run_id=<run id>` (found and resumed, never created twice), wandb's run id = the run id (resume "allow").
- A step is read back once. Every writer of a run is a trainer process at a step the workflow asked for, one at a
  time; a new process, or a process that rewound to a checkpoint, writes steps it (or its predecessor) may have
  written already. Before the first write of a process and before any step at or below the last one it wrote,
  `resume_at(step)` tells every tracker that steps >= step are written again:
  TensorBoard gets a SessionLog START event at that step, on which its reader (EventAccumulator) drops what it
  read at and after that step, so the rewritten step wins; MLflow, whose stores only append, skips steps at or
  below the last one its run holds (read back when the run is resumed), so the first write of a step stands;
  wandb drops steps below its current one itself.
- A tracker that fails never stops training: the call is dropped, counted per tracker in `skipped` (the trainer
  writes the counts into each step's record), logged as `tracker_write_failed`, and the tracker is opened again at
  the next call.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Protocol

from laminar.config import RunConfig
from laminar.logs import get_logger

log = get_logger(__name__)

MLFLOW_PARAM_CHARS = 6000  # MLflow refuses a longer param value
RESUME_KEY = "train/reward_mean"  # the MLflow metric whose history says how far a resumed run got


def tracker_dir(cfg: RunConfig, home: Path) -> Path:
    """tracking.dir, or <home>/tracking."""
    return Path(cfg.tracking.dir) if cfg.tracking.dir else home / "tracking"


def enabled(cfg: RunConfig) -> list[str]:
    t = cfg.tracking
    return [name for name, on in (("tensorboard", t.tensorboard), ("mlflow", t.mlflow), ("wandb", t.wandb)) if on]


def step_scalars(record: dict[str, Any]) -> dict[str, float]:
    """A trainer step's record (services/trainer.py _write_metrics) as tracker scalars, `train/<name>`: reward, loss,
    KL to the behaviour policy, entropy, staleness (mean and max, in versions), tokens/s of the step, the trainer's
    wait before it and its stall to publish (s).
    Worked example: staleness {"0": 6, "2": 2} -> mean (0*6 + 2*2) / 8 = 0.5, max 2."""
    out: dict[str, float] = {}
    for key in ("reward_mean", "loss", "grad_norm", "kl_behaviour", "entropy", "clip_fraction",
                "response_len_mean", "samples", "tokens", "dropped_stale", "consumed_twice", "wait_s", "busy_s",
                "stall_s"):
        value = record.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[f"train/{key}"] = float(value)
    hist = {int(k): int(v) for k, v in (record.get("staleness") or {}).items()}
    if hist and sum(hist.values()):
        n = sum(hist.values())
        out["train/staleness_mean"] = sum(k * v for k, v in hist.items()) / n
        out["train/staleness_max"] = float(max(k for k, v in hist.items() if v))
    busy = record.get("busy_s")
    if isinstance(busy, int | float) and busy > 0:
        out["train/tokens_per_s"] = float(record.get("tokens", 0)) / busy
    return out


def config_params(config: dict[str, Any]) -> dict[str, str]:
    """The run config as `section.key` -> text (a tracker's parameters)."""
    out = {}
    for section, fields in config.items():
        for key, value in (fields.items() if isinstance(fields, dict) else [("", fields)]):
            out[f"{section}.{key}" if key else section] = str(value)[:MLFLOW_PARAM_CHARS]
    return out


class Tracker(Protocol):
    """One tracker library's run for one run id."""

    name: str

    def resume_at(self, step: int) -> None: ...  # steps >= step are about to be written (again)
    def log(self, step: int, scalars: dict[str, float]) -> None: ...
    def event(self, step: int, kind: str, detail: str) -> None: ...  # a fault or recovery
    def close(self, finished: bool) -> None: ...


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, directory: Path, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(directory), flush_secs=5)
        self._config = config

    def resume_at(self, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        # TensorBoard's own restart marker: its reader purges every event at or after `step` read so far
        self.writer.file_writer.add_event(Event(session_log=SessionLog(status=SessionLog.START)), step=step)
        if step <= 1:
            import json

            self.writer.add_text("config", f"```\n{json.dumps(self._config, indent=1)}\n```", global_step=step)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def event(self, step: int, kind: str, detail: str) -> None:
        self.writer.add_text(f"events/{kind}", detail, global_step=step)
        self.writer.add_scalar(f"events/{kind}", 1.0, global_step=step)
        self.writer.flush()

    def close(self, finished: bool) -> None:
        self.writer.close()


def mlflow_eval_run(client: Any, experiment: str, run_id: str) -> str:
    """The one MLflow run (tagged EVAL_MLFLOW_TAG = run_id) that holds a run's eval rounds. Two control workers can
    record rounds at once, and MLflow has no create-if-absent: each creates one if it finds none, then searches
    again and keeps the oldest (start time, then id: the same choice in every process), deleting the one it made
    if that is not it. Whatever the interleaving, every process logs into the same run."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        try:
            client.create_experiment(experiment)
        except Exception:  # another process created it first: it exists now
            pass
        exp = client.get_experiment_by_name(experiment)
    query = f"tags.`{EVAL_MLFLOW_TAG}` = '{run_id}'"

    def oldest() -> str | None:
        runs = client.search_runs([exp.experiment_id], filter_string=query, max_results=100)
        return min(((r.info.start_time, r.info.run_id) for r in runs), default=(0, None))[1]

    found = oldest()
    if found is not None:
        return found
    made = client.create_run(exp.experiment_id, run_name=f"{run_id}-eval", tags={EVAL_MLFLOW_TAG: run_id}).info.run_id
    kept = oldest() or made
    if kept != made:
        client.delete_run(made)  # another process's run came first; nothing was logged into this one
    return kept


class MlflowTracker:
    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_id: str, config: dict[str, Any]) -> None:
        if uri.startswith("file:"):
            # the file store is in maintenance mode in MLflow 3 and refuses to open without this opt-out
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(experiment)
        found = self.client.search_runs([exp_id], filter_string=f"tags.`laminar.run_id` = '{run_id}'",
                                        max_results=1)
        if found:  # resumed: the steps it holds stand
            self.run = found[0].info.run_id
            history = self.client.get_metric_history(self.run, RESUME_KEY)
            self.logged_through = max((m.step for m in history), default=0)
            if found[0].info.status != "RUNNING":
                self.client.update_run(self.run, status="RUNNING")
        else:
            self.run = self.client.create_run(exp_id, run_name=run_id, tags={"laminar.run_id": run_id}).info.run_id
            self.logged_through = 0
            from mlflow.entities import Param

            params = [Param(k, v) for k, v in config_params(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                self.client.log_batch(self.run, params=params[i:i + 100])

    def resume_at(self, step: int) -> None:
        """MLflow appends; a step it already holds is skipped in `log` instead."""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if step <= self.logged_through:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run, metrics=[Metric(k, v, now, step) for k, v in scalars.items()])
        self.logged_through = step

    def event(self, step: int, kind: str, detail: str) -> None:
        self.client.set_tag(self.run, f"laminar.event.{kind}.step{step}", detail[:5000])

    def close(self, finished: bool) -> None:
        if finished:
            self.client.set_terminated(self.run, status="FINISHED")


class WandbTracker:
    name = "wandb"

    def __init__(self, directory: Path, experiment: str, run_id: str, config: dict[str, Any]) -> None:
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(mode="offline", dir=str(directory), project=experiment, id=run_id, resume="allow",
                              config=config, reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))

    def resume_at(self, step: int) -> None:
        """wandb drops a step below its current one itself."""

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def event(self, step: int, kind: str, detail: str) -> None:
        self.run.log({f"events/{kind}": 1.0}, step=step)

    def close(self, finished: bool) -> None:
        self.run.finish()


class Trackers:
    """Every tracker the run's config asks for, for one run id; failures are counted, never raised."""

    def __init__(self, run_id: str, cfg: RunConfig, home: Path) -> None:
        self.run_id, self.cfg = run_id, cfg
        self.dir = tracker_dir(cfg, home)
        self.wanted = enabled(cfg)
        self.open: dict[str, Tracker] = {}
        self.skipped: dict[str, int] = {}  # tracker -> calls dropped because it failed
        self.last_step = -1  # the highest step this process wrote; -1: none yet (the next write is a resume)
        self.marked: set[str] = set()  # trackers told where this process resumes

    def _make(self, name: str) -> Tracker:
        config = self.cfg.to_json()
        if name == "tensorboard":
            return TensorBoardTracker(self.dir / "tensorboard" / self.run_id, config)
        if name == "mlflow":
            uri = self.cfg.tracking.mlflow_uri or (self.dir / "mlruns").resolve().as_uri()
            return MlflowTracker(uri, self.cfg.tracking.experiment, self.run_id, config)
        return WandbTracker(self.dir / "wandb", self.cfg.tracking.experiment, self.run_id, config)

    def _each(self, what: str, call) -> None:
        for name in self.wanted:
            try:
                tracker = self.open.get(name)
                if tracker is None:
                    tracker = self.open[name] = self._make(name)
                call(tracker)
            except Exception as e:  # a tracker never stops training: drop, count, say so
                self.skipped[name] = self.skipped.get(name, 0) + 1
                self.open.pop(name, None)
                self.marked.discard(name)
                log.warning("tracker_write_failed", tracker=name, run_id=self.run_id, what=what,
                            skipped=self.skipped[name], error=f"{type(e).__name__}: {e}"[:300])

    def log_step(self, step: int, scalars: dict[str, float]) -> None:
        """Write one step's scalars; a first write, or a step at or below the last written, is a resume."""
        if step <= self.last_step:
            self.marked.clear()

        def write(t: Tracker) -> None:
            if t.name not in self.marked:
                t.resume_at(step)
                self.marked.add(t.name)
            t.log(step, scalars)

        self._each(f"step {step}", write)
        self.last_step = step

    def log_event(self, step: int, kind: str, detail: str) -> None:
        self._each(f"event {kind}", lambda t: t.event(step, kind, detail))

    def close(self, finished: bool) -> None:
        for name, tracker in list(self.open.items()):
            try:
                tracker.close(finished)
            except Exception as e:
                log.warning("tracker_close_failed", tracker=name, run_id=self.run_id, error=str(e)[:300])
        self.open.clear()
        self.marked.clear()


# -- held-out eval rounds during training -------------------------------------------------------------------------

EVAL_MLFLOW_TAG = "laminar.eval_of"  # the MLflow run of a run's evals is tagged with the run id under this key


def eval_scalars(record: dict[str, Any]) -> dict[str, float]:
    """An eval record's figures (services/eval_records.py) as tracker scalars, `eval/<name>`."""
    return {f"eval/{k}": float(record[k]) for k in ("accuracy", "accuracy_stderr", "pass_at_k", "mean_at_k",
                                                     "mean_reward", "response_len_mean", "failures", "prompts")
            if isinstance(record.get(k), int | float)}


class EvalTrackers:
    """A run's eval rounds, at their policy versions, written by the one writer of eval records (the control worker's
    record_eval, activities/evaluation.py); never by the trainer, so the trainer's tracker runs and their resume
    rules are untouched:
    - TensorBoard: one event file under <dir>/tensorboard/<run id>/eval (TensorBoard shows the run `<run id>/eval`;
      the trainer's reader of <run id> does not read it), through tensorboard's own event writer (no torch). Rounds
      close in any order, and TensorBoard's reader drops what it read at and after a step that goes back, so each
      record rewrites the whole series in version order (from the run's records) and removes the file before;
    - MLflow: one MLflow run per run id tagged `laminar.eval_of=<run id>`, found or created; a version it holds
      already (a retried activity) is not written again; MLflow keeps steps in any order;
    - wandb: an offline run of its own, id `<run id>-eval` (an offline run takes one writer, and the trainer is the
      run's), each round logged with `policy_version` as its x axis (rounds close in any order); the versions it
      holds are listed beside it (`<run id>-eval.versions.json`), so a retried activity does not log one again.
    A tracker that fails is logged and counted in `skipped`; the record is stored regardless."""

    def __init__(self, run_id: str, cfg: RunConfig, home: Path) -> None:
        self.run_id, self.cfg, self.dir = run_id, cfg, tracker_dir(cfg, home)
        self.skipped: dict[str, int] = {}

    def log(self, policy_version: int, series: dict[int, dict[str, float]]) -> None:
        """The round of `policy_version` is recorded; `series`: every recorded round's scalars, by version."""
        t = self.cfg.tracking
        for name, on, write in (("tensorboard", t.tensorboard, lambda: self._tensorboard(series)),
                                ("mlflow", t.mlflow, lambda: self._mlflow(policy_version, series[policy_version])),
                                ("wandb", t.wandb, lambda: self._wandb(policy_version, series[policy_version]))):
            if not on:
                continue
            try:
                write()
            except Exception as e:  # a tracker never fails the record
                self.skipped[name] = self.skipped.get(name, 0) + 1
                log.warning("tracker_write_failed", tracker=name, run_id=self.run_id, what=f"eval {policy_version}",
                            error=f"{type(e).__name__}: {e}"[:300])

    def _tensorboard(self, series: dict[int, dict[str, float]]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        directory = self.dir / "tensorboard" / self.run_id / "eval"
        suffix = f".eval-{time.time_ns()}"
        writer = EventFileWriter(str(directory), filename_suffix=suffix)
        try:
            for version, scalars in sorted(series.items()):
                values = [Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
                writer.add_event(Event(wall_time=time.time(), step=version, summary=Summary(value=values)))
        finally:
            writer.close()
        for old in directory.glob("events.out.tfevents.*"):
            if not old.name.endswith(suffix):
                old.unlink(missing_ok=True)

    def _wandb(self, policy_version: int, scalars: dict[str, float]) -> None:
        directory = self.dir / "wandb"
        directory.mkdir(parents=True, exist_ok=True)
        listed = directory / f"{self.run_id}-eval.versions.json"
        done = json.loads(listed.read_text()) if listed.exists() else []
        if policy_version in done:
            return
        import wandb

        run = wandb.init(mode="offline", dir=str(directory), project=self.cfg.tracking.experiment,
                         id=f"{self.run_id}-eval", resume="allow", group=self.run_id, job_type="eval",
                         reinit="create_new", settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))
        try:
            run.define_metric("policy_version")
            run.define_metric("eval/*", step_metric="policy_version")
            run.log({**scalars, "policy_version": policy_version})
        finally:
            run.finish()
        listed.write_text(json.dumps(sorted([*done, policy_version])))

    def _mlflow(self, policy_version: int, scalars: dict[str, float]) -> None:
        uri = self.cfg.tracking.mlflow_uri or (self.dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        run = mlflow_eval_run(client, self.cfg.tracking.experiment, self.run_id)
        if any(m.step == policy_version for m in client.get_metric_history(run, "eval/accuracy")):
            return
        now = int(time.time() * 1000)
        client.log_batch(run, metrics=[Metric(k, v, now, policy_version) for k, v in scalars.items()])
