"""workflows/relay_chain.py: relay-chain supervision on a real RunState and Ledger, with a fake runtime and fake
relay activities (tests/fixtures/fake_runtime.py): joins, leaves, new incarnations, the watchers' backoff, the
hand-over's rejoin deadline, `laminar scale --relays`, and a randomised interleaving that keeps the chain's
invariants."""

from __future__ import annotations

import asyncio
import random

import pytest

from laminar.config import RunConfig
from laminar.contract import RelayInfo, TrainStepResult
from laminar.workflows import timeouts
from laminar.workflows.ledger import Ledger
from laminar.workflows.relay_chain import RelayChain
from laminar.workflows.state import RunState
from tests.fixtures.fake_runtime import FakeRuntime, activity_error


def _chain(relays: int = 3, trainer_ready: bool = True, run_relay=None, closing=lambda: False):
    cfg = RunConfig.from_json({"relay": {"relays": relays}})
    state = RunState(run_id="run-chain", trainer_ready=trainer_ready)
    rt = FakeRuntime()

    async def never_returns(relay_id: str, generation: int) -> None:
        await asyncio.Event().wait()

    chain = RelayChain(state, Ledger(state), cfg, rt, run_relay=run_relay or never_returns, closing=closing)
    return chain, state, rt


def _info(i: int, incarnation: int = 0) -> RelayInfo:
    return RelayInfo(relay_id=f"host-{i}", host_id=f"host-{i}", address=f"10.0.0.{i}:{7000 + incarnation}")


def _result(relays_failed: list[str] = (), relays_passed: list[str] = ()) -> TrainStepResult:
    return TrainStepResult(step=1, policy_version=1, metrics=None, checkpoint=None, steps_redone=0, publish_stall_s=0.0,
                           relays_failed=list(relays_failed), relays_passed=list(relays_passed))


def _events(state: RunState) -> list[tuple[str, str]]:
    return [(e.kind, e.subject) for e in state.events]


def test_joins_build_the_chain_in_relay_id_order_and_a_new_one_asks_for_a_republish():
    chain, state, _ = _chain()
    for i in (2, 0, 1):
        chain.joined_signal(_info(i))
    assert chain.chain() == ["10.0.0.0:7000", "10.0.0.1:7000", "10.0.0.2:7000"]
    assert [r.relay_id for r in chain.members()] == ["host-0", "host-1", "host-2"]
    assert chain.republish_wanted and chain.rejoined == {"host-0", "host-1", "host-2"}
    chain.republish_wanted = False
    chain.joined_signal(_info(1))  # the same incarnation again (a hand-over's rejoin): nothing to push
    assert not chain.republish_wanted and _events(state)[-1] == ("relay_joined", "host-1")


@pytest.mark.parametrize(
    ("case", "trainer_ready", "republish", "lost"),
    [
        ("new incarnation replaces the old", True, True, True),
        ("new incarnation before the trainer is up", False, False, True),
    ],
)
def test_a_new_incarnation_replaces_the_old_one(case, trainer_ready, republish, lost):
    chain, state, _ = _chain(trainer_ready=trainer_ready)
    chain.joined_signal(_info(0))
    chain.republish_wanted = False
    chain.joined_signal(_info(0, incarnation=1))
    assert state.relays["host-0"].address == "10.0.0.0:7001", case
    assert chain.republish_wanted is republish
    assert (("relay_lost", "host-0") in _events(state)) is lost


def test_a_relay_on_notice_leaves_without_a_republish_and_a_stale_notice_changes_nothing():
    chain, state, _ = _chain()
    chain.joined_signal(_info(0))
    chain.joined_signal(_info(1))
    chain.republish_wanted = False
    assert chain.leaving(_info(0, incarnation=9)) is False  # not the incarnation in the chain
    assert chain.leaving(_info(0)) is True
    assert chain.chain() == ["10.0.0.1:7000"] and not chain.republish_wanted
    assert _events(state)[-2:] == [("relay_lost", "host-0"), ("relay_leaving", "host-0")]
    assert chain.leaving(_info(0)) is False  # it had left already


