"""laminar/policy.py: the per-mode decisions, alone and driven through the real Ledger by a randomised
interleaving of replicas (start, finish, load) and trainer steps, checking each mode's promise."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from laminar.config import RunConfig
from laminar.policy import (
    fresh_lease_room,
    load_action,
    may_start,
    min_version,
    policy_for,
    staleness_bound,
    trainer_batch,
    version_of,
)
from laminar.refs import SegmentRef
from laminar.workflows.ledger import Ledger
from laminar.workflows.state import RunState
from tests.test_ledger import _input, _result


def _cfg(mode: str, *extra: str) -> RunConfig:
    return RunConfig.load(None, [f"run.mode={mode}", "trainer.groups_per_step=4", *extra])


def test_lease_room_per_mode() -> None:
    # B = 4. sync at version 2 with 8 groups generated (batches 0, 1 complete): batch 2 (prompts 8..11) may
    # be leased, nothing of batch 3: room = min(3*4, (8//4+1)*4) - cursor.
    sync = policy_for(_cfg("sync"))
    assert fresh_lease_room(sync, prompt_cursor=8, version=2, groups_generated=8) == 4
    assert fresh_lease_room(sync, prompt_cursor=10, version=2, groups_generated=8) == 2
    # version 1 (batch 1 not trained yet): batch 2 must wait, whatever was generated
    assert fresh_lease_room(sync, prompt_cursor=8, version=1, groups_generated=8) == 0
    # one_step at version 1: batches <= 2 by version, and batch 2 only once batch 1 is complete (8 groups)
    one = policy_for(_cfg("one_step"))
    assert fresh_lease_room(one, prompt_cursor=8, version=1, groups_generated=7) == 0
    assert fresh_lease_room(one, prompt_cursor=8, version=1, groups_generated=8) == 4
    assert fresh_lease_room(one, prompt_cursor=12, version=1, groups_generated=12) == 0  # batch 3 needs version 2
    # partial_rollout: bound 4 (trainer.max_staleness -1 means AReaL's 4): batches <= version + 4, no barrier
    pr = policy_for(_cfg("partial_rollout"))
    assert staleness_bound(_cfg("partial_rollout")) == 4 and staleness_bound(_cfg("laminar")) == -1
    assert fresh_lease_room(pr, prompt_cursor=0, version=0, groups_generated=0) == 20
    assert fresh_lease_room(policy_for(_cfg("laminar")), prompt_cursor=10**6, version=0, groups_generated=0) is None


def test_trainer_batch_and_versions() -> None:
    ready = [("g5", 5), ("g1", 1), ("g0", 0), ("g2", 2), ("g3", 3)]
    # laminar / partial rollout: the oldest B ready groups in arrival order, whichever batch
    assert trainer_batch(policy_for(_cfg("laminar")), ready, step=0) == ["g5", "g1", "g0", "g2"]
    # sync: exactly batch 0 (prompts 0..3), once all four are complete
    sync = policy_for(_cfg("sync"))
    assert trainer_batch(sync, ready, step=0) == ["g1", "g0", "g2", "g3"]
    assert trainer_batch(sync, ready[:4], step=0) is None
    assert trainer_batch(sync, ready, step=1) is None
    # the version a group may start on: sync b, one_step b-1, laminar any
    assert [min_version(sync, p) for p in (0, 3, 4, 9)] == [0, 0, 1, 2]
    assert [min_version(policy_for(_cfg("one_step")), p) for p in (0, 4, 9)] == [0, 0, 1]
    assert min_version(policy_for(_cfg("laminar")), 99) == 0
    # stream, 2 minibatches of 2 groups: step 0 takes the first two complete groups of batch 0, step 1 the
    # other two; steps 2 and 3 are batch 1 (version 1)
    stream = policy_for(_cfg("stream", "trainer.minibatches=2"))
    assert trainer_batch(stream, [("g1", 1), ("g5", 5)], step=0) is None
    assert trainer_batch(stream, ready, step=0) == ["g1", "g0"]
    assert trainer_batch(stream, [("g2", 2), ("g3", 3), ("g5", 5)], step=1) == ["g2", "g3"]
    assert trainer_batch(stream, [("g5", 5), ("g4", 4)], step=2) == ["g5", "g4"]
    assert [version_of(stream, s) for s in range(5)] == [0, 0, 1, 1, 2]


def test_replica_decisions() -> None:
    lam, pr = policy_for(_cfg("laminar")), policy_for(_cfg("partial_rollout"))
    assert not may_start(lam, 0, None, False)  # no weights
    assert not may_start(lam, 0, 3, True) and may_start(lam, 0, 3, False)  # a newer version waits: drain
    assert may_start(pr, 0, 3, True)  # partial rollout never drains
    assert not may_start(policy_for(_cfg("sync")), 2, 1, False)  # batch 2 needs version 2
    assert load_action(lam, 3, 4, in_flight=5) == "" and load_action(lam, 3, 4, in_flight=0) == "load"
    assert load_action(pr, 3, 4, in_flight=5) == "interrupt" and load_action(pr, 4, 4, in_flight=5) == ""
    assert load_action(lam, None, 0, in_flight=0) == "load" and load_action(lam, None, None, 0) == ""


def _simulate(cfg: RunConfig, seed: int, steps: int = 12) -> list[int]:
    """Drive the real Ledger with the policy: 3 replicas (4 groups each) start, finish and load versions in a
    random order; the trainer steps when the policy gives it a batch and publishes version = steps done.
    Returns the staleness (trainer version - version the group started on) of every consumed group."""
    rng = random.Random(seed)
    policy = policy_for(cfg)
    ledger = Ledger(RunState(run_id="r"))
    replicas = {f"r{i}": {"version": 0, "pending": [], "running": {}} for i in range(3)}
    started_on: dict[str, int] = {}
    staleness: list[int] = []
    seq = 0
    while ledger.state.step < steps:
        rid = rng.choice(sorted(replicas))
        r = replicas[rid]
        newest = ledger.state.policy_version
        if load_action(policy, r["version"], newest, len(r["running"])):  # every loop turn, as the replica does
            r["version"] = newest
        action = rng.random()
        if action < 0.4:  # claim
            room = cfg.rollout.max_ready_groups - len(ledger.state.ready)
            fresh = fresh_lease_room(policy, ledger.state.prompt_cursor, newest, ledger.state.groups_generated)
            want = 4 - len(r["running"]) - len(r["pending"])
            r["pending"] += ledger.lease(rid, max(0, min(want, room)), fresh)
        elif action < 0.7:  # start what may start
            for lease in list(r["pending"]):
                if may_start(policy, min_version(policy, lease.prompt_id), r["version"], newest > r["version"]):
                    r["pending"].remove(lease)
                    r["running"][lease.group_id] = lease
                    started_on[lease.group_id] = r["version"]
                    # generation never runs more than `lookahead` batches ahead of the version it starts on
                    assert policy.lookahead is None or lease.prompt_id // 4 <= r["version"] + policy.lookahead
        elif r["running"]:  # finish one group
            g = rng.choice(sorted(r["running"]))
            del r["running"][g]
            seq += 1
            ledger.add_segment(SegmentRef(key=f"s{seq}", sha256="", size=0, rows=8, group_ids=[g],
                                          policy_version=started_on[g]), rid)
        ids = ledger.trainable(policy)
        if ids is not None:  # the trainer steps at once (its duration is not what this test is about)
            staleness += [version_of(policy, ledger.state.step) - started_on[g] for g in ids]
            inp = _input(ledger, ledger.batch_parts(ids))
            step = ledger.state.step + 1
            ledger.commit_step(inp, replace(_result(step), policy_version=version_of(policy, step)), keep_last=3)
    return staleness


@pytest.mark.parametrize("mode,bound", [("sync", 0), ("one_step", 1), ("stream", 1)])
def test_every_consumed_group_keeps_its_modes_staleness_promise(mode: str, bound: int) -> None:
    cfg = _cfg(mode, "rollout.max_ready_groups=16", "trainer.minibatches=2")
    for seed in range(20):
        staleness = _simulate(cfg, seed)
        assert staleness and max(staleness) <= bound, (seed, staleness)
    if mode == "sync":
        assert set(staleness) == {0}


def test_laminar_staleness_is_not_bounded_by_the_policy_but_nothing_is_lost() -> None:
    cfg = _cfg("laminar", "rollout.max_ready_groups=16")
    staleness = _simulate(cfg, seed=1)
    assert len(staleness) == 12 * 4 and min(staleness) >= 0


def test_partial_rollout_leases_at_most_its_bound_ahead() -> None:
    """A group starts at most 4 batches ahead of its replica's version (checked inside _simulate); a long group
    may still finish staler than that under FIFO consumption: the trainer drops those (rl.grpo.split_stale with
    staleness_bound), so what it trains on keeps the bound."""
    for seed in range(20):
        assert _simulate(_cfg("partial_rollout", "rollout.max_ready_groups=16"), seed)
