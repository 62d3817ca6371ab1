"""The watchdog for silent waits: why a running run's trainer has taken no step (docs/architecture/failures.md,
'The watchdog').

Pure and clock-free: `diagnose` takes the run state's facts, with every age already worked out by the caller
(workflow time in the workflow, the status's own clock in `laminar status`), and names what the run waits for:

- "weights":  a replica still has no policy version (-1) after run.stall_warn_s, or no relay joined;
- "trainer":  the trainer is not initialised, a step is in flight for too long, or a batch is ready and unused;
- "replicas": no replica reported within run.stall_warn_s (their worker is stopped or gone), or the run's slot pool
  grants it fewer replicas than it asks (workflows/pool.py: the pool's reason is named);
- "groups":   replicas report, but not enough complete groups for the next batch came.

None while the run is healthy (a step within run.stall_warn_s, every replica versioned), paused or closing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Facts:
    phase: str  # starting | running | paused | stopping | finished | failed
    idle_s: float  # since the last step (or since the run or its trainer started, before the first)
    stall_warn_s: float
    trainer_ready: bool = True
    training: bool = False  # a train step is in flight
    has_batch: bool = False  # the run mode's policy has a batch for the trainer
    ready_groups: int = 0
    open_leases: int = 0
    relays_joined: int = 0
    replicas_wanted: int = 0
    silent_s: dict[str, float] = field(default_factory=dict)  # replica -> seconds since its last report
    unversioned_s: dict[str, float] = field(default_factory=dict)  # replica -> seconds at policy_version -1
    replicas_granted: int = -1  # slots its pool granted the run (-1: not in a pool)
    grant_note: str = ""  # the pool's reason when that is less than replicas_wanted


def diagnose(f: Facts) -> tuple[str, str] | None:
    """(waits_for, reason naming the numbers), or None."""
    warn = f.stall_warn_s
    if f.phase not in ("starting", "running"):
        return None
    reporting = sorted(r for r, s in f.silent_s.items() if s < warn)
    if f.phase == "starting" or not f.trainer_ready:
        if f.idle_s < warn:
            return None
        if f.relays_joined == 0:
            return "weights", f"no relay joined in {f.idle_s:.0f}s: the trainer has nowhere to publish version 0"
        return "trainer", f"trainer not initialised after {f.idle_s:.0f}s ({f.relays_joined} relays joined)"
    stuck = sorted((r, s) for r, s in f.unversioned_s.items() if s >= warn and r in reporting)
    if stuck:
        names = ", ".join(f"{r} ({s:.0f}s)" for r, s in stuck)
        return "weights", (f"{len(stuck)} replica(s) report no policy version (-1) after run.stall_warn_s="
                           f"{warn:g}s: {names}")
    if f.idle_s < warn:
        return None
    if f.training:
        return "trainer", f"no step for {f.idle_s:.0f}s: a train step is in flight"
    if f.has_batch:
        return "trainer", f"no step for {f.idle_s:.0f}s with a batch ready ({f.ready_groups} ready groups)"
    if 0 <= f.replicas_granted < f.replicas_wanted or (f.replicas_granted < 0 and f.grant_note):
        return "replicas", f"no step for {f.idle_s:.0f}s: {f.grant_note or 'no grant from the slot pool'}"
    if not reporting:
        return "replicas", (f"no step for {f.idle_s:.0f}s: 0 of {f.replicas_wanted} replicas reported in the "
                            f"last {warn:g}s ({f.ready_groups} ready groups, {f.open_leases} leases in flight)")
    return "groups", (f"no step for {f.idle_s:.0f}s: {f.ready_groups} ready groups are not a batch, "
                      f"{f.open_leases} leases in flight, {len(reporting)} of {f.replicas_wanted} replicas reporting")


def facts_of_status(st: Any, now: float) -> Facts:
    """The facts of a RunStatus (laminar/contract.py) at time `now` (the same clock as its `at` times)."""
    since = st.last_step_at if st.last_step_at is not None else st.trainer_ready_at
    return Facts(
        phase=st.phase,
        idle_s=max(0.0, now - (since if since is not None else st.started_at)),
        stall_warn_s=st.stall_warn_s,
        trainer_ready=st.phase != "starting",
        training=st.training,
        has_batch=st.has_batch,
        ready_groups=st.ready_groups,
        open_leases=st.open_leases,
        relays_joined=len(st.relays),
        replicas_wanted=st.replicas_wanted,
        silent_s={r: max(0.0, now - at) for r, at in st.replica_seen.items()},
        unversioned_s={r: max(0.0, now - at) for r, at in st.unversioned_since.items()},
        replicas_granted=st.replicas_granted,
        grant_note=st.grant_note,
    )


def stall_line(st: Any, now: float) -> str | None:
    """The status line `laminar status` prints: "waits for <what>: <reason>", or None."""
    if not st.stall_warn_s:  # a status from before the watchdog
        return None
    d = diagnose(facts_of_status(st, now))
    return None if d is None else f"waits for {d[0]}: {d[1]}"
