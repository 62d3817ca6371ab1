"""Trackers on the real stack through a trainer drill: a run whose trainer process is killed by pid in the middle
(the supervising launcher starts another, which restores a checkpoint and replays). TensorBoard's own reader
(EventAccumulator) reads every step's reward back once, equal to the step's record in the store; MLflow's client
reads the same steps from the one MLflow run of the run id; wandb wrote offline run directories."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from laminar.client.connect import connect, store_for
from laminar.client.run_control import start_workflow
from laminar.client.settings import Settings
from laminar.contract import DrillInput, RunStatus
from laminar.devstack.stack import DevStack
from laminar.drills.command import run_drill
from laminar.storage import keys
from laminar.workers.launcher import LocalLauncher, plan_processes
from tests.fixtures.s3 import free_port
from tests.fixtures.stack import small_config
from tests.fixtures.temporal import terminate_running

OVERRIDES = ["run.steps=1000", "trainer.heartbeat_timeout_s=5", "trainer.checkpoint_every=4"]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def drill_home(tmp_path_factory, aws_test_env) -> AsyncIterator[tuple[Settings, Path]]:
    home: Path = tmp_path_factory.mktemp("tracking-home")
    dev = DevStack(home)
    dev.up(s3=True, port=free_port(), ui=False)
    launcher = None
    try:
        settings = Settings.from_env({"LAMINAR_HOME": str(home), "LAMINAR_LOG_LEVEL": "info"})
        store_for(settings)
        launcher = LocalLauncher(plan_processes(small_config(*OVERRIDES), settings, home / "logs", spare_slots=1,
                                                allow_faults=True))
        launcher.start_all()
        launcher.start_supervision(interval_s=0.2)
        yield settings, home
        await terminate_running(await connect(settings))
    finally:
        if launcher is not None:
            launcher.stop_all()
        dev.down()


@pytest.mark.slow  # ~1 minute: a trainer restart, then the readers
async def test_trackers_read_back_every_step_once_through_a_trainer_drill(drill_home, tmp_path):
    settings, _ = drill_home
    track = tmp_path / "tracking"
    cfg = small_config(*OVERRIDES, f"tracking.dir={track}", "tracking.tensorboard=true", "tracking.mlflow=true",
                       "tracking.wandb=true")
    run_id = cfg.run.run_id
    client = await connect(settings)
    handle = await start_workflow(client, cfg)
    status: RunStatus = await handle.query("status", result_type=RunStatus)
    report = await run_drill(settings, DrillInput(run_id=run_id, drill_id="", fault="trainer",
                                                  at_step=status.step + 3, timeout_s=180.0))
    assert report.recovered and report.groups_consumed_twice == 0, report
    await handle.execute_update("stop", result_type=str)
    final: RunStatus = await handle.result()
    steps = list(range(1, final.step + 1))
    assert final.step >= report.steps_redone + 3

    store = store_for(settings)
    recorded = {s: json.loads(store.get(keys.step_metrics(run_id, s)))["reward_mean"] for s in steps}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_dir = track / "tensorboard" / run_id
    assert len(list(tb_dir.glob("events.out.tfevents.*"))) >= 2, "one event file per trainer process"
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    tb = [(e.step, e.value) for e in acc.Scalars("train/reward_mean")]
    assert [s for s, _ in tb] == steps, f"steps read back: {[s for s, _ in tb]}"
    assert all(abs(v - recorded[s]) < 1e-6 for s, v in tb), (tb, recorded)
    assert [e.step for e in acc.Scalars("events/trainer_restored")], "the restore is an event"

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    ml = MlflowClient(tracking_uri=(track / "mlruns").resolve().as_uri())
    exp = ml.get_experiment_by_name("laminar")
    runs = ml.search_runs([exp.experiment_id], filter_string=f"tags.`laminar.run_id` = '{run_id}'")
    assert len(runs) == 1, "one MLflow run per run id, resumed by the restarted trainer"
    history = sorted(m.step for m in ml.get_metric_history(runs[0].info.run_id, "train/reward_mean"))
    assert history == steps, history
    assert runs[0].data.params["trainer.checkpoint_every"] == "4"

    wandb_runs = list((track / "wandb" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(wandb_runs) >= 1 and all(list(r.glob(f"run-{run_id}.wandb")) for r in wandb_runs), wandb_runs