def test_failed_checks_take_a_relay_out_and_a_passed_probe_brings_it_back_with_a_republish():
    chain, state, rt = _chain()
    for i in range(3):
        chain.joined_signal(_info(i))
    chain.republish_wanted = False
    a = "10.0.0.0:7000"
    rt.t = 7.0
    chain.note_checks([_result(relays_failed=[a])])
    assert chain.chain() == ["10.0.0.1:7000", "10.0.0.2:7000"] and chain.relays_out() == [a]
    assert [r.relay_id for r in chain.members()] == ["host-1", "host-2"]
    assert not chain.republish_wanted  # a relay taken out loses nothing the chain holds
    chain.note_checks([_result(relays_passed=[a])])
    assert chain.chain() == [a, "10.0.0.1:7000", "10.0.0.2:7000"] and chain.republish_wanted
    assert _events(state)[-2:] == [("relay_out", a), ("relay_back", a)]


def test_a_lost_relay_forgets_its_verdict():
    chain, _, _ = _chain()
    chain.joined_signal(_info(0))
    chain.joined_signal(_info(1))
    chain.note_checks([_result(relays_failed=["10.0.0.0:7000"])])
    chain.lose("host-0")
    chain.joined_signal(_info(0))  # back at the same address: starts afresh, in the chain
    assert chain.chain() == ["10.0.0.0:7000", "10.0.0.1:7000"] and chain.health.out == {}


async def test_the_watcher_backs_off_while_attempts_fail_fast_and_resets_after_a_long_one():
    calls: list[tuple[str, int]] = []
    durations = [1, 1, 1, 1, 1, 1, 100, 1]  # six fast failures, one long-lived attempt, a fast one
    stop = asyncio.Event()

    async def run_relay(relay_id: str, generation: int) -> None:
        calls.append((relay_id, generation))
        rt.t += durations[len(calls) - 1]
        if len(calls) == len(durations):
            stop.set()
        raise activity_error()

    chain, state, rt = _chain(relays=1, run_relay=run_relay, closing=lambda: stop.is_set())
    chain.joined_signal(_info(0))
    chain.start()
    await asyncio.wait_for(asyncio.gather(*rt.tasks), 5)
    assert calls == [("host-0", g) for g in range(1, 9)]
    # 2, 4, 8, 16, 30 (capped), 30 after fast failures; 1 after the long attempt; the last ends as the segment closes
    assert rt.sleeps == [2, 4, 8, 16, 30, 30, 1]
    assert _events(state).count(("relay_lost", "host-0")) == 1  # lost once; later attempts found it gone already


async def test_a_returned_attempt_loses_the_relay_and_a_cancelled_watcher_stops():
    returned = asyncio.Event()

    async def run_relay(relay_id: str, generation: int) -> None:
        if generation == 1:
            returned.set()
            return  # the activity returned (the relay's worker stopped it)
        await asyncio.Event().wait()

    chain, state, rt = _chain(relays=1, run_relay=run_relay)
    chain.joined_signal(_info(0))
    chain.start()
    await asyncio.wait_for(returned.wait(), 5)
    for _ in range(5):
        await asyncio.sleep(0)
    assert "host-0" not in state.relays and chain.republish_wanted and rt.sleeps == [2]
    chain.tasks["host-0"].cancel()
    await asyncio.gather(*rt.tasks, return_exceptions=True)
    assert chain.tasks["host-0"].done()


async def test_an_attempt_that_fails_while_the_segment_closes_leaves_the_chain_alone():
    closing = False

    async def run_relay(relay_id: str, generation: int) -> None:
        nonlocal closing
        closing = True
        raise activity_error()

    chain, state, rt = _chain(relays=1, run_relay=run_relay, closing=lambda: closing)
    chain.joined_signal(_info(0))
    chain.start()
    await asyncio.wait_for(asyncio.gather(*rt.tasks), 5)
    assert "host-0" in state.relays and rt.sleeps == []


async def test_an_inherited_relay_must_rejoin_within_two_heartbeat_timeouts():
    chain, state, rt = _chain(relays=2)
    state.relays = {"host-0": _info(0), "host-1": _info(1)}  # inherited from the previous segment
    chain.joined_signal(_info(0))  # host-0 re-joins; host-1 never does
    chain.start()
    await asyncio.wait_for(chain.tasks["host-0/rejoin"], 5)
    await asyncio.wait_for(chain.tasks["host-1/rejoin"], 5)
    assert list(state.relays) == ["host-0"]
    assert rt.timers == [timeouts.RELAY_REJOIN_HEARTBEATS * chain.cfg.relay.heartbeat_timeout_s]
    for t in rt.tasks:
        t.cancel()


