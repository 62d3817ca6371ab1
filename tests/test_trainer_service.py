"""TrainerService without Temporal: checkpoint + replay make train_step idempotent, a group consumed
again is counted (never trained on twice), an inconsistent replay is a permanent error, retention never
deletes a checkpoint the workflow still records, and a corrupt checkpoint falls back to an older one."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from laminar.config import RunConfig
from laminar.contract import BatchPart, TrainStepInput, TrainStepResult
from laminar.envs.tasks import get_task
from laminar.errors import CorruptDataError, InconsistentStateError, StepOutOfTurnError, StoreError
from laminar.records import Trajectory
from laminar.refs import SegmentRef
from laminar.services.trainer import TrainerService
from laminar.storage import keys
from laminar.storage.checkpoints import CheckpointStore
from laminar.storage.objects import LocalObjectStore
from laminar.storage.trajectories import TrajectoryStore
from laminar.workflows.ledger import Ledger
from laminar.workflows.state import RunState

CFG = RunConfig.load(None, ["model.pretrain_steps=0", "task.max_count=8", "rollout.group_size=2",
                            "trainer.groups_per_step=2", "trainer.checkpoint_every=2", "run.steps=100"])


def _batch(store: TrajectoryStore, run_id: str, first_prompt: int) -> list[BatchPart]:
    ref = _segment(store, run_id, first_prompt)
    return [BatchPart(segment=ref, group_ids=list(ref.group_ids))]


def _segment(store: TrajectoryStore, run_id: str, first_prompt: int) -> SegmentRef:
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
    return store.write_segment(run_id, "replica-0", f"s{first_prompt}", rows)


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


# -- retention and fallback, driven by the real Ledger (what the workflow records) ----------------------


def _cfg(*extra: str) -> RunConfig:
    return RunConfig.load(None, ["model.pretrain_steps=0", "task.max_count=8", "rollout.group_size=2",
                                 "trainer.groups_per_step=2", "trainer.checkpoint_every=2", "run.steps=100", *extra])


def _next_input(ledger: Ledger, cfg: RunConfig, trajs: TrajectoryStore) -> TrainStepInput:
    """Two fresh groups reach the ledger, which builds the next step's input as the workflow does."""
    leases = ledger.lease("replica-0", 2)
    ledger.add_segment(_segment(trajs, ledger.state.run_id, leases[0].prompt_id))
    return ledger.next_train_input(cfg, [])


def _steps(svc: TrainerService, ledger: Ledger, cfg: RunConfig, trajs: TrajectoryStore, n: int) -> TrainStepResult:
    for _ in range(n):
        inp = _next_input(ledger, cfg, trajs)
        res = svc.train_step(inp)
        ledger.commit_step(inp, res, keep_last=cfg.trainer.keep_last)
    return res


def _flip_a_byte(store, key: str) -> None:
    data = bytearray(store.get(key))
    data[-1] ^= 0xFF  # tensor data: the file still parses, its sha256 no longer matches the manifest
    store.put(key, bytes(data))


