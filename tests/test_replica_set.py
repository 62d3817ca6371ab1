"""workflows/replica_set.py: the run's rollout replicas on a real RunState, Ledger and Migrations, with fake replica
activities (futures the test resolves): starting them, `laminar scale` up and down, removed replicas retired once
they return (their leases back to the pool), a failed replica failing the run with its own error, and a randomised
interleaving of scales and returns that keeps one activity per active id."""

from __future__ import annotations

import asyncio
import random

import pytest
from temporalio.exceptions import ActivityError, ApplicationError, RetryState

from laminar.config import RunConfig
from laminar.workflows.ledger import Ledger
from laminar.workflows.migrations import Migrations
from laminar.workflows.replica_set import ReplicaSet
from laminar.workflows.state import RunState
from tests.fixtures.fake_runtime import FakeRuntime


class Harness:
    def __init__(self, replicas: int = 2, pool: str = "") -> None:
        self.cfg = RunConfig.load(None, [f"rollout.replicas={replicas}"])
        self.state = RunState(run_id="run-r", pool=pool, trainer_ready=True)
        self.ledger = Ledger(self.state)
        self.rt = FakeRuntime()
        self.may_start = True
        self.started: list[str] = []
        self.set = ReplicaSet(self.state, self.ledger, Migrations(self.ledger), self.cfg, self.rt, start=self.start,
                              may_start=lambda: self.may_start)

    def start(self, replica_id: str) -> asyncio.Future:
        self.started.append(replica_id)
        return asyncio.get_running_loop().create_future()

    def events(self) -> list[tuple[str, str]]:
        return [(e.kind, e.subject) for e in self.state.events]


async def test_the_configured_replicas_start_and_a_scale_adds_the_lowest_free_ids():
    h = Harness(replicas=2)
    h.set.start_all()
    assert h.started == ["replica-0", "replica-1"] and h.set.running() == 2 and not h.set.returned()
    res = h.set.scale_to(4)
    assert (res.replicas_target, res.started, res.removed) == (4, ["replica-2", "replica-3"], [])
    assert h.started[-2:] == ["replica-2", "replica-3"] and h.state.replica_ids == h.set.ids()
    assert h.events()[-2:] == [("replica_added", "replica-2"), ("replica_added", "replica-3")]


async def test_a_removed_replica_is_answered_leave_and_retired_once_it_returns():
    h = Harness(replicas=3)
    h.set.start_all()
    h.ledger.lease("replica-0", 4)
    h.ledger.lease("replica-2", 3)  # the fewest leases leave: replica-1 (none), then replica-2
    res = h.set.scale_to(1)
    assert res.removed == ["replica-1", "replica-2"] and h.set.leaving("replica-2") and not h.set.leaving("replica-0")
    assert h.set.left() == []  # both still run
    h.set.tasks["replica-2"].set_result(None)
    assert h.set.left() == ["replica-2"]
    h.set.retire_left()
    assert h.state.leaving == ["replica-1"] and "replica-2" not in h.set.tasks
    assert h.state.scale_groups_returned == 3  # what it still held went back to the pool
    assert all(lease.replica_id == "replica-0" for lease in h.state.open_leases.values())
    assert h.events()[-1] == ("replica_left", "replica-2")


async def test_a_segment_handing_over_starts_new_ids_in_the_next_one():
    h = Harness(replicas=1)
    h.set.start_all()
    h.may_start = False
    res = h.set.scale_to(3)
    assert res.started == ["replica-1", "replica-2"] and h.started == ["replica-0"]
    assert h.state.replica_ids == ["replica-0", "replica-1", "replica-2"]  # the next segment starts them


async def test_a_pooled_run_runs_only_what_it_was_granted():
    h = Harness(replicas=4, pool="pool/p")
    h.set.start_all()
    assert h.set.ids() == [] and h.started == []
    assert h.set.scale_to(2).started == ["replica-0", "replica-1"]
    assert h.set.scale_to(0).removed == ["replica-0", "replica-1"]  # a grant of none: least is 0


@pytest.mark.parametrize(
    ("error", "message", "kind"),
    [
        (ApplicationError("bad task", type="ConfigError", non_retryable=True), "rollout replica-1 failed: bad task",
         "ConfigError"),
        (RuntimeError("boom"), "rollout replica-1 failed: boom", "ReplicaFailed"),
    ],
)
async def test_a_failed_replica_fails_the_run_with_its_error(error, message, kind):
    h = Harness(replicas=2)
    h.set.start_all()
    h.set.fail_if_one_failed()  # none failed: nothing
    if isinstance(error, ApplicationError):
        wrapped = ActivityError("activity failed", scheduled_event_id=1, started_event_id=2, identity="t",
                                activity_type="run_rollout_replica", activity_id="rollout-replica-1",
                                retry_state=RetryState.NON_RETRYABLE_FAILURE)
        wrapped.__cause__ = error
        error = wrapped
    h.set.tasks["replica-1"].set_exception(error)
    assert h.set.failed() == "replica-1"
    with pytest.raises(ApplicationError, match=message) as info:
        h.set.fail_if_one_failed()
    assert info.value.type == kind and info.value.non_retryable


async def test_a_cancelled_replica_is_not_a_failure():
    h = Harness(replicas=1)
    h.set.start_all()
    h.set.tasks["replica-0"].cancel()
    assert h.set.failed() is None and h.set.returned()


@pytest.mark.parametrize("seed", range(20))
async def test_random_scales_and_returns_keep_one_activity_per_active_id(seed):
    rng = random.Random(seed)
    h = Harness(replicas=rng.randrange(1, 5))
    h.set.start_all()
    for _ in range(60):
        op = rng.random()
        if op < 0.4:
            h.set.scale_to(rng.randrange(1, 7))
        elif op < 0.7:
            running = [r for r, t in h.set.tasks.items() if not t.done() and r in h.state.leaving]
            if running:
                h.set.tasks[rng.choice(running)].set_result(None)  # a removed replica returns
        elif op < 0.85:
            h.ledger.lease(rng.choice(h.set.ids()), rng.randrange(1, 3))
        else:
            h.set.retire_left()
        active = [r for r in h.set.ids() if r not in h.state.leaving]
        assert len(set(active)) == len(active) and not set(active) & set(h.state.leaving)
        assert all(r in h.set.tasks and not h.set.tasks[r].done() for r in active), "every active id runs"
        assert len([t for t in h.set.tasks.values() if not t.done()]) == len(active) + len(
            [r for r in h.state.leaving if r in h.set.tasks and not h.set.tasks[r].done()])
        holders = {lease.replica_id for lease in h.state.open_leases.values()}
        assert holders <= set(h.set.tasks), "no lease held by a replica retired from the run"
