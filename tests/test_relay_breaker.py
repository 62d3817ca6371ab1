"""relay.breaker: the circuit breaker's state machine and the process-wide registry, on a fake clock (no sleeps,
no threads: the registry's probe runs inline through an injected start_thread)."""

from __future__ import annotations

import pytest

from laminar.relay.breaker import CLOSED, HALF_OPEN, OPEN, Breaker, Breakers


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_failure_opens_and_backoff_doubles_to_the_cap():
    b = Breaker(base_backoff_s=1.0, max_backoff_s=8.0)
    assert b.usable()
    b = b.failure(10.0)
    assert (b.state, b.failures, b.retry_at) == (OPEN, 1, 11.0)  # 10 + 1 * 2^0
    assert not b.usable() and not b.probe_due(10.9) and b.probe_due(11.0)
    retry = []
    for _ in range(5):  # the probe fails each time: 2, 4, 8, 8, 8 s after the failure
        at = b.retry_at
        b = b.start_probe(at)
        assert b.state == HALF_OPEN and not b.usable()
        b = b.failure(at)
        retry.append(b.retry_at - at)
    assert retry == [2.0, 4.0, 8.0, 8.0, 8.0]
    b = b.start_probe(b.retry_at).success(0.0)
    assert (b.state, b.failures) == (CLOSED, 0) and b.usable()


def test_a_probe_that_never_reports_is_given_up():
    b = Breaker(probe_timeout_s=10.0).failure(0.0).start_probe(1.0)
    assert not b.probe_due(10.9)  # one probe at a time
    assert b.probe_due(11.0)
    with pytest.raises(ValueError, match="no probe is due"):
        Breaker().start_probe(0.0)  # closed: nothing to probe


def test_registry_skips_a_failed_relay_at_once_and_probes_it_in_the_background_with_backoff():
    clock, probes, started = Clock(), [], []
    reg = Breakers(clock, base_backoff_s=1.0, max_backoff_s=4.0, start_thread=lambda fn: (started.append(1), fn()))
    dead = {"a:1"}

    def probe(addr: str) -> None:
        probes.append((addr, clock.now))
        if addr in dead:
            raise OSError("timed out")

    assert reg.usable("a:1", probe) and reg.usable("b:1", probe)  # unknown addresses are closed
    reg.failure("a:1")  # one failed attempt (at t=100)
    assert not reg.usable("a:1", probe) and probes == []  # skipped at once, no probe before the backoff
    assert reg.failing(["a:1", "b:1", "c:1"]) == ["a:1"]
    clock.now = 101.0  # backoff 1 s elapsed: the next caller still skips it, and a probe runs (it fails)
    assert not reg.usable("a:1", probe)
    assert probes == [("a:1", 101.0)] and reg.state("a:1") == OPEN
    clock.now = 102.9  # next probe 2 s after the failed one (101 + 2 = 103)
    assert not reg.usable("a:1", probe) and len(probes) == 1
    clock.now = 103.0
    dead.clear()  # healed
    assert not reg.usable("a:1", probe)  # this caller skips; the probe it started passes
    assert probes[-1] == ("a:1", 103.0) and reg.state("a:1") == CLOSED
    assert reg.usable("a:1", probe) and reg.passed("a:1") and reg.failing(["a:1"]) == []
    assert len(started) == 2


def test_check_probes_a_relay_this_process_never_used():
    clock, probes = Clock(), []
    reg = Breakers(clock, start_thread=lambda fn: fn())
    assert not reg.passed("x:1")  # no verdict yet: not reported as passing
    reg.check("x:1", lambda a: probes.append(a))
    assert probes == ["x:1"] and reg.passed("x:1")
    reg.check("x:1", lambda a: probes.append(a))  # closed: nothing to check
    assert probes == ["x:1"]
    reg.failure("x:1")
    reg.check("x:1", lambda a: probes.append(a))  # open, backoff not elapsed
    assert probes == ["x:1"] and not reg.passed("x:1")


def test_bad_backoff_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="0 < base <= max"):
        Breakers(base_backoff_s=5.0, max_backoff_s=1.0)