def test_retention_keeps_the_checkpoint_a_lost_step_result_points_to(setup):
    store, trajs, home = setup
    cfg = _cfg("trainer.keep_last=1")
    ledger = Ledger(RunState(run_id="r"))
    ckpts = CheckpointStore(store)
    _steps(TrainerService(store, home), ledger, cfg, trajs, 3)
    assert ledger.state.checkpoint.step == 2 and ckpts.list_committed("r") == [2]
    # Step 3 -> 4 commits checkpoint 4, then the trainer dies before the workflow records the result.
    inp = _next_input(ledger, cfg, trajs)
    assert TrainerService(store, home).train_step(inp).checkpoint.step == 4
    # keep_last=1 must not delete checkpoint 2: the workflow still points to it and retries the same input.
    assert ckpts.list_committed("r") == [2, 4]
    retry = TrainerService(store, home).train_step(inp)
    # restore 2, replay the batch of step 2 -> 3 (1 step redone), step 3 -> 4 and save 4 again
    assert (retry.step, retry.steps_redone, retry.restored, retry.checkpoint.step) == (4, 1, True, 4)
    ledger.commit_step(inp, retry, keep_last=1)
    # Later checkpoints: the store never holds more than the workflow's checkpoint plus the new one.
    svc = TrainerService(store, home)
    for _ in range(4):
        _steps(svc, ledger, cfg, trajs, 1)
        assert len(ckpts.list_committed("r")) <= 2
    # steps 5..8: saving 6 deleted 2 (older than the workflow's 4), saving 8 deleted 4
    assert ckpts.list_committed("r") == [6, 8] and [c.step for c in ledger.state.checkpoints] == [8]


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one_and_redoes_the_steps(setup):
    store, trajs, home = setup
    cfg = _cfg("trainer.keep_last=2")
    ledger = Ledger(RunState(run_id="r"))
    first = TrainerService(store, home)
    _steps(first, ledger, cfg, trajs, 5)  # checkpoints 2 and 4 committed, step 5 done
    assert [c.step for c in ledger.state.checkpoints] == [2, 4]
    _flip_a_byte(store, keys.checkpoint_part("r", 4, "model"))
    inp = _next_input(ledger, cfg, trajs)  # step 5 -> 6
    # The trainer is killed: a fresh process restores, finds 4 corrupt and falls back to 2.
    fresh = TrainerService(store, home)
    res = fresh.train_step(inp)
    # replays the batches of steps 2, 3 and 4 (3 steps redone), then steps to 6 and checkpoints it
    assert (res.step, res.steps_redone, res.restored, res.corrupt_checkpoints) == (6, 3, True, [4])
    assert res.metrics.consumed_twice == 0
    # The same policy as the trainer that never died (same batches, same order, exact restore).
    first.train_step(inp)
    expected = first.trainer.policy_state_dict()
    for name, tensor in fresh.trainer.policy_state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    ledger.commit_step(inp, res, keep_last=2, at=7.0)
    # The workflow records the fallback and drops the corrupt checkpoint from what it retains.
    fallback = [e for e in ledger.state.events if e.kind == "checkpoint_fallback"]
    assert [(e.subject, e.count, e.at) for e in fallback] == [("step-4", 2, 7.0)]
    assert [c.step for c in ledger.state.checkpoints] == [2, 6] and ledger.state.checkpoint.step == 6


def test_a_corrupt_only_checkpoint_falls_back_to_the_base_model_while_every_batch_is_kept(setup):
    store, trajs, home = setup
    cfg = _cfg()  # keep_last=3: step 0 stays a restore point until a checkpoint leaves the window
    ledger = Ledger(RunState(run_id="r"))
    _steps(TrainerService(store, home), ledger, cfg, trajs, 3)
    _flip_a_byte(store, keys.checkpoint_part("r", 2, "optim"))
    res = _steps(TrainerService(store, home), ledger, cfg, trajs, 1)
    # base model, replay steps 0, 1, 2, then step 3 -> 4
    assert (res.step, res.steps_redone, res.corrupt_checkpoints) == (4, 3, [2])
    assert [c.step for c in ledger.state.checkpoints] == [4]


def test_no_checkpoint_that_verifies_is_a_permanent_corrupt_data_error(setup):
    store, trajs, home = setup
    cfg = _cfg("trainer.keep_last=1")
    ledger = Ledger(RunState(run_id="r"))
    _steps(TrainerService(store, home), ledger, cfg, trajs, 5)  # checkpoint 4 is all the workflow keeps
    _flip_a_byte(store, keys.checkpoint_part("r", 4, "model"))
    with pytest.raises(CorruptDataError, match=r"no committed checkpoint the workflow retains verifies \(checkpoint "
                                               r"step-4 part model-00001.safetensors: sha256 mismatch") as info:
        TrainerService(store, home).train_step(_next_input(ledger, cfg, trajs))
    assert "trainer.keep_last >= 2" in str(info.value)


