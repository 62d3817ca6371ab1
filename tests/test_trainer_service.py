"""TrainerService without Temporal: checkpoint + replay make train_step idempotent, a group consumed
again is counted (never trained on twice), and an inconsistent replay is a permanent error."""

from __future__ import annotations

import random

import pytest

from laminar.config import RunConfig
from laminar.errors import InconsistentStateError
from laminar.messages import BatchPart, TrainStepInput
from laminar.records import Trajectory
from rl.tasks import get_task
from services.trainer import TrainerService
from storage.objects import LocalObjectStore
from storage.trajectories import TrajectoryStore

CFG = RunConfig.load(None, ["model.pretrain_steps=0", "task.max_count=8", "rollout.group_size=2",
                            "trainer.groups_per_step=2", "trainer.checkpoint_every=2", "run.steps=100"])


def _batch(store: TrajectoryStore, run_id: str, first_prompt: int) -> list[BatchPart]:
    """Two groups of two made-up trajectories each (valid task tokens, behaviour log-prob -1)."""
    task = get_task("repeat", seed=0, max_count=8)
    rng = random.Random(first_prompt)
    rows = []
    for pid in (first_prompt, first_prompt + 1):
        prompt = task.prompt(pid)
        for i in range(2):
            response = [prompt.answer_meta["symbol_id"]] * rng.randint(1, 4) + [task.eos_id]
            rows.append(Trajectory(run_id, pid, f"g{pid:08d}", i, prompt.token_ids, response, [-1.0] * len(response),
                                   task.reward(prompt, response), 0, "replica-0", 0.0, 1.0, "stop"))
    ref = store.write_segment(run_id, "replica-0", f"s{first_prompt}", rows)
    return [BatchPart(segment=ref, group_ids=list(ref.group_ids))]


def _input(run_id: str, step: int, batch, checkpoint=None, replay=()) -> TrainStepInput:
    return TrainStepInput(run_id=run_id, config=CFG.to_json(), step=step, batch=batch, checkpoint=checkpoint,
                          replay=list(replay), relay_chain=[])


@pytest.fixture
def setup(tmp_path):
    store = LocalObjectStore(tmp_path / "store")
    return store, TrajectoryStore(store), tmp_path / "home"


def test_fresh_trainer_restores_checkpoint_and_replays(setup):
    store, trajs, home = setup
    batches = [_batch(trajs, "r", 10 * i) for i in range(4)]
    first = TrainerService(store, home)
    results = [first.train_step(_input("r", i, batches[i])) for i in range(3)]
    # checkpoint_every=2: step 2 committed a checkpoint; step 3's result did not.
    assert [r.checkpoint is not None for r in results] == [False, True, False]
    ckpt = results[1].checkpoint
    # A fresh process is asked for step 3: restore step 2, replay batch 2 (1 step redone), then step.
    second = TrainerService(store, home)
    res = second.train_step(_input("r", 3, batches[3], checkpoint=ckpt, replay=[batches[2]]))
    assert (res.step, res.steps_redone, res.restored, res.metrics.consumed_twice) == (4, 1, True, 0)
    # The same process continues without restoring.
    again = second.train_step(_input("r", 4, _batch(trajs, "r", 100), checkpoint=ckpt, replay=[batches[2], batches[3]]))
    assert (again.step, again.restored) == (5, False)


def test_a_group_consumed_again_is_counted_and_skipped(setup):
    store, trajs, home = setup
    svc = TrainerService(store, home)
    batch = _batch(trajs, "r", 0)
    svc.train_step(_input("r", 0, batch))
    res = svc.train_step(_input("r", 1, batch))  # the same two groups again
    assert res.metrics.consumed_twice == 2 and res.metrics.samples == 0


def test_inconsistent_replay_is_a_permanent_error(setup):
    store, trajs, home = setup
    svc = TrainerService(store, home)
    # Asked for step 5 with no checkpoint and 1 replay batch: 0 + 1 != 5.
    with pytest.raises(InconsistentStateError, match="does not reach it"):
        svc.train_step(_input("r", 5, _batch(trajs, "r", 0), replay=[_batch(trajs, "r", 50)]))
