"""What the workflow keeps to restore from (the real Ledger over a real RunState): the retained committed
checkpoints, the batches since the oldest of them (bounded by keep_last * checkpoint_every), the step
input that hands both to the trainer, and a recorded fallback past a corrupt checkpoint."""

from __future__ import annotations

from laminar.config import RunConfig
from laminar.contract import BatchPart, StepMetrics, TrainStepResult
from laminar.refs import CheckpointRef, SegmentRef
from laminar.storage import keys
from laminar.storage.objects import sha256_hex
from laminar.workflows.ledger import Ledger
from laminar.workflows.state import RunState

RUN = "run-ckpt"


def _ckpt(step: int) -> CheckpointRef:
    return CheckpointRef(run_id=RUN, step=step, manifest_key=keys.checkpoint_manifest(RUN, step),
                         manifest_sha256=sha256_hex(str(step).encode()), policy_version=step)


def _result(step: int, checkpoint: bool, corrupt: list[int] | None = None) -> TrainStepResult:
    metrics = StepMetrics(reward_mean=0.5, loss=0.1, grad_norm=1.0, samples=2, tokens=10, response_len_mean=5.0,
                          staleness={}, dropped_stale=0, clip_fraction=0.0, consumed_twice=0)
    return TrainStepResult(step=step, policy_version=step, metrics=metrics,
                           checkpoint=_ckpt(step) if checkpoint else None, steps_redone=0, publish_stall_s=0.0,
                           restored=bool(corrupt), corrupt_checkpoints=corrupt or [])


def _step(ledger: Ledger, cfg: RunConfig, corrupt: list[int] | None = None, checkpoint: bool = True) -> list[BatchPart]:
    """One group reaches the ledger and one step consumes it; a checkpoint every checkpoint_every steps."""
    (lease,) = ledger.lease("replica-0", 1)
    key = keys.experience_segment(RUN, "replica-0", lease.group_id)
    ledger.add_segment(SegmentRef(key=key, sha256=sha256_hex(key.encode()), size=1, rows=1,
                                  group_ids=[lease.group_id], policy_version=0, tokens=1))
    inp = ledger.next_train_input(cfg, [])
    step = inp.step + 1
    ledger.commit_step(inp, _result(step, checkpoint and step % cfg.trainer.checkpoint_every == 0, corrupt),
                       keep_last=cfg.trainer.keep_last, at=float(step))
    return inp.batch


def test_batches_since_the_oldest_retained_checkpoint_are_handed_to_the_trainer() -> None:
    cfg = RunConfig.load(None, ["trainer.groups_per_step=1", "trainer.checkpoint_every=2", "trainer.keep_last=2"])
    ledger = Ledger(RunState(run_id=RUN))
    batches = [_step(ledger, cfg) for _ in range(9)]
    seen = []
    for _ in range(6):  # steps 9 .. 14
        inp = ledger.next_train_input(cfg, [])
        base = inp.checkpoint.step - len(inp.fallback_replay)
        # fallback_replay holds exactly the batches of steps base .. checkpoint.step - 1, replay the rest
        assert inp.fallback_replay == batches[base:inp.checkpoint.step]
        assert inp.replay == batches[inp.checkpoint.step:inp.step]
        # never more than keep_last * checkpoint_every = 4 batches kept
        assert len(inp.fallback_replay) + len(inp.replay) <= 4
        seen.append((inp.step, inp.checkpoint.step, [f.step for f in inp.fallbacks], base))
        batches.append(_step(ledger, cfg))
    # (step, newest checkpoint, older retained checkpoints, oldest restore point): keep_last=2 keeps two
    # checkpoints, and the batches from the older one on
    assert seen == [(9, 8, [6], 6), (10, 10, [8], 8), (11, 10, [8], 8), (12, 12, [10], 10), (13, 12, [10], 10),
                    (14, 14, [12], 12)]


