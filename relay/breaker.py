"""A circuit breaker per relay address, shared by every caller in the process (the trainer's pushes, a host's
rollout replicas, a relay's forwarder).

A relay that is alive and heartbeating but unreachable on its data plane (its port's packets dropped, a wedged
server) costs each caller a connect timeout. The breaker makes that cost once per process, not once per call:

    closed ──one failure──> open ──backoff elapsed, a caller probes──> half-open
       ^                     ^                                           │
       └─────probe passed────┼───────────────────────────────────────────┘
                             └─────probe failed: open again, backoff doubled (up to max_backoff_s)

- closed: the relay is used.
- open: every caller skips it at once (`usable` is False); after `backoff_s` one caller may probe it.
- half-open: one probe is in flight; the others still skip it. A probe that never reports (its caller died) is
  given up after `probe_timeout_s`, and the next caller may probe again.

`Breaker` is a pure state machine: each method takes the time `now` and returns the new state; nothing here reads
a clock or sleeps. `Breakers` is the process-wide registry: a lock, an injected clock (time.monotonic by default)
and, optionally, a probe function it runs on a background thread when an open breaker's backoff has elapsed, so
that no caller blocks on a probe of a relay that may still be dead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
State = Literal["closed", "open", "half_open"]

BASE_BACKOFF_S = 1.0  # the first probe of a relay that failed comes this long after the failure
MAX_BACKOFF_S = 8.0  # probes back off 1, 2, 4, 8, 8 ... s: a healed relay is found again within 8 s
PROBE_TIMEOUT_S = 10.0  # a half-open probe that never reported is given up after this


@dataclass(frozen=True)
class Breaker:
    """One relay address's breaker. `failures`: consecutive failures (0 when closed); `retry_at`: when an open
    breaker may be probed; `probe_at`: when the half-open probe started."""

    state: State = CLOSED
    failures: int = 0
    retry_at: float = 0.0
    probe_at: float = 0.0
    base_backoff_s: float = BASE_BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S
    probe_timeout_s: float = PROBE_TIMEOUT_S

    def backoff_s(self, failures: int) -> float:
        """Wait before the probe after `failures` consecutive failures: base * 2^(failures-1), capped."""
        return min(self.max_backoff_s, self.base_backoff_s * 2 ** max(0, failures - 1))

    def usable(self) -> bool:
        """A caller may send real work to the relay (only when closed)."""
        return self.state == CLOSED

    def probe_due(self, now: float) -> bool:
        """A caller may start a probe now: open and backed off long enough, or a half-open probe given up."""
        return ((self.state == OPEN and now >= self.retry_at)
                or (self.state == HALF_OPEN and now - self.probe_at >= self.probe_timeout_s))

    def start_probe(self, now: float) -> Breaker:
        if not self.probe_due(now):
            raise ValueError(f"breaker in state {self.state}: no probe is due at {now} (retry_at {self.retry_at})")
        return replace(self, state=HALF_OPEN, probe_at=now)

    def success(self, now: float) -> Breaker:
        """The relay answered (a probe or real work): closed."""
        return replace(self, state=CLOSED, failures=0, retry_at=0.0, probe_at=0.0)

    def failure(self, now: float) -> Breaker:
        """The relay failed (connect or idle timeout, reset, refusal of the connection): open, with the backoff
        of one more consecutive failure."""
        failures = self.failures + 1
        return replace(self, state=OPEN, failures=failures, retry_at=now + self.backoff_s(failures), probe_at=0.0)


Probe = Callable[[str], object]  # raises (any Exception) when the relay fails the check


class Breakers:
    """The process-wide registry: one Breaker per relay address, thread-safe, clock injected."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, *, base_backoff_s: float = BASE_BACKOFF_S,
                 max_backoff_s: float = MAX_BACKOFF_S, probe_timeout_s: float = PROBE_TIMEOUT_S,
                 start_thread: Callable[[Callable[[], None]], None] | None = None) -> None:
        if not 0 < base_backoff_s <= max_backoff_s:
            raise ValueError(f"breaker backoff: base_backoff_s={base_backoff_s} and max_backoff_s={max_backoff_s} "
                             "must satisfy 0 < base <= max")
        self._clock = clock
        self._lock = threading.Lock()
        self._breakers: dict[str, Breaker] = {}
        self._new = Breaker(base_backoff_s=base_backoff_s, max_backoff_s=max_backoff_s,
                            probe_timeout_s=probe_timeout_s)
        self._start_thread = start_thread or _daemon_thread

    def get(self, addr: str) -> Breaker:
        with self._lock:
            return self._breakers.get(addr, self._new)

    def state(self, addr: str) -> State:
        return self.get(addr).state

    def usable(self, addr: str, probe: Probe | None = None) -> bool:
        """Whether to send real work to addr now. When it is not usable and its probe is due, `probe(addr)` runs on
        a background thread (the caller does not wait) and its outcome is recorded."""
        with self._lock:
            b = self._breakers.get(addr, self._new)
            if b.usable():
                return True
            if probe is None or not b.probe_due(self._clock()):
                return False
            self._breakers[addr] = b.start_probe(self._clock())
        self._start_thread(lambda: self._run_probe(addr, probe))
        return False

    def check(self, addr: str, probe: Probe) -> None:
        """Have addr checked (a relay out of the chain, whose state this process may not know yet): a background
        probe when it has no breaker here yet, or when its probe is due. The outcome lands in its breaker."""
        with self._lock:
            b = self._breakers.get(addr)
            now = self._clock()
            if b is None:
                self._breakers[addr] = replace(self._new, state=HALF_OPEN, probe_at=now)
            elif b.probe_due(now):
                self._breakers[addr] = b.start_probe(now)
            else:
                return
        self._start_thread(lambda: self._run_probe(addr, probe))

    def passed(self, addr: str) -> bool:
        """addr has a breaker here and it is closed: its last check or call succeeded."""
        with self._lock:
            b = self._breakers.get(addr)
            return b is not None and b.usable()

    def _run_probe(self, addr: str, probe: Probe) -> None:
        try:
            probe(addr)
        except Exception:  # noqa: BLE001 - any failure of the check opens the breaker again
            self.failure(addr)
            return
        self.success(addr)

    def success(self, addr: str) -> None:
        with self._lock:
            self._breakers[addr] = self._breakers.get(addr, self._new).success(self._clock())

    def failure(self, addr: str) -> None:
        with self._lock:
            self._breakers[addr] = self._breakers.get(addr, self._new).failure(self._clock())

    def failing(self, addrs: list[str]) -> list[str]:
        """Those of addrs whose breaker is not closed."""
        with self._lock:
            return [a for a in addrs if a in self._breakers and not self._breakers[a].usable()]

    def clear(self) -> None:
        with self._lock:
            self._breakers.clear()


def _daemon_thread(fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, name="relay-breaker-probe", daemon=True).start()


BREAKERS = Breakers()  # this process's: the trainer, a host's rollout replicas and a relay's forwarder share it