def test_on_notice_the_step_in_flight_writes_a_deadline_checkpoint(setup):
    """checkpoint_every=2: without a notice step 3 writes none. With the notice given, the step's result carries
    a checkpoint of step 3, so a successor asked for step 3 restores it and redoes nothing."""
    from laminar.notice import Notice

    store, trajs, home = setup
    notice = Notice()
    batches = [_batch(trajs, "r", 10 * i) for i in range(4)]
    svc = TrainerService(store, home, notice=notice)
    results = [svc.train_step(_input("r", i, batches[i])) for i in range(2)]  # steps 1, 2 (checkpoint at 2)
    notice.give(30.0, "SIGTERM")
    res = svc.train_step(_input("r", 2, batches[2], checkpoint=results[1].checkpoint))
    assert res.step == 3 and res.checkpoint is not None and res.checkpoint.step == 3
    assert svc.deadline_checkpoint() is None  # the policy's step has its checkpoint already
    successor = TrainerService(store, home)
    after = successor.train_step(_input("r", 3, batches[3], checkpoint=res.checkpoint))
    assert (after.step, after.steps_redone, after.restored) == (4, 0, True)


def test_on_notice_between_steps_the_trainer_checkpoints_its_policy(setup):
    """Steps 1..3 with checkpoint_every=2 leave step 3 past the last checkpoint (step 2): deadline_checkpoint
    saves step 3, and the ledger-style successor input (checkpoint 3, nothing to replay) redoes no step."""
    from laminar.notice import Notice

    store, trajs, home = setup
    notice = Notice()
    batches = [_batch(trajs, "r", 10 * i) for i in range(4)]
    svc = TrainerService(store, home, notice=notice)
    assert svc.deadline_checkpoint() is None  # nothing loaded yet
    results = [svc.train_step(_input("r", i, batches[i], checkpoint=None, replay=batches[:i])) for i in range(3)]
    assert [r.checkpoint is not None for r in results] == [False, True, False]
    notice.give(30.0, "SIGTERM")
    ref = svc.deadline_checkpoint()
    assert ref is not None and (ref.run_id, ref.step) == ("r", 3)
    assert CheckpointStore(store).load(ref).meta["step"] == 3
    successor = TrainerService(store, home)
    after = successor.train_step(_input("r", 3, batches[3], checkpoint=ref))
    assert (after.step, after.steps_redone, after.metrics.consumed_twice) == (4, 0, 0)


def _left_on_notice_after_three_steps(setup) -> list:
    """Steps 0..2 of run r on a trainer given the notice, which then writes its deadline checkpoint (step 3); the
    five batches of run r."""
    from laminar.notice import Notice

    store, trajs, home = setup
    notice = Notice()
    batches = [_batch(trajs, "r", 10 * i) for i in range(5)]
    svc = TrainerService(store, home, notice=notice)
    for i in range(3):
        svc.train_step(_input("r", i, batches[i], replay=batches[:i]))
    notice.give(30.0, "SIGTERM")
    assert svc.deadline_checkpoint().step == 3
    return batches


def test_a_successor_uses_the_deadline_checkpoint_the_input_does_not_name_yet(setup):
    """The workflow scheduled step 3 (restore point: nothing, replay batches 0..2) before the deadline checkpoint's
    signal reached it. The successor finds the checkpoint at step 3, checks it consumed every replayed group and
    none of this step's, and restores it: 0 steps redone instead of 3. A checkpoint of a different history (its
    consumed set lacks a replayed group) is not used: the 3 steps are replayed."""
    store, _, home = setup
    batches = _left_on_notice_after_three_steps(setup)
    res = TrainerService(store, home).train_step(_input("r", 3, batches[3], replay=batches[:3]))
    assert (res.step, res.steps_redone, res.restored, res.metrics.consumed_twice) == (4, 0, True, 0)
    # another history: the input says step 3 came from batches 0, 1 and 4 (not 2): the checkpoint is not it
    other = TrainerService(store, home).train_step(_input("r", 3, batches[3], replay=[*batches[:2], batches[4]]))
    assert (other.step, other.steps_redone) == (4, 3)


