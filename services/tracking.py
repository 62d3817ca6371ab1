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
- Off the trainer's path: each tracker has one writer thread and a bounded queue for the life of the Trackers
  (services/tracking_writer.py); a failure is retried with back-off, what was missed is written once the tracker
  answers, and one warning is logged per outage. Calls dropped (a full queue) or given up are counted per tracker
  in `skipped` (the trainer writes the counts into each step's record) and their steps listed in `stats()`.
- A failed write leaves no torn record: TensorBoard's records and MLflow file-store batches are whole or not at all
  (docs/decisions/trackers-full-disk.md).
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse
from urllib.request import url2pathname

from laminar.config import RunConfig
from laminar.logs import get_logger
from laminar.services.tracking_writer import Item, TrackerWriter

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
    def log(self, step: int, scalars: dict[str, float], time_ms: int) -> None: ...
    def event(self, step: int, kind: str, detail: str, time_ms: int) -> None: ...  # a fault or recovery
    def close(self, finished: bool) -> None: ...


class TensorBoardTracker:
    """One event file for the life of the writer, written record by record, each whole or not at all: a write cut
    off (a full disk) is truncated back, so the file never holds a torn record, on which TensorBoard's reader would
    stop reading the file."""

    name = "tensorboard"

    def __init__(self, directory: Path, config: dict[str, Any]) -> None:
        import socket

        from tensorboard.compat.proto.event_pb2 import Event

        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.{time.time_ns()}"
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._config = config
        self._versioned = False
        self._version_event = Event(wall_time=time.time(), file_version="brain.Event:2")

    def _write(self, *events: Any) -> None:
        """Append the events' records in one piece, or nothing (truncated back on a failure)."""
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

        records = []
        for event in ((self._version_event, *events) if not self._versioned else events):
            data = event.SerializeToString()
            header = struct.pack("<Q", len(data))
            records.append(header + struct.pack("<I", masked_crc32c(header)) + data
                           + struct.pack("<I", masked_crc32c(data)))
        blob = memoryview(b"".join(records))
        before = os.fstat(self.fd).st_size
        try:
            while blob:
                blob = blob[os.write(self.fd, blob):]
        except BaseException:
            os.ftruncate(self.fd, before)
            raise
        self._versioned = True

    def resume_at(self, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        # TensorBoard's own restart marker: its reader purges every event at or after `step` read so far
        events = [Event(wall_time=time.time(), step=step, session_log=SessionLog(status=SessionLog.START))]
        if step <= 1:
            events.append(self._text(step, "config", f"```\n{json.dumps(self._config, indent=1)}\n```"))
        self._write(*events)

    @staticmethod
    def _text(step: int, tag: str, text: str) -> Any:
        from tensorboard.compat.proto.event_pb2 import Event
        from torch.utils.tensorboard.summary import text as text_summary

        return Event(wall_time=time.time(), step=step, summary=text_summary(tag, text))

    def log(self, step: int, scalars: dict[str, float], time_ms: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
        self._write(Event(wall_time=time_ms / 1000, step=step, summary=Summary(value=values)))

    def event(self, step: int, kind: str, detail: str, time_ms: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        flag = Summary(value=[Summary.Value(tag=f"events/{kind}", simple_value=1.0)])
        self._write(self._text(step, f"events/{kind}", detail), Event(wall_time=time_ms / 1000, step=step,
                                                                       summary=flag))

    def close(self, finished: bool) -> None:
        os.close(self.fd)


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


def mlflow_bad_lines(run_dir: Path) -> list[tuple[Path, int]]:
    """The metric files of an MLflow file-store run that MLflow cannot parse, with the first bad line (1-based; 0:
    an empty file): MLflow reads `timestamp value [step [dataset digest]]` per line and refuses the whole run
    otherwise."""
    bad = []
    for path in sorted((run_dir / "metrics").rglob("*")):
        if not path.is_file():
            continue
        lines = path.read_text(errors="replace").splitlines()
        if not lines:
            bad.append((path, 0))
        for n, line in enumerate(lines, start=1):
            parts = line.strip().split(" ")
            try:
                ok = len(parts) in (2, 3, 5)
                int(parts[0]), float(parts[1]), int(parts[2]) if len(parts) >= 3 else 0
            except (ValueError, IndexError):
                ok = False
            if not ok:
                bad.append((path, n))
                break
    return bad


def _last_step(path: Path) -> int:
    """The highest step among a file-store metric file's lines that parse (0 if none)."""
    steps = [0]
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            parts = line.strip().split(" ")
            if len(parts) in (3, 5) and parts[2].lstrip("-").isdigit():
                steps.append(int(parts[2]))
    return max(steps)


class MlflowTracker:
    """One MLflow run per run id. On a file store, each batch is whole or not at all: MLflow appends a line per
    metric with a buffered write, and a write cut off by a full disk leaves a partial line that MLflow then refuses
    to read for the whole run (and, through search, for the experiment); so the sizes of the files a batch touches
    are noted first and restored if it fails. A store damaged anyway is reported once, with the path and the fix,
    and the run is found and written without reading the damaged file."""

    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run_id: str, config: dict[str, Any]) -> None:
        if uri.startswith("file:"):
            # the file store is in maintenance mode in MLflow 3 and refuses to open without this opt-out
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        self.root = Path(url2pathname(urlparse(uri).path)) if uri.startswith("file:") else None
        exp = self.client.get_experiment_by_name(experiment)
        if exp is None:
            try:
                self.client.create_experiment(experiment)
            except Exception:  # another process created it first: it exists now
                pass
            exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id
        found = self._find(exp_id, run_id)
        if found is not None:  # resumed: the steps it holds stand
            self.run, status = found
            self.run_dir = self.root / exp_id / self.run if self.root else None
            if self.run_dir is not None:
                self.logged_through = _last_step(self.run_dir / "metrics" / RESUME_KEY)
            else:
                history = self.client.get_metric_history(self.run, RESUME_KEY)
                self.logged_through = max((m.step for m in history), default=0)
            if status != "RUNNING":
                self.client.update_run(self.run, status="RUNNING")
        else:
            self.run = self.client.create_run(exp_id, run_name=run_id, tags={"laminar.run_id": run_id}).info.run_id
            self.run_dir = self.root / exp_id / self.run if self.root else None
            self.logged_through = 0
            from mlflow.entities import Param

            params = [Param(k, v) for k, v in config_params(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                self._batch(params=params[i:i + 100])

    def _find(self, exp_id: str, run_id: str) -> tuple[str, str] | None:
        """The run tagged with the run id and its status; on a file store, damaged metric files are reported and
        the run is found from its tags on disk (MLflow's search reads every run's metrics)."""
        if self.root is not None:
            (self.root / exp_id).mkdir(parents=True, exist_ok=True)
            for run_dir in sorted((self.root / exp_id).iterdir()):
                for path, line in mlflow_bad_lines(run_dir):
                    log.warning("tracker_store_corrupt", tracker="mlflow", path=str(path), line=line,
                                fix=f"delete line {line} of that file (a write cut off before this version of "
                                "laminar); MLflow cannot read the run until then; laminar goes on writing the run")
            import yaml

            for run_dir in sorted((self.root / exp_id).iterdir()):
                tag = run_dir / "tags" / "laminar.run_id"
                if not tag.is_file() or tag.read_text() != run_id or not (run_dir / "meta.yaml").is_file():
                    continue
                meta = yaml.safe_load((run_dir / "meta.yaml").read_text()) or {}
                if meta.get("lifecycle_stage") != "deleted":
                    return run_dir.name, "RUNNING" if meta.get("status") == 1 else str(meta.get("status"))
            return None
        found = self.client.search_runs([exp_id], filter_string=f"tags.`laminar.run_id` = '{run_id}'",
                                        max_results=1)
        return (found[0].info.run_id, found[0].info.status) if found else None

    def _batch(self, *, metrics: list | None = None, params: list | None = None, tags: list | None = None) -> None:
        """log_batch through the client; on a file store, whole or not at all."""
        if self.run_dir is None:
            self.client.log_batch(self.run, metrics=metrics or [], params=params or [], tags=tags or [])
            return
        touched = {self.run_dir / "metrics" / m.key for m in metrics or []}
        touched |= {self.run_dir / "tags" / t.key for t in tags or []}
        touched |= {self.run_dir / "params" / p.key for p in params or []}
        sizes = {p: p.stat().st_size if p.is_file() else None for p in touched}
        try:
            self.client.log_batch(self.run, metrics=metrics or [], params=params or [], tags=tags or [])
        except BaseException:
            for path, size in sizes.items():
                if size is None:
                    path.unlink(missing_ok=True)
                elif path.is_file() and path.stat().st_size != size:
                    os.truncate(path, size)
            raise

    def resume_at(self, step: int) -> None:
        """MLflow appends; a step it already holds is skipped in `log` instead."""

    def log(self, step: int, scalars: dict[str, float], time_ms: int) -> None:
        if step <= self.logged_through:
            return
        from mlflow.entities import Metric

        self._batch(metrics=[Metric(k, v, time_ms, step) for k, v in scalars.items()])
        self.logged_through = step

    def event(self, step: int, kind: str, detail: str, time_ms: int) -> None:
        from mlflow.entities import RunTag

        self._batch(tags=[RunTag(f"laminar.event.{kind}.step{step}", detail[:5000])])

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

    def log(self, step: int, scalars: dict[str, float], time_ms: int) -> None:
        self.run.log(scalars, step=step)

    def event(self, step: int, kind: str, detail: str, time_ms: int) -> None:
        self.run.log({f"events/{kind}": 1.0}, step=step)

    def close(self, finished: bool) -> None:
        self.run.finish()


class Trackers:
    """Every tracker the run's config asks for, for one run id, each behind its own writer thread
    (services/tracking_writer.py): the calls only queue; failures are retried, counted, never raised."""

    def __init__(self, run_id: str, cfg: RunConfig, home: Path) -> None:
        self.run_id, self.cfg = run_id, cfg
        self.dir = tracker_dir(cfg, home)
        self.wanted = enabled(cfg)
        self.last_step = -1  # the highest step this process queued; -1: none yet (the next write is a resume)
        self.writers = {name: self._writer(name) for name in self.wanted}
        self.before: dict[str, int] = {}  # calls skipped by the writers of an earlier close, per tracker

    def _writer(self, name: str) -> TrackerWriter:
        t = self.cfg.tracking
        return TrackerWriter(name, lambda: self._make(name), run_id=self.run_id, queue_max=t.queue_max,
                             retry_max_s=t.retry_max_s)

    def _open(self) -> dict[str, TrackerWriter]:
        """The writers; one closed already (a write after close, e.g. a rewind past the last step) is started anew
        and the tracker opened again, as a resume."""
        for name, w in list(self.writers.items()):
            if w.closed:
                self.before[name] = self.before.get(name, 0) + w.dropped + w.given_up
                self.writers[name] = self._writer(name)
                self.last_step = -1
        return self.writers

    def _make(self, name: str) -> Tracker:
        config = self.cfg.to_json()
        if name == "tensorboard":
            return TensorBoardTracker(self.dir / "tensorboard" / self.run_id, config)
        if name == "mlflow":
            uri = self.cfg.tracking.mlflow_uri or (self.dir / "mlruns").resolve().as_uri()
            return MlflowTracker(uri, self.cfg.tracking.experiment, self.run_id, config)
        return WandbTracker(self.dir / "wandb", self.cfg.tracking.experiment, self.run_id, config)

    @property
    def skipped(self) -> dict[str, int]:
        """Per tracker, the calls it will never write: dropped from a full queue, or given up (a permanent error,
        or pending at close); the trainer writes it into each step's record (`tracker_skipped`)."""
        out = {name: self.before.get(name, 0) + w.dropped + w.given_up for name, w in self.writers.items()}
        return {name: n for name, n in out.items() if n}

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per tracker: items written, dropped, given up, pending, outages, failing now, and the steps it is missing
        as ranges ("66-70,81"), for the step record (`tracker_stats`) and the summary."""
        return {name: w.stats() for name, w in self.writers.items()}

    def log_step(self, step: int, scalars: dict[str, float]) -> None:
        """Queue one step's scalars; a first write, or a step at or below the last one queued, is a resume."""
        writers = self._open()
        resume = self.last_step < 0 or step <= self.last_step
        for w in writers.values():
            w.put(Item("step", step, scalars=scalars, resume=resume))
        self.last_step = step

    def log_event(self, step: int, kind: str, detail: str) -> None:
        for w in self._open().values():
            w.put(Item("event", step, event=kind, detail=detail))

    def close(self, finished: bool) -> None:
        """Write what is queued and close each tracker, within tracking.close_timeout_s in all."""
        deadline = time.monotonic() + self.cfg.tracking.close_timeout_s
        for w in self.writers.values():
            w.close(finished, deadline)


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
