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
    heartbeat_max_s: float = 5.0  # ... and at least this often: a cancellation reaches an activity in a beat's answer
    profile_every_s: float = 5.0  # how often the replica writes its time breakdown to the store (and at return)
    idle_wait_s: float = 0.05  # an idle turn waits this long for the control call in flight (or sleeps it)
    # a refused or aborted update (the server's limit on updates in flight per workflow, a workflow task that
    # failed, a continue-as-new under way) is sent again after a jittered delay doubling from this ... up to this
    # (activities/rollout.py): a start-up or hand-over storm drains in tenths of a second, an outage still waits 2 s
    update_retry_base_s: float = 0.05
    update_retry_max_s: float = 2.0

    def next_claim_interval(self, current: float, wanted: int, got: int, paused: bool) -> float:
        """Claim again as soon as slots are free while work comes; back off (doubling from claim_poll_s) while
        claims come back empty."""
        if got > 0:
            return 0.0
        if wanted == 0:
            return current
        return min(self.paused_claim_max_s if paused else self.idle_claim_max_s, max(self.claim_poll_s, current * 2))


    def beat_every_s(self, heartbeat_timeout_s: float) -> float:
        """How often the loop heartbeats: every quarter of the activity's heartbeat timeout (so that a beat delayed
        by a long engine step still lands well within it), at most every heartbeat_every_s and at least every
        heartbeat_max_s (the server hands a cancellation to an activity in the answer to its heartbeat). Each beat
        that reaches the server loads and writes back the run's whole mutable state (a third of a busy server's CPU
        at 160 replicas, docs/benchmarks/control.md), and the worker lets through at most one a second
        (activities/heartbeat.py): a longer rollout.heartbeat_timeout_s is how a run with many replicas trades
        detection time for server CPU."""
        return min(self.heartbeat_max_s, max(self.heartbeat_every_s, heartbeat_timeout_s / 4))

    def update_retry_s(self, retries: int, draw: float) -> float:
        """The wait before sending a refused update again, its `retries`-th retry (0: the first); `draw` uniform in
        [0, 1) (the caller's random source: clock-free and testable). Equal jitter: half the doubling bound plus a
        random share of the other half, so replicas refused together do not come back together."""
        bound = min(self.update_retry_max_s, self.update_retry_base_s * 2 ** max(0, min(retries, 30)))
        return bound / 2 + bound / 2 * min(max(draw, 0.0), 1.0)


TIMING = ReplicaTiming()