def test_steps_delivered_out_of_order_are_caught_up_and_answered_without_a_rewind(setup):
    """Train-ahead (issue 37): the workflow scheduled steps 1 and 2 while step 0 ran, and the queue handed step 2
    over first. Step 2's replay holds batch 1, on top of what the trainer trained (batch 0), so it trains batch 1
    then batch 2; step 1's activity then gets the result kept for it. Same weights and results as in order."""
    store, trajs, home = setup
    batches = [_batch(trajs, "r", 10 * i) for i in range(3)]
    in_order = TrainerService(store, home)
    want = [in_order.train_step(_input("r", i, batches[i], replay=batches[:i])) for i in range(3)]
    svc = TrainerService(store, home)
    svc.train_step(_input("r", 0, batches[0]))  # loads run r: its profile starts afresh
    third = svc.train_step(_input("r", 2, batches[2], replay=batches[:2]), schedule_to_start_s=0.01)
    second = svc.train_step(_input("r", 1, batches[1], replay=batches[:1]), schedule_to_start_s=0.01)
    assert (second.step, third.step, svc.step) == (2, 3, 3)
    # one queue wait per activity, the one answered from the kept result too (the profile counts activities)
    assert svc.profile.to_dict()["latency"]["train_step_schedule_to_start"]["n"] == 2
    assert (second.restored, third.restored, second.steps_redone, third.steps_redone) == (False, False, 0, 0)
    assert (second.metrics.consumed_twice, third.metrics.consumed_twice) == (0, 0)
    assert [second.metrics.loss, third.metrics.loss] == pytest.approx([want[1].metrics.loss, want[2].metrics.loss])
    assert all(torch.equal(a, b) for a, b in zip(svc.trainer.policy_state_dict().values(),
                                                   in_order.trainer.policy_state_dict().values(), strict=True))
    # a step whose batch is not the one taken ahead is not answered from the kept result: it rewinds
    other = svc.train_step(_input("r", 1, batches[0], replay=batches[:1]))
    assert other.restored


def test_a_step_scheduled_ahead_waits_its_turn_once_on_a_trainer_elsewhere(setup):
    """A replacement trainer (fresh process) handed step 1, scheduled while step 0 ran, defers it on its first
    attempt (the leaving trainer finishes step 0, or step 0's retry comes first); a retry runs it with a rewind."""
    store, trajs, home = setup
    batches = [_batch(trajs, "r", 10 * i) for i in range(2)]
    svc = TrainerService(store, home)
    ahead = dataclasses.replace(_input("r", 1, batches[1], replay=batches[:1]), ahead=True)
    with pytest.raises(StepOutOfTurnError, match="scheduled ahead of step 0"):
        svc.train_step(ahead, attempt=1)
    # its retry takes step 0 first (kept for step 0's own activity), then step 1: nothing is redone twice. The
    # retried step reports the restore (step 0 may have committed on the trainer that died and never ask again)
    res = svc.train_step(ahead, attempt=2)
    assert (res.step, res.restored, res.steps_redone) == (2, True, 0)
    before = svc.train_step(_input("r", 0, batches[0]), attempt=2)
    assert (before.step, before.restored, before.steps_redone, svc.step) == (1, False, 0, 2)
    # in turn (the trainer is at the step before it), it runs at once
    assert svc.train_step(dataclasses.replace(_input("r", 2, _batch(trajs, "r", 50), replay=batches),
                                              ahead=True)).step == 3


def test_a_retry_two_steps_ahead_trains_both_steps_before_it_once(setup):
    """Train-ahead 2: steps 0, 1 and 2 were in flight on a trainer that died; step 2's retry reaches the new
    trainer first. It trains steps 0 and 1 on its way (its input says two were in flight before it) and keeps their
    results, so that their own retries answer from them instead of rewinding again: nothing is trained twice (the
    trainer drill counts steps redone)."""
    store, trajs, home = setup
    batches = [_batch(trajs, "r", 10 * i) for i in range(3)]
    in_order = TrainerService(store, home)  # another run id: its checkpoints are not run r's
    want = [in_order.train_step(_input("ref", i, batches[i], replay=batches[:i])) for i in range(3)]
    svc = TrainerService(store, home)
    third = svc.train_step(dataclasses.replace(_input("r", 2, batches[2], replay=batches[:2]), ahead=True, behind=2),
                           attempt=2)
    assert (third.step, third.restored, third.steps_redone, svc.step) == (3, True, 0, 3)
    second = svc.train_step(dataclasses.replace(_input("r", 1, batches[1], replay=batches[:1]), ahead=True, behind=1),
                            attempt=2)
    first = svc.train_step(_input("r", 0, batches[0]), attempt=2)
    assert [(r.step, r.restored, r.steps_redone) for r in (first, second)] == [(1, False, 0), (2, False, 0)]
    assert svc.step == 3  # answered from the kept results: no rewind
    assert [first.metrics.loss, second.metrics.loss, third.metrics.loss] == pytest.approx(
        [w.metrics.loss for w in want])
    assert all(torch.equal(a, b) for a, b in zip(svc.trainer.policy_state_dict().values(),
                                                   in_order.trainer.policy_state_dict().values(), strict=True))