async def test_a_new_run_waits_for_every_relay_then_for_one():
    chain, state, rt = _chain(relays=3, trainer_ready=False)
    waiting = asyncio.get_running_loop().create_task(chain.wait_for_relays())
    chain.joined_signal(_info(0))
    chain.joined_signal(_info(1))
    await asyncio.wait_for(waiting, 5)  # two of three: the bounded wait ends, then one is enough
    assert rt.timers == [timeouts.RELAY_JOIN.total_seconds()]
    chain2, _, rt2 = _chain(relays=3, trainer_ready=True)  # a continued run needs one
    waiting = asyncio.get_running_loop().create_task(chain2.wait_for_relays())
    chain2.joined_signal(_info(2))
    await asyncio.wait_for(waiting, 5)
    assert rt2.timers == []


async def test_scale_relays_starts_watchers_and_removes_the_highest_ids_from_the_chain():
    started: list[str] = []

    async def run_relay(relay_id: str, generation: int) -> None:
        started.append(relay_id)
        await asyncio.Event().wait()

    chain, state, rt = _chain(relays=2, run_relay=run_relay)
    chain.start()
    for i in range(2):
        chain.joined_signal(_info(i))
    assert chain.scale(4, start_watchers=True) == (["host-2", "host-3"], [])
    assert state.relay_ids == ["host-0", "host-1", "host-2", "host-3"]
    await asyncio.sleep(0)
    assert started == ["host-0", "host-1", "host-2", "host-3"]
    chain.republish_wanted = False
    assert chain.scale(1, start_watchers=True) == ([], ["host-1", "host-2", "host-3"])
    assert chain.ids() == ["host-0"] and list(state.relays) == ["host-0"] and chain.republish_wanted
    assert sorted(chain.tasks) == ["host-0"]
    chain.joined_signal(_info(3))  # a removed relay's late join does not put it back
    assert list(state.relays) == ["host-0"]
    assert chain.scale(2, start_watchers=False) == (["host-1"], [])  # a segment handing over: the next one watches
    assert sorted(chain.tasks) == ["host-0"] and chain.ids() == ["host-0", "host-1"]
    for t in rt.tasks:
        t.cancel()
    await asyncio.gather(*rt.tasks, return_exceptions=True)


@pytest.mark.parametrize("seed", range(20))
def test_random_interleavings_keep_the_chain_invariants(seed):
    rng = random.Random(seed)
    chain, state, rt = _chain(relays=4)
    incarnation = dict.fromkeys(range(6), 0)
    for _ in range(200):
        rt.t += rng.random()
        i = rng.randrange(6)
        op = rng.choice(["join", "join", "restart", "leave", "lose", "checks", "scale"])
        before = dict(state.relays)
        if op == "join":
            chain.joined_signal(_info(i, incarnation[i]))
        elif op == "restart":
            incarnation[i] += 1
            chain.joined_signal(_info(i, incarnation[i]))
        elif op == "leave":
            chain.leaving(_info(i, incarnation[i]))
        elif op == "lose":
            chain.republish_wanted = False
            chain.lose(f"host-{i}")
            assert chain.republish_wanted == (f"host-{i}" in before)
        elif op == "checks":
            addresses = [r.address for r in before.values()] + ["10.9.9.9:1"]
            chain.note_checks([_result(relays_failed=rng.sample(addresses, rng.randrange(len(addresses))),
                                       relays_passed=rng.sample(addresses, rng.randrange(len(addresses))))])
        else:
            chain.scale(rng.randrange(1, 7), start_watchers=False)
        joined = chain.joined()
        assert set(state.relays) <= set(chain.ids()), "only the run's relays are in the chain"
        assert joined == [state.relays[r].address for r in sorted(state.relays)]
        assert set(chain.chain()) <= set(joined) and (bool(chain.chain()) == bool(joined)), "never empty if any joined"
        assert [a for a in joined if a in chain.chain()] == chain.chain(), "the chain keeps relay id order"
        assert [r.address for r in chain.members()] == chain.chain()
        assert set(chain.health.out) <= set(joined), "a verdict is held only on a joined incarnation"
        assert chain.relays_out() == [a for a in joined if a in chain.health.out]
        if chain.relays_out() != joined:  # (all of them out: the chain keeps them all)
            assert chain.chain() == [a for a in joined if a not in chain.relays_out()]
