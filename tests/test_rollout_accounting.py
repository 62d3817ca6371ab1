"""Rollout replica bookkeeping that needs no engine: regenerated tokens and the claim back-off."""

from __future__ import annotations

from services.rollout import (
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
    # empty claims double the interval: 0.5 -> 1 -> 2, capped at 2 s while idle (back-pressure)...
    intervals = [CLAIM_POLL_S]
    for _ in range(4):
        intervals.append(_next_claim_interval(intervals[-1], wanted=2, got=0, paused=False))
    assert intervals == [0.5, 1.0, 2.0, IDLE_CLAIM_MAX_S, IDLE_CLAIM_MAX_S]
    # ... and at 10 s while paused: 0.5, 1, 2, 4, 8, 10
    paused = [CLAIM_POLL_S]
    for _ in range(5):
        paused.append(_next_claim_interval(paused[-1], wanted=2, got=0, paused=True))
    assert paused == [0.5, 1.0, 2.0, 4.0, 8.0, PAUSED_CLAIM_MAX_S]
    # leases came: back to polling every 0.5 s; a claim that asked for nothing leaves the interval alone
    assert _next_claim_interval(8.0, wanted=2, got=1, paused=False) == CLAIM_POLL_S
    assert _next_claim_interval(4.0, wanted=0, got=0, paused=True) == 4.0