def test_a_retry_two_steps_ahead_starts_at_the_deadline_checkpoint_of_a_step_in_between(setup):
    """On notice the leaving trainer finished step 2 (its deadline checkpoint is at step 3) and steps 3 and 4 declined;
    step 4's retry (two were in flight before it) reaches the successor first. It starts at the checkpoint: step 3
    restores it, nothing is redone, and step 3's own retry answers from the kept result."""
    store, _, home = setup
    batches = _left_on_notice_after_three_steps(setup)
    successor = TrainerService(store, home)
    fifth = successor.train_step(dataclasses.replace(_input("r", 4, batches[4], replay=batches[:4]), ahead=True,
                                                     behind=2), attempt=2)
    assert (fifth.step, fifth.restored, fifth.steps_redone, fifth.metrics.consumed_twice) == (5, True, 0, 0)
    assert sorted(successor._ahead) == [("r", 3)]  # step 3 was trained on the way, step 2 was not trained again
    fourth = successor.train_step(dataclasses.replace(_input("r", 3, batches[3], replay=batches[:3]), ahead=True,
                                                      behind=1), attempt=2)
    assert (fourth.step, fourth.restored, fourth.steps_redone, successor.step) == (4, False, 0, 5)


def test_the_step_scheduled_ahead_reads_its_segments_while_the_one_before_it_computes(setup):
    """The trainer's worker has two slots: the step behind the running one arrives while it runs. It reads its
    segments at once (outside the turn), then waits for the policy; nothing of it touches the policy early."""
    import threading

    store, trajs, home = setup
    batches = [_batch(trajs, "r", 10 * i) for i in range(2)]
    svc = TrainerService(store, home)
    svc.train_step(_input("r", 0, batches[0]))
    before = svc.trainer.policy_state_dict()
    before = {k: v.clone() for k, v in before.items()}
    out: list[TrainStepResult] = []
    beats: list[int] = []
    with svc._turn():  # the step before it holds the policy
        t = threading.Thread(target=lambda: out.append(svc.train_step(
            dataclasses.replace(_input("r", 1, batches[1], replay=batches[:1]), ahead=True),
            heartbeat=lambda: beats.append(1))))
        t.start()
        for _ in range(200):
            if "prefetch_segments" in svc.profile.latencies:
                break
            t.join(0.02)
        assert svc.profile.latencies["prefetch_segments"][1] == 1  # read while the turn was held
        t.join(1.5)
        assert t.is_alive() and not out and svc.step == 1  # still waiting, the policy untouched
        assert beats  # its activity heartbeats while it waits
        assert all(torch.equal(before[k], v) for k, v in svc.trainer.policy_state_dict().items())
    t.join(30)
    assert [(r.step, r.restored, r.metrics.consumed_twice) for r in out] == [(2, False, 0)]


