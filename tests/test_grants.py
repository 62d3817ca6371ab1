"""workflows/grants.py: a pooled run's ask and grant on a real RunState, with a fake runtime, fake signals and a fake
scale path: a grant kept until the replicas start, min(ask, grant) after, `laminar scale` changing the ask, the
ask told (and retried) to the pool, leaving it, the status notes, and a randomised interleaving."""

from __future__ import annotations

import asyncio
import random

import pytest
from temporalio.exceptions import FailureError

from laminar import contract
from laminar.config import RunConfig
from laminar.contract import PoolAsk, ReplicaGrant, ScaleResult
from laminar.workflows import timeouts
from laminar.workflows.grants import SlotGrants
from laminar.workflows.state import RunState
from tests.fixtures.fake_runtime import FakeRuntime

POOL = "pool/shared"


class Harness:
    def __init__(self, replicas: int = 2, quota: int = 1, pool: str = POOL, failures: int = 0) -> None:
        cfg = RunConfig.load(None, [f"rollout.replicas={replicas}", f"rollout.quota={quota}"])
        self.state = RunState(run_id="run-a", pool=pool)
        self.rt = FakeRuntime()
        self.started = False
        self.closing = False
        self.signals: list[tuple[str, str, object]] = []
        self.failures = failures  # signals that fail before one is taken
        self.scales: list[int] = []
        self.grants = SlotGrants(self.state, cfg, self.rt, "run/run-a", signal=self.signal, scale_to=self.scale_to,
                                 may_apply=lambda: self.started, closing=lambda: self.closing)

    async def signal(self, pool: str, name: str, arg: object) -> None:
        if self.failures:
            self.failures -= 1
            raise FailureError("workflow not found")
        self.signals.append((pool, name, arg))

    def scale_to(self, target: int) -> ScaleResult:
        """The run's own scale path, reduced: the first `target` ids run."""
        before = list(self.state.replica_ids)
        self.state.replica_ids = [f"replica-{i}" for i in range(target)]
        self.scales.append(target)
        return ScaleResult(replicas_target=target, started=[r for r in self.state.replica_ids if r not in before],
                           removed=[r for r in before if r not in self.state.replica_ids])


def test_a_grant_before_the_replicas_start_is_kept_then_applied():
    h = Harness(replicas=3)
    assert h.grants.note() == f"waiting for a grant from slot pool {POOL}"
    h.grants.granted(ReplicaGrant(granted=2, note="2 of 3: the pool is shared"))
    assert (h.state.grant, h.state.grant_note, h.scales) == (2, "2 of 3: the pool is shared", [])
    h.started = True
    assert h.grants.apply() == ScaleResult(replicas_target=2, started=["replica-0", "replica-1"], removed=[])
    assert h.grants.apply() is None  # min(ask, grant) run already
    assert h.grants.note() == "2 of 3: the pool is shared"
    assert h.grants.facts() == {"replicas_granted": 2, "grant_note": "2 of 3: the pool is shared",
                                "replicas_wanted": 3}


@pytest.mark.parametrize(
    ("ask", "grant", "running", "leaving", "stopping", "target"),
    [
        (2, 1, 0, [], False, 1),  # the grant bounds
        (2, 5, 1, [], False, 2),  # the ask bounds
        (2, -1, 0, [], False, None),  # no grant yet: none, and none run already
        (3, 0, 2, [], False, 0),  # a grant of none retires every replica
        (2, 2, 3, ["replica-2"], False, None),  # a leaving replica is not counted
        (2, 1, 2, [], True, None),  # a stopping run is not scaled
    ],
)
def test_apply_runs_min_of_ask_and_grant(ask, grant, running, leaving, stopping, target):
    h = Harness(replicas=ask)
    h.started = True
    h.state.grant, h.state.stopping = grant, stopping
    h.state.replica_ids = [f"replica-{i}" for i in range(running)]
    h.state.leaving = list(leaving)
    res = h.grants.apply()
    assert (res.replicas_target if res else None) == target


def test_a_stray_grant_on_an_unpooled_run_changes_nothing():
    h = Harness(pool="")
    h.started = True
    h.grants.granted(ReplicaGrant(granted=4))
    assert h.state.grant == -1 and h.scales == [] and h.grants.note() == "" and h.grants.facts() == {}


def test_scale_changes_the_ask_and_the_pool_hears_it_again():
    h = Harness(replicas=2)
    h.started = True
    h.grants.granted(ReplicaGrant(granted=4))
    h.grants.ask_unsent = False  # the segment's ask was told
    res = h.grants.scale_ask(3)
    assert res == ScaleResult(replicas_target=3, started=["replica-2"], removed=[])
    assert h.grants.ask() == 3 and h.grants.ask_unsent
    assert h.grants.scale_ask(3) == ScaleResult(replicas_target=3, started=[], removed=[])  # nothing to change


async def test_the_ask_is_told_and_retried_while_the_pool_does_not_take_it():
    h = Harness(replicas=2, quota=1, failures=2)
    task = asyncio.get_running_loop().create_task(h.grants.tell())
    for _ in range(50):
        await asyncio.sleep(0)
    assert h.rt.sleeps == [timeouts.POOL_RETRY_S, timeouts.POOL_RETRY_S]
    assert h.signals == [(POOL, contract.POOL_ASK, PoolAsk(run_id="run-a", workflow_id="run/run-a", replicas=2, quota=1,
                                                        engine=h.grants.cfg.rollout.engine))]
    assert h.state.pool_error == "" and not h.grants.ask_unsent
    h.grants.scale_ask(1)  # the ask changes: told again (quota bounded by the ask)
    for _ in range(50):
        await asyncio.sleep(0)
    assert h.signals[-1][2].replicas == 1 and h.signals[-1][2].quota == 1
    h.closing = True
    await asyncio.wait_for(task, 5)
    assert len(h.signals) == 2


async def test_a_pool_that_is_gone_shows_in_the_note():
    h = Harness(failures=10**6)
    task = asyncio.get_running_loop().create_task(h.grants.tell())
    for _ in range(3):
        await asyncio.sleep(0)
    assert h.grants.note().startswith(f"slot pool {POOL} did not take the run's ask (workflow not found)")
    h.closing = True
    await asyncio.wait_for(task, 5)


async def test_leaving_the_pool_signals_it_and_a_gone_pool_is_only_logged():
    h = Harness()
    await h.grants.leave()
    assert h.signals == [(POOL, contract.POOL_LEAVE, "run-a")]
    h2 = Harness(failures=1)
    await h2.grants.leave()  # no raise: the pool finds the run gone
    assert h2.signals == []


@pytest.mark.parametrize("seed", range(20))
def test_random_grants_and_scales_keep_min_of_ask_and_grant_running(seed):
    rng = random.Random(seed)
    h = Harness(replicas=rng.randrange(1, 6))
    for _ in range(100):
        op = rng.choice(["grant", "grant", "scale", "start", "stop"])
        if op == "grant":
            h.grants.granted(ReplicaGrant(granted=rng.randrange(-1, 8)))
        elif op == "scale":
            h.grants.scale_ask(rng.randrange(1, 8))
        elif op == "start":
            h.started = True
            h.grants.apply()
        elif rng.random() < 0.1:
            h.state.stopping = True
        running = len(h.state.replica_ids)
        if h.started and not h.state.stopping:
            assert running == min(h.grants.ask(), max(0, h.state.grant))
        if not h.started:
            assert running == 0, "nothing starts before the run starts its replicas"