def test_step_zero_stays_a_restore_point_until_a_checkpoint_leaves_the_window() -> None:
    cfg = RunConfig.load(None, ["trainer.groups_per_step=1", "trainer.checkpoint_every=2", "trainer.keep_last=1"])
    ledger = Ledger(RunState(run_id=RUN))
    for _ in range(3):
        _step(ledger, cfg)
    # checkpoint 2 is the only one retained, and the batches of steps 0 and 1 are still held: a corrupt
    # checkpoint 2 falls back to the base model (keep_last * checkpoint_every = 2 batches + 1 uncommitted)
    inp = ledger.next_train_input(cfg, [])
    assert (inp.checkpoint.step, inp.fallbacks, len(inp.fallback_replay), len(inp.replay)) == (2, [], 2, 1)
    _step(ledger, cfg)  # step 4 commits checkpoint 4: checkpoint 2 and step 0 leave the window
    inp = ledger.next_train_input(cfg, [])
    assert (inp.checkpoint.step, inp.fallbacks, len(inp.fallback_replay), len(inp.replay)) == (4, [], 0, 0)


def test_a_fallback_is_recorded_and_the_corrupt_checkpoint_forgotten() -> None:
    cfg = RunConfig.load(None, ["trainer.groups_per_step=1", "trainer.checkpoint_every=2", "trainer.keep_last=3"])
    ledger = Ledger(RunState(run_id=RUN))
    batches = [_step(ledger, cfg) for _ in range(5)]  # checkpoints 2 and 4, step 5 done
    # step 5 -> 6: the trainer found checkpoint 4 corrupt and restored from 2 (no checkpoint at step 6)
    batches.append(_step(ledger, cfg, corrupt=[4], checkpoint=False))
    assert [(e.kind, e.subject, e.count, e.at) for e in ledger.state.events if e.kind == "checkpoint_fallback"] == [
        ("checkpoint_fallback", "step-4", 2, 6.0)]
    assert [e.kind for e in ledger.status("running", 10, 0).events][-2:] == ["checkpoint_fallback", "trainer_restored"]
    # The workflow's newest checkpoint is 2 again; the next restore replays steps 2 .. 5 from it.
    inp = ledger.next_train_input(cfg, [])
    assert (inp.step, inp.checkpoint.step, inp.fallbacks) == (6, 2, [])
    assert inp.replay == batches[2:6] and inp.fallback_replay == batches[0:2]
    assert [c.step for c in ledger.state.checkpoints] == [2]


def test_a_deadline_checkpoint_of_the_current_step_becomes_the_restore_point() -> None:
    """The trainer left on notice between steps: its checkpoint of the step the run is at is committed, and the
    next step's input restores it with nothing to replay (the successor redoes no step)."""
    cfg = RunConfig.load(None, ["trainer.groups_per_step=1", "trainer.checkpoint_every=4", "trainer.keep_last=2"])
    ledger = Ledger(RunState(run_id=RUN))
    batches = [_step(ledger, cfg) for _ in range(6)]  # checkpoint at step 4; steps 5 and 6 uncommitted
    before = ledger.next_train_input(cfg, [])
    assert (before.step, before.checkpoint.step, len(before.replay)) == (6, 4, 2)
    # a checkpoint of another step (the run moved on), of another run, or no newer than the restore point: ignored
    assert not ledger.commit_deadline_checkpoint(_ckpt(5), cfg.trainer.keep_last, at=7.0)
    assert not ledger.commit_deadline_checkpoint(CheckpointRef("other", 6, "k", "s"), cfg.trainer.keep_last)
    assert ledger.commit_deadline_checkpoint(_ckpt(6), cfg.trainer.keep_last, at=7.5)
    assert not ledger.commit_deadline_checkpoint(_ckpt(6), cfg.trainer.keep_last)  # a second signal: no change
    after = ledger.next_train_input(cfg, [])
    # step 6 restores checkpoint 6 and replays nothing; checkpoint 4 stays a fallback. keep_last=2 holds
    # checkpoints 4 and 6, and none has left the window yet, so step 0 is still the oldest restore point: the
    # batches of steps 1..6 (batches[0:6]) are kept to rebuild from it
    assert (after.step, after.checkpoint.step, after.replay) == (6, 6, [])
    assert [f.step for f in after.fallbacks] == [4]
    assert after.fallback_replay == batches[0:6]
    assert ledger.state.event_times["deadline_checkpoint/trainer"] == [7.5]
