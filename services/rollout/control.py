"""The control-call scheduler: claims and reports to the workflow, one at a time on the replica's control
thread (the engine keeps generating during a round trip), and when the next one is due."""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Protocol

from laminar import metrics as prom
from laminar.contract import AddExperienceInput, AddExperienceResult, ClaimPromptsInput, ClaimPromptsResult
from laminar.services.rollout.timing import ReplicaTiming
from laminar.timing import TimeBreakdown


class ControlPort(Protocol):
    """What the replica needs from the control plane (Temporal updates in production)."""

    def claim(self, inp: ClaimPromptsInput) -> ClaimPromptsResult: ...
    def add_experience(self, inp: AddExperienceInput) -> AddExperienceResult: ...
    def heartbeat(self, details: dict) -> None: ...
    def cancelled(self) -> bool: ...


class ControlCalls:
    """The control call in flight ("claim" | "report"), run on the control thread in the activity's context
    (its heartbeats and cancellation); its answer is collected by the loop, in order."""

    def __init__(self, replica_id: str, segment_prefix: str, profile: TimeBreakdown,
                 metrics: prom.ReplicaMetrics) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"control-{replica_id}")
        self._call: tuple[str, Future] | None = None
        self.last = ""  # kind of the last call started
        self.claiming = False  # the call in flight is a claim, or a report that carries one
        self.segment_prefix, self.profile, self.metrics, self.claims = segment_prefix, profile, metrics, 0

    @property
    def kind(self) -> str | None:
        return None if self._call is None else self._call[0]

    def request_id(self) -> str:
        self.claims += 1
        return f"{self.segment_prefix}-c{self.claims}"

    def start(self, kind: str, fn: Callable, *args, claiming: bool | None = None) -> None:
        clock, t0 = self.profile.clock, self.profile.clock()
        self.claiming = kind == "claim" if claiming is None else claiming

        def timed():
            return fn(*args), clock() - t0

        self._call = (kind, self._thread.submit(contextvars.copy_context().run, timed))
        self.last = kind

    def collect(self, wait: bool) -> tuple[str, ClaimPromptsResult | AddExperienceResult] | None:
        """The answer of the call in flight once done (or waiting for it); a failed call raises here."""
        if self._call is None or not (wait or self._call[1].done()):
            return None
        kind, future = self._call
        with self.profile.measure("wait_control"):
            res, latency = future.result()
        self._call, self.claiming = None, False
        self.profile.latency(kind, latency)
        self.metrics.update(kind, latency)
        return kind, res

    def wait(self, timeout_s: float) -> None:
        """Wait up to timeout_s for the call in flight to answer; sleep it when none is."""
        if self._call is not None:
            wait_futures([self._call[1]], timeout=timeout_s)
        else:
            time.sleep(timeout_s)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


@dataclass
class Contacts:
    """When the next claim or report is due (clock-free: the loop passes the time). Control traffic is
    bounded by work: see services/rollout/__init__.py."""

    timing: ReplicaTiming
    max_inflight_groups: int
    last_claim: float = 0.0  # when the replica last contacted the workflow (a report is a contact)
    claim_every: float = 0.0  # the claim back-off (ReplicaTiming.next_claim_interval)
    asked: int = 0  # groups the claim in flight asked for
    trainer_starved: bool = False  # the last answer said the trainer waits for groups: report at once
    # The last claim came back empty while the run was at this version (not paused): what frees prompts (the
    # trainer's next step: a barrier's next batch, the staleness bound, room under max_ready_groups) comes with
    # a newer version, so the replica claims again as soon as one reaches its relay, whatever its back-off.
    wake_after: int | None = None
    woke_for: int = -1  # the relay version the last such claim went out for (one per version)

    def claim_due(self, now: float, want: int, groups: int, completed: int, waiting: bool, holding: bool,
                  urgent: bool, relay_version: int | None = None) -> bool:
        """want: free group slots; waiting: busy, without weights, or holding for a migration (learn of
        hand-overs and relays that join later); urgent: a repack hand-off or acknowledgement to send;
        relay_version: the newest version its relay holds (None: unknown)."""
        t = self.timing
        enough = 1 if not groups else min(t.claim_min_groups, self.max_inflight_groups)
        return (want >= enough and (now - self.last_claim >= self.claim_every or self.woken(relay_version))) or (
            waiting and not completed and now - self.last_claim >= (t.claim_poll_s if holding else t.contact_s)
        ) or urgent

    def awaited_version(self) -> int | None:
        """The relay version that would wake this starved replica (poll the relay often until then), or None."""
        return None if self.wake_after is None else max(self.wake_after, self.woke_for) + 1

    def woken(self, relay_version: int | None) -> bool:
        awaited = self.awaited_version()
        return awaited is not None and relay_version is not None and relay_version >= awaited

    def claiming(self, relay_version: int | None) -> None:
        """A claim goes out: one that a new version woke starts the back-off over (claim_poll_s if it comes back
        empty: the relay can hold the version a moment before the workflow has committed its step)."""
        if self.woken(relay_version):
            assert relay_version is not None
            self.woke_for, self.claim_every = relay_version, 0.0

    def report_due(self, now: float, groups: int, completed: int, completed_since: float) -> bool:
        t = self.timing
        return completed >= t.report_min_groups or completed > 0 and (
            not groups or self.trainer_starved or now - completed_since >= t.report_max_wait_s)

    def claimed(self, got: int, paused: bool, run_version: int) -> None:
        """A claim's answer: `got` leases for the `asked`, the run's version (its trainer's newest) in it."""
        self.claim_every = self.timing.next_claim_interval(self.claim_every, self.asked, got, paused)
        if got or paused:
            self.wake_after = None
        elif self.asked:
            self.wake_after = run_version
