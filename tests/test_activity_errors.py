"""Activities in Temporal's ActivityEnvironment with the real TrainerService: errors a retry cannot fix
become non-retryable ApplicationErrors (the run fails with the message instead of retrying forever), and
init_trainer keeps heartbeating while it loads a model without progress ticks."""

from __future__ import annotations

import time

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from laminar.activities.heartbeat import background_heartbeat
from laminar.activities.trainer import TrainerActivities
from laminar.config import RunConfig
from laminar.contract import TrainerInitInput
from laminar.services.trainer import TrainerService
from laminar.storage.objects import LocalObjectStore


def test_a_bad_model_path_fails_init_trainer_for_good(tmp_path):
    cfg = RunConfig.load(None, ["model.path=/nonexistent"])
    acts = TrainerActivities(TrainerService(LocalObjectStore(tmp_path / "store"), tmp_path / "home"))
    with pytest.raises(ApplicationError) as info:
        ActivityEnvironment().run(acts.init_trainer, TrainerInitInput("r", cfg.to_json(), None, []))
    assert info.value.non_retryable and info.value.type == "ConfigError"
    assert "model.path='/nonexistent' is not a directory" in info.value.message


def test_a_model_directory_without_config_json_names_the_missing_file(tmp_path):
    (tmp_path / "model").mkdir()
    cfg = RunConfig.load(None, [f"model.path={tmp_path / 'model'}"])
    acts = TrainerActivities(TrainerService(LocalObjectStore(tmp_path / "store"), tmp_path / "home"))
    with pytest.raises(ApplicationError, match="has no config.json, tokenizer.json, model.safetensors or "
                                               "model.safetensors.index.json") as info:
        ActivityEnvironment().run(acts.init_trainer, TrainerInitInput("r", cfg.to_json(), None, []))
    assert info.value.non_retryable


def _beats(stall_s: float | None, tick: bool) -> list:
    """Heartbeats sent over 0.5 s by a background beat every 0.02 s; the work ticks only if `tick`."""
    beats: list = []
    env = ActivityEnvironment()
    env.on_heartbeat = lambda *details: beats.append(details)

    def work() -> None:
        with background_heartbeat(every_s=0.02, stall_s=stall_s) as progress:
            for _ in range(25):
                time.sleep(0.02)
                if tick:
                    progress.tick()

    env.run(work)
    return beats


def test_heartbeats_stop_when_progress_stalls_unless_there_is_no_stall_limit():
    # 0.5 s of work, a beat every 0.02 s: ~25 beats while it runs (>= 10 leaves room for a slow machine)
    assert len(_beats(stall_s=None, tick=False)) >= 10  # init_trainer: no ticks, beats throughout
    assert len(_beats(stall_s=0.1, tick=True)) >= 10  # ticking work beats throughout
    # no tick for 0.1 s: beats stop after ~0.1 s, so at most ~5 of the ~25
    assert len(_beats(stall_s=0.1, tick=False)) <= 8