def test_two_steps_at_once_train_in_order_whichever_takes_the_turn_first(setup):
    """Both slots busy, the later step first: it trains the earlier batch on its way (kept for that step's own
    activity), so the policy is the in-order one and no batch is trained twice."""
    import threading

    store, trajs, home = setup
    batches = [_batch(trajs, "r", 10 * i) for i in range(3)]
    in_order = TrainerService(store, home / "a")
    want = [in_order.train_step(_input("r", i, batches[i], replay=batches[:i])) for i in range(3)]
    svc = TrainerService(store, home / "b")
    svc.train_step(_input("r", 0, batches[0]))
    results: dict[int, TrainStepResult] = {}
    later = dataclasses.replace(_input("r", 2, batches[2], replay=batches[:2]), ahead=True)
    earlier = _input("r", 1, batches[1], replay=batches[:1])
    with svc._turn():
        threads = [threading.Thread(target=lambda inp=inp: results.__setitem__(inp.step, svc.train_step(inp)))
                   for inp in (later, earlier)]
        threads[0].start()
        threads[0].join(0.3)  # the later one waits first, so it takes the turn first
        threads[1].start()
    for t in threads:
        t.join(60)
    assert (results[1].step, results[2].step, svc.step) == (2, 3, 3)
    assert (results[1].metrics.consumed_twice, results[2].metrics.consumed_twice) == (0, 0)
    assert [results[1].metrics.loss, results[2].metrics.loss] == pytest.approx([want[1].metrics.loss, want[2].metrics.loss])
    assert all(torch.equal(a, b) for a, b in zip(svc.trainer.policy_state_dict().values(),
                                                   in_order.trainer.policy_state_dict().values(), strict=True))


def test_a_step_queued_behind_the_running_one_declines_once_the_trainer_is_on_notice(setup):
    """The running step ends with its deadline checkpoint; the one queued behind it is retried on the next trainer
    instead of running past the notice."""
    import threading

    from laminar.errors import TrainerLeavingError
    from laminar.notice import Notice

    store, trajs, home = setup
    notice = Notice()
    batches = [_batch(trajs, "r", 10 * i) for i in range(2)]
    svc = TrainerService(store, home, notice=notice)
    svc.train_step(_input("r", 0, batches[0]))
    errors: list[BaseException] = []

    def queued():
        try:
            svc.train_step(dataclasses.replace(_input("r", 1, batches[1], replay=batches[:1]), ahead=True))
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            errors.append(e)

    with svc._turn():
        t = threading.Thread(target=queued)
        t.start()
        t.join(0.5)
        notice.give(30.0, "SIGTERM")
    t.join(30)
    assert len(errors) == 1 and isinstance(errors[0], TrainerLeavingError) and "SIGTERM" in str(errors[0])
    assert svc.step == 1  # it trained nothing


def test_a_deadline_checkpoint_the_store_refuses_is_skipped_and_the_trainer_still_leaves(tmp_path, aws_test_env):
    """The 2-hour chaos run: a trainer on notice while the store was read-only raised from its deadline checkpoint
    after its worker stopped, and the process exited 1. On the real S3 dev server switched read-only, the deadline
    checkpoint is skipped (logged): the successor replays from the last committed checkpoint instead."""
    from structlog.testing import capture_logs

    from laminar.devstack.stack import DevStack, _s3_mode
    from laminar.notice import Notice
    from laminar.storage.objects import open_store
    from tests.fixtures.s3 import free_port

    stack = DevStack(tmp_path / "dev")
    info = stack.up(s3=True, port=free_port(), ui=False)
    try:
        store = open_store(info.store_url, endpoint_url=info.s3_endpoint)
        trajs, notice = TrajectoryStore(store), Notice()
        batches = [_batch(trajs, "r", 10 * i) for i in range(3)]
        svc = TrainerService(store, tmp_path / "home", notice=notice)
        for i in range(3):  # step 3 is past the last checkpoint (step 2)
            svc.train_step(_input("r", i, batches[i], checkpoint=None, replay=batches[:i]))
        notice.give(30.0, "SIGTERM")
        _s3_mode(info.s3_endpoint, "read-only")
        with capture_logs() as logs:
            assert svc.deadline_checkpoint() is None
        (skipped,) = [e for e in logs if e["event"] == "deadline_checkpoint_not_written"]
        assert skipped["step"] == 3 and "AccessDenied" in skipped["error"]
        _s3_mode(info.s3_endpoint, "read-write")
        assert not store.exists(keys.checkpoint_manifest("r", 3))  # nothing committed for step 3
    finally:
        stack.down()


