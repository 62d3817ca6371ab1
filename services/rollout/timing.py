"""Every interval and threshold of the replica loop, in one place (services/rollout/__init__.py says why each)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaTiming:
    version_poll_s: float = 0.5  # how often the replica asks its relay for the newest version
    version_wait_poll_s: float = 0.02  # ... while its leases wait for a version it does not hold yet (barrier modes)
    claim_poll_s: float = 0.1  # a replica with free slots asks again this long after an empty claim (then doubling)
    contact_s: float = 1.0  # a busy replica with no free slot still reports this often (hand-over, stop)
    idle_claim_max_s: float = 2.0  # an empty claim doubles the interval up to this (back-pressure, no weights yet)
    paused_claim_max_s: float = 10.0  # ... and up to this while the run is paused
    claim_min_groups: int = 2  # a replica with groups in flight claims once this many group slots are free ...
    report_min_groups: int = 2  # ... and reports once this many groups are complete or the oldest waited
    report_max_wait_s: float = 0.25  # this long: each update costs the workflow a task, which delays the
    # trainer's next step (no wait at all while the last answer said the trainer is starved: then the wait
    # would be the trainer's)
    heartbeat_every_s: float = 0.2  # the loop heartbeats at most this often (a beat costs ~1.6 ms: thread hop)
    profile_every_s: float = 5.0  # how often the replica writes its time breakdown to the store (and at return)
    idle_wait_s: float = 0.05  # an idle turn waits this long for the control call in flight (or sleeps it)

    def next_claim_interval(self, current: float, wanted: int, got: int, paused: bool) -> float:
        """Claim again as soon as slots are free while work comes; back off (doubling from claim_poll_s) while
        claims come back empty."""
        if got > 0:
            return 0.0
        if wanted == 0:
            return current
        return min(self.paused_claim_max_s if paused else self.idle_claim_max_s, max(self.claim_poll_s, current * 2))


TIMING = ReplicaTiming()
