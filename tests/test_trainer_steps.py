"""workflows/trainer.py: the trainer's side of a run on a real RunState, Ledger and RelayChain, with fake trainer
activities (futures the test resolves) and a fake runtime: train-ahead scheduling and commit order, the keep_last
bound, one-step-at-a-time, stream bundles, republish, the version-missing grace, hand-over stalls, permanent
failures, and a randomised interleaving of arrivals and returns that commits every step once, in order."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
from temporalio.exceptions import ActivityError, ApplicationError, RetryState

from laminar.config import RunConfig
from laminar.contract import (
    RelayInfo,
    ReplicaReport,
    StepMetrics,
    TrainerInitResult,
    TrainStepInput,
    TrainStepResult,
)
from laminar.policy import policy_for
from laminar.refs import SegmentRef
from laminar.workflows import timeouts
from laminar.workflows.ledger import Ledger
from laminar.workflows.relay_chain import RelayChain
from laminar.workflows.state import RunState
from laminar.workflows.trainer import HANDOVER_STALLS_KEPT, Trainer
from tests.fixtures.fake_runtime import FakeRuntime

RUN = "run-trainer"


class FakeCommands:
    """Trainer activities as futures: started in order, resolved by the test (or at once, `instant`)."""

    def __init__(self, instant: bool = False, error: BaseException | None = None) -> None:
        self.instant, self.error = instant, error
        self.started: list[list[TrainStepInput]] = []
        self.handles: list[asyncio.Future] = []
        self.republished: list[tuple[int, list[str]]] = []

    def start_train(self, cfg: RunConfig, inputs: list[TrainStepInput]) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.started.append(inputs)
        self.handles.append(fut)
        if self.error is not None:
            fut.set_exception(self.error)
        elif self.instant:
            finish(fut, inputs)
        return fut

    async def init_trainer(self, run_id, cfg, checkpoint, step, relay_chain) -> TrainerInitResult:
        return TrainerInitResult(step=step, policy_version=step, published_bytes=1)

    async def republish(self, run_id: str, step: int, relay_chain: list[str]) -> None:
        self.republished.append((step, relay_chain))


def _result(step: int) -> TrainStepResult:
    metrics = StepMetrics(reward_mean=0.5, loss=0.1, grad_norm=1.0, samples=8, tokens=0, response_len_mean=5.0,
                          staleness={}, dropped_stale=0, clip_fraction=0.0, consumed_twice=0)
    return TrainStepResult(step=step, policy_version=step, metrics=metrics, checkpoint=None, steps_redone=0,
                           publish_stall_s=0.0)


def finish(fut: asyncio.Future, inputs: list[TrainStepInput]) -> None:
    results = [_result(i.step + 1) for i in inputs]
    fut.set_result(results[0] if len(inputs) == 1 else results)


def _trainer(overrides: list[str], commands: FakeCommands, ahead: bool = True, patched: bool = True,
             deep: bool = False):
    cfg = RunConfig.load(None, ["trainer.groups_per_step=2", "rollout.max_ready_groups=16", *overrides])
    state = RunState(run_id=RUN, trainer_ready=True)
    ledger, rt = Ledger(state), FakeRuntime()
    relays = RelayChain(state, ledger, cfg, rt, run_relay=None, closing=lambda: False)  # type: ignore[arg-type]
    relays.joined_signal(RelayInfo(relay_id="host-0", host_id="host-0", address="10.0.0.1:7000"))
    relays.republish_wanted = False
    calls = {"committed": 0, "stepped": 0, "patched": 0}

    def train_steps_patched() -> bool:
        calls["patched"] += 1
        return patched

    trainer = Trainer(state, ledger, cfg, policy_for(cfg), rt, relays, train_steps_patched=train_steps_patched,
                      committed=lambda: calls.__setitem__("committed", calls["committed"] + 1),
                      stepped=lambda: calls.__setitem__("stepped", calls["stepped"] + 1), commands=commands)
    trainer.ahead, trainer.deep = ahead, deep
    return trainer, state, ledger, rt, calls


def _complete(ledger: Ledger, n: int, seq: str) -> None:
    """n more prompts leased and reported complete, as one segment."""
    leases = ledger.lease("replica-0", n)
    ids = [lease.group_id for lease in leases]
    ledger.add_segment(SegmentRef(key=f"runs/{RUN}/experience/replica-0/{seq}", sha256="0" * 64, size=1, rows=1,
                                  group_ids=ids, policy_version=0, tokens=1), "replica-0")


def _steps(started: list[list[TrainStepInput]]) -> list[list[int]]:
    return [[i.step for i in inputs] for inputs in started]


async def test_train_ahead_schedules_one_behind_the_running_step_and_commits_in_order():
    cmds = FakeCommands()
    trainer, state, ledger, rt, calls = _trainer(["run.steps=10"], cmds)
    _complete(ledger, 6, "0")  # three steps' groups
    assert trainer.has_batch()
    trainer.advance()
    assert _steps(cmds.started) == [[0], [1]] and trainer.training  # one running, one behind it (TRAIN_AHEAD)
    assert [i[0].ahead for i in cmds.started] == [False, True]
    assert not trainer.has_batch()  # no room for a third
    rt.t = 3.0
    finish(cmds.handles[0], cmds.started[0])
    assert trainer.returned()
    trainer.advance()  # step 0 commits; step 2 is scheduled behind step 1
    assert state.step == 1 and _steps(cmds.started) == [[0], [1], [2]] and state.trainer_busy_s == 3.0
    assert calls["committed"] == calls["stepped"] == 1 and state.last_step_at == 3.0
    rt.t = 5.0
    finish(cmds.handles[1], cmds.started[1])
    finish(cmds.handles[2], cmds.started[2])
    await trainer.settle()  # both commit, none scheduled
    assert state.step == 3 and not trainer.flights and not trainer.training
    assert state.trainer_busy_s == 5.0  # step 1 was busy from step 0's return (3.0) to 5.0; step 2 from 5.0
    assert state.groups_consumed == 6 and state.ready == []


async def test_keep_last_one_schedules_nothing_ahead():
    cmds = FakeCommands()
    trainer, _, ledger, _, _ = _trainer(["run.steps=10", "trainer.keep_last=1"], cmds)
    _complete(ledger, 6, "0")
    trainer.advance()
    assert _steps(cmds.started) == [[0]]
    # has_batch counts room to schedule: with keep_last 1 none is behind the running step, so starved() holds
    assert not trainer.has_batch() and trainer.starved()


async def test_train_ahead_2_schedules_two_behind_the_running_step_and_commits_in_order():
    cmds = FakeCommands()
    trainer, state, ledger, rt, _ = _trainer(["run.steps=10"], cmds, deep=True)  # keep_last 3 (the default)
    _complete(ledger, 8, "0")  # four steps' groups
    trainer.advance()
    assert _steps(cmds.started) == [[0], [1], [2]]  # one running, two behind it (TRAIN_AHEAD)
    assert [i[0].ahead for i in cmds.started] == [False, True, True]
    assert not trainer.has_batch() and not trainer.starved()  # no room for a fourth
    # each input is whole on its own: the third replays the two batches before it on top of the same restore point
    assert [len(i[0].replay) for i in cmds.started] == [0, 1, 2]
    rt.t = 2.0
    finish(cmds.handles[0], cmds.started[0])
    trainer.advance()  # step 0 commits; step 3 is scheduled behind steps 1 and 2
    assert state.step == 1 and _steps(cmds.started) == [[0], [1], [2], [3]]
    for h, inp in zip(cmds.handles[1:], cmds.started[1:], strict=True):
        finish(h, inp)
    await trainer.settle()
    assert state.step == 4 and state.groups_consumed == 8 and state.ready == []


async def test_train_ahead_2_stays_below_keep_last_and_starves_with_room():
    cmds = FakeCommands()
    trainer, _, ledger, _, _ = _trainer(["run.steps=10", "trainer.keep_last=2"], cmds, deep=True)
    _complete(ledger, 8, "0")
    trainer.advance()
    assert _steps(cmds.started) == [[0], [1]]  # keep_last 2: restore points of two in flight at most one apart
    cmds = FakeCommands()
    trainer, _, ledger, _, _ = _trainer(["run.steps=10"], cmds, deep=True)
    _complete(ledger, 4, "0")  # two steps' groups: room for a third, and no batch for it
    trainer.advance()
    assert _steps(cmds.started) == [[0], [1]] and trainer.starved()  # a replica reports its next group at once


async def test_the_run_never_schedules_past_its_last_step():
    cmds = FakeCommands()
    trainer, state, ledger, _, _ = _trainer(["run.steps=1"], cmds)
    _complete(ledger, 6, "0")
    trainer.advance()
    assert _steps(cmds.started) == [[0]] and not trainer.has_batch()


async def test_one_step_at_a_time_commits_and_notes_the_handover_stall():
    cmds = FakeCommands(instant=True)
    trainer, state, ledger, rt, calls = _trainer(["run.steps=10"], cmds, ahead=False)
    state.handover_last_step_at = 1.0  # a continued segment: its first step measures the stall
    state.handover_stalls = [0.5] * HANDOVER_STALLS_KEPT
    rt.t = 4.0
    assert not trainer.has_batch() and trainer.starved()
    _complete(ledger, 2, "0")
    assert trainer.has_batch() and not trainer.starved()
    await trainer.step()
    assert state.step == 1 and not trainer.training and calls == {"committed": 1, "stepped": 1, "patched": 0}
    assert state.handover_stall_max == 3.0 and state.handover_stalls[-1] == 3.0
    assert len(state.handover_stalls) == HANDOVER_STALLS_KEPT and state.handover_last_step_at is None
    assert state.last_step_at == trainer.version_pushed_at == 4.0


@pytest.mark.parametrize(("patched", "bundles"), [(True, [[0, 1]]), (False, [[0]])])
async def test_stream_bundles_minibatch_steps_only_behind_the_patch(patched, bundles):
    cmds = FakeCommands(instant=True)
    trainer, state, ledger, _, calls = _trainer(
        ["run.mode=stream", "run.steps=10", "trainer.groups_per_step=4", "trainer.minibatches=2"], cmds,
        ahead=False, patched=patched)
    _complete(ledger, 4, "0")  # batch 0 whole: both of its minibatch steps
    await trainer.step()
    assert _steps(cmds.started) == bundles and state.step == len(bundles[0]) and calls["patched"] == 1


async def test_relays_out_travel_with_each_step():
    cmds = FakeCommands()
    trainer, _, ledger, _, _ = _trainer(["run.steps=10"], cmds)
    trainer.relays.joined_signal(RelayInfo(relay_id="host-1", host_id="host-1", address="10.0.0.2:7000"))
    trainer.relays.note_checks([dataclasses.replace(_result(0), relays_failed=["10.0.0.1:7000"])])
    _complete(ledger, 2, "0")
    trainer.advance()
    (inp,) = cmds.started[0]
    assert inp.relays_out == ["10.0.0.1:7000"] and inp.relay_chain == ["10.0.0.2:7000"]


async def test_a_permanent_failure_fails_the_run_with_its_own_type():
    cause = ApplicationError("no checkpoint verifies", type="CheckpointCorrupt", non_retryable=True)
    error = ActivityError("activity failed", scheduled_event_id=1, started_event_id=2, identity="t",
                          activity_type="train_step", activity_id="1", retry_state=RetryState.NON_RETRYABLE_FAILURE)
    error.__cause__ = cause
    for ahead in (True, False):
        trainer, _, ledger, _, _ = _trainer(["run.steps=10"], FakeCommands(error=error), ahead=ahead)
        _complete(ledger, 2, "0")
        with pytest.raises(ApplicationError, match="train_step 0 failed: no checkpoint verifies") as info:
            if ahead:
                trainer.advance()
                trainer.advance()
            else:
                await trainer.step()
        assert info.value.type == "CheckpointCorrupt" and info.value.non_retryable


async def test_init_and_republish_and_the_version_missing_grace():
    cmds = FakeCommands()
    trainer, state, _, rt, _ = _trainer(["run.steps=10"], cmds)
    state.trainer_ready, state.step = False, 4
    rt.t = 2.0
    await trainer.init()
    assert state.trainer_ready and state.policy_version == 4 and state.trainer_ready_at == 2.0
    missing = ReplicaReport(replica_id="replica-0", host_id="h", policy_version=-1, version_missing=True)
    rt.t = 2.0 + timeouts.VERSION_MISSING_GRACE_S - 0.1
    trainer.note_version_missing(missing)  # within the grace of the publish: it may predate it
    assert not trainer.relays.republish_wanted
    rt.t = 2.0 + timeouts.VERSION_MISSING_GRACE_S
    trainer.note_version_missing(missing)
    assert trainer.relays.republish_wanted and state.events[-1].kind == "version_missing"
    await trainer.republish()
    assert cmds.republished == [(4, ["10.0.0.1:7000"])] and not trainer.relays.republish_wanted
    assert trainer.version_pushed_at == rt.t


@pytest.mark.parametrize("seed", range(15))
async def test_random_arrivals_and_returns_commit_every_step_once_in_order(seed):
    rng = random.Random(seed)
    cmds = FakeCommands()
    steps = rng.randrange(3, 12)
    trainer, state, ledger, rt, _ = _trainer([f"run.steps={steps}", f"trainer.keep_last={rng.choice([1, 2, 3])}"],
                                             cmds)
    seq = 0
    while state.step < steps:
        rt.t += rng.random()
        roll = rng.random()
        if roll < 0.4:
            seq += 1
            _complete(ledger, rng.randrange(1, 4), str(seq))
        elif roll < 0.7:
            running = [h for h in cmds.handles if not h.done()]
            if running:  # the trainer's queue runs one at a time: the oldest returns first
                finish(running[0], cmds.started[cmds.handles.index(running[0])])
        trainer.advance()
        assert len(trainer.flights) <= (2 if trainer.cfg.trainer.keep_last >= 2 else 1)
        assert state.step + sum(len(f.inputs) for f in trainer.flights) <= steps
    await asyncio.sleep(0)
    assert state.step == steps
    started = [i.step for inputs in cmds.started for i in inputs]
    assert started == list(range(steps)), "every step scheduled once, in order"
    consumed = [g for inputs in cmds.started for i in inputs for p in i.batch for g in p.group_ids]
    assert len(consumed) == len(set(consumed)) == 2 * steps, "no group trained twice"