class _RefusingStore(LocalObjectStore):
    """The real local store, refusing puts of the keys in `refuse` as a read-only S3 store refuses them."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.refuse: set[str] = set()

    def put(self, key: str, data: bytes) -> None:
        if key in self.refuse:
            raise StoreError(f"put of {key} was denied: AccessDenied (HTTP 403): read-only")
        super().put(key, data)


def test_a_step_whose_record_the_store_refuses_is_built_on_by_no_step_before_its_retry(tmp_path):
    """The tools chaos run (seed 1, a8b5147): step 979 trained, then a read-only store refused its metrics record, so
    its activity failed with the policy in memory one step past what the workflow had. Step 980, scheduled ahead,
    trained on it; step 979's retry then rewound from step 970, redid it and wrote its record after step 980's (the
    checker's "repeat: steps [979]"). Now the policy counts as not loaded after such a failure: the step ahead waits
    its turn, the retry rewinds, and the records are written once each, in step order, on the in-order weights."""
    from laminar.chaos.checker import check_steps, read_step_records

    store = _RefusingStore(tmp_path / "store")
    trajs, home = TrajectoryStore(store), tmp_path / "home"
    batches = [_batch(trajs, "r", 10 * i) for i in range(5)]
    other = LocalObjectStore(tmp_path / "other")  # the same steps in order, in a store of their own
    theirs = [_batch(TrajectoryStore(other), "r", 10 * i) for i in range(5)]
    in_order = TrainerService(other, home / "a")
    want = [in_order.train_step(_input("r", i, theirs[i], replay=theirs[:i])) for i in range(5)]
    svc = TrainerService(store, home / "b")
    for i in range(3):
        svc.train_step(_input("r", i, batches[i], replay=batches[:i]))
    step3 = _input("r", 3, batches[3], replay=batches[:3])
    store.refuse = {keys.step_metrics("r", 4)}
    with pytest.raises(StoreError, match="denied"):
        svc.train_step(step3)  # trained, then its record refused: the activity fails
    store.refuse = set()
    ahead = dataclasses.replace(_input("r", 4, batches[4], replay=batches[:4]), ahead=True)
    with pytest.raises(StepOutOfTurnError):
        svc.train_step(ahead, attempt=1)  # nothing builds on the step the workflow has not got
    retried = svc.train_step(step3, attempt=2)
    assert (retried.step, retried.restored, retried.metrics.consumed_twice) == (4, True, 0)
    last = svc.train_step(ahead, attempt=2)
    assert (last.step, last.restored, last.metrics.consumed_twice) == (5, False, 0)
    assert [retried.metrics.loss, last.metrics.loss] == pytest.approx([want[3].metrics.loss, want[4].metrics.loss])
    assert all(torch.equal(a, b) for a, b in zip(svc.trainer.policy_state_dict().values(),
                                                   in_order.trainer.policy_state_dict().values(), strict=True))
    steps = read_step_records(store, "r")
    assert check_steps(steps, 5).ok, check_steps(steps, 5).detail
    assert steps[4]["time"] < steps[5]["time"]


def test_a_restore_that_fails_leaves_nothing_loaded(setup, monkeypatch):
    """Step 979's retries failed inside the rewind (the read-only store refused the model files the restore
    publishes) after the old trainer was closed, and left it in place at its step: the next step trained on it. A
    restore that fails leaves nothing loaded, so the next step rewinds instead."""
    import laminar.services.trainer as trainer_module

    store, trajs, home = setup
    batches = [_batch(trajs, "r", 10 * i) for i in range(3)]
    svc = TrainerService(store, home)
    for i in range(2):
        svc.train_step(_input("r", i, batches[i], replay=batches[:i]))
    build = trainer_module.build_trainer

    def refused(*args, **kwargs):
        raise StoreError("put of model/config.json was denied: AccessDenied (HTTP 403): read-only")

    monkeypatch.setattr(trainer_module, "build_trainer", refused)
    with pytest.raises(StoreError, match="denied"):
        svc.train_step(_input("r", 1, batches[1], replay=batches[:1]), attempt=2)  # a retry: it rewinds
    assert svc.step == -1
    monkeypatch.setattr(trainer_module, "build_trainer", build)
    res = svc.train_step(_input("r", 2, batches[2], replay=batches[:2]))
    assert (res.step, res.restored) == (3, True)  # from the step-2 checkpoint, on a trainer built afresh
