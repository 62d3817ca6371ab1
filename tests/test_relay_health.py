"""workflows/relay_health.py: which relays the chain leaves out for failing data-plane checks (pure, clock-free)."""

from __future__ import annotations

from laminar.workflows.relay_health import RelayHealth

A, B, C = "10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"


def test_a_failing_relay_leaves_the_chain_and_comes_back_when_it_passes():
    h = RelayHealth()
    joined = [A, B, C]
    assert h.chain(joined) == [A, B, C]
    assert h.report(joined, failed=[A], passed=[], now=5.0) == ([A], [])  # the master failed: B is master now
    assert h.chain(joined) == [B, C] and h.relays_out(joined) == [A] and h.out == {A: 5.0}
    assert h.report(joined, failed=[A], passed=[], now=6.0) == ([], [])  # still out, taken out once
    assert h.report(joined, failed=[], passed=[A], now=40.0) == ([], [A])
    assert h.chain(joined) == [A, B, C] and h.relays_out(joined) == []


def test_the_chain_never_empties():
    h = RelayHealth()
    joined = [A, B]
    # Both fail in one report (the reporter itself is cut off): the first goes, the last one stays.
    assert h.report(joined, failed=[A, B], passed=[], now=1.0) == ([A], [])
    assert h.chain(joined) == [B]
    assert h.report(joined, failed=[B], passed=[], now=2.0) == ([], [])
    assert h.chain(joined) == [B]
    assert RelayHealth(out={A: 0.0, B: 0.0}).chain(joined) == [A, B]  # every joined one out: all of them


def test_a_report_that_says_failed_and_passed_keeps_it_out_and_a_relay_that_left_is_forgotten():
    h = RelayHealth()
    joined = [A, B]
    h.report(joined, failed=[A], passed=[], now=1.0)
    assert h.report(joined, failed=[A], passed=[A], now=2.0) == ([], [])
    h.forget(A)  # left (heartbeat timeout) or rejoined with a new address
    assert h.chain(joined) == [A, B]
    assert h.report(joined, failed=[C], passed=[], now=3.0) == ([], [])  # not joined: nothing to take out
