"""Rollout replica bookkeeping that needs no engine: regenerated tokens and the claim back-off."""

from __future__ import annotations

from laminar.services.rollout import (
    CLAIM_POLL_S,
    IDLE_CLAIM_MAX_S,
    PAUSED_CLAIM_MAX_S,
    _next_claim_interval,
    tokens_lost_with,
)


def test_tokens_lost_after_the_last_flush_come_from_the_dead_attempts_last_heartbeat():
    # the dead attempt wrote its pool, then generated 37 more tokens before its last heartbeat
    assert tokens_lost_with({"policy_version": 4, "in_flight": 16, "unsaved_tokens": 37}) == 37
    assert tokens_lost_with({}) == 0  # a first attempt has no previous heartbeat
    assert tokens_lost_with({"waiting_for": "claim_prompts"}) == 0  # beat while waiting on the control plane


def test_claims_back_off_while_empty_and_snap_back_when_work_comes():
    # while leases come, the next claim goes as soon as slots are free (interval 0); empty claims start the
    # back-off at 0.1 s and double: 0.1 -> 0.2 -> 0.4 -> 0.8 -> 1.6, capped at 2 s while idle (back-pressure)...
    intervals = [0.0]
    for _ in range(7):
        intervals.append(_next_claim_interval(intervals[-1], wanted=2, got=0, paused=False))
    assert CLAIM_POLL_S == 0.1 and IDLE_CLAIM_MAX_S == 2.0
    assert intervals == [0.0, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    # ... and at 10 s while paused: ... 1.6, 3.2, 6.4, 10
    paused = [0.0]
    for _ in range(8):
        paused.append(_next_claim_interval(paused[-1], wanted=2, got=0, paused=True))
    assert paused == [0.0, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, PAUSED_CLAIM_MAX_S]
    # leases came: claim again at once; a claim that asked for nothing leaves the interval alone
    assert _next_claim_interval(8.0, wanted=2, got=1, paused=False) == 0.0
    assert _next_claim_interval(4.0, wanted=0, got=0, paused=True) == 4.0
