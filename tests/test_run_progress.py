"""What `laminar run` shows while it waits, without a workflow query: the run's phase from its search attributes
(client/watch.py RunProgress) and the newest step from the trainer's step records in a real local store."""

from __future__ import annotations

import json

from laminar.cli.run import STEP_RECORDS_PER_LOOK, _newer_steps, _progress_line
from laminar.client.watch import RunProgress
from laminar.storage import keys
from laminar.storage.objects import LocalObjectStore
from tests.fixtures.stack import small_config


def _progress(step: int, phase: str = "running") -> RunProgress:
    return RunProgress(execution="RUNNING", phase=phase, step=step, policy_version=step, reward=0.5 if step else None,
                       history_events=40)


def _record(store, run_id: str, step: int) -> None:
    store.put(keys.step_metrics(run_id, step), json.dumps(
        {"step": step, "reward_mean": step / 100, "tokens": 10 * step, "staleness": {"0": 6, "1": 2},
         "policy_versions": [step - 1, step]}).encode())


def test_the_steps_follow_the_trainer_records_ahead_of_the_search_attributes(tmp_path):
    store, cfg = LocalObjectStore(tmp_path), small_config("run.steps=200")
    run_id = cfg.run.run_id
    seen = {"step": 0, "record": None}
    _newer_steps(store, cfg, seen, 0)
    assert seen == {"step": 0, "record": None}
    assert _progress_line(_progress(0, "starting"), None) == "starting reward=- version=0"
    for step in (1, 2, 3):
        _record(store, run_id, step)
    _newer_steps(store, cfg, seen, 1)  # the attributes say 1 (upserted at most every 5 s); the records say 3
    assert seen["step"] == 3 and seen["record"]["step"] == 3
    assert _progress_line(_progress(1), seen["record"]) == "running reward=0.030 tokens/step=30 versions=2 staleness=0.25"
    for step in range(4, 4 + STEP_RECORDS_PER_LOOK + 5):
        _record(store, run_id, step)
    _newer_steps(store, cfg, seen, 1)  # a watcher that fell behind catches up over looks
    assert seen["step"] == 3 + STEP_RECORDS_PER_LOOK
    _newer_steps(store, cfg, seen, 1)
    assert seen["step"] == 3 + STEP_RECORDS_PER_LOOK + 5 and seen["record"]["step"] == seen["step"]


def test_without_search_attributes_the_line_says_where_the_details_are():
    p = RunProgress(execution="RUNNING", phase="", step=None, policy_version=None, reward=None, history_events=12)
    assert _progress_line(p, None) == "running history=12 (`laminar status` for the details)"
