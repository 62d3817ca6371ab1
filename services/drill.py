"""Recovery drills: which process receives a fault, and how a drill report is worked out.

Pure functions over run status snapshots (`RunStatus`), Temporal's view of pending activities and the
completion times of the run's steps, so the arithmetic is unit-tested without a cluster. Everything a
report uses is durable and complete whatever the run's speed: the workflow keeps the last few events of
each (kind, subject) across continue-as-new, and step completion times come from the per-step metric
records in the store (one per step, never a bounded window). Times are Unix seconds; the workflow records
events in workflow time (the server's clock) and the trainer stamps step records with its own clock, on
the same machine.

How each fault is detected and when it counts as recovered:

| fault        | detected at                                              | recovered at                                            |
|--------------|----------------------------------------------------------|---------------------------------------------------------|
| rollout      | the replica activity's heartbeat timeout (its retry)      | the retried replica's first complete group              |
| relay        | the relay activity's heartbeat timeout, or its new incarnation joining (`relay_lost`) | the first trainer step published to the rebuilt chain (with one relay: after it re-joined) |
| master-relay | as relay                                                  | as relay (the next relay is the new master)             |
| trainer      | the train_step heartbeat timeout (its retry)              | the first step completed by the restored trainer        |
| control      | at injection (workflow tasks wait in their queue)         | the first step the workflow scheduled after the fault, completed |
| store        | at injection (every store call retries with backoff)      | the first trainer step after the store is back          |
"""

from __future__ import annotations

from dataclasses import dataclass

from laminar import names
from laminar.errors import ConfigError
from laminar.messages import FAULTS, DrillReport, RunStatus


@dataclass
class ActivityView:
    """What the drill needs of one pending activity (from `describe`)."""

    activity_id: str
    activity_type: str
    attempt: int
    last_attempt_complete_time: float | None


def resolve_target(fault: str, target: str, status: RunStatus, during: str = "") -> tuple[str, str]:
    """(target, process name) for a fault against the live run; ConfigError naming what exists.
    during="migration": a rollout fault goes to the source of the first pending repack migration."""
    if fault not in FAULTS:
        raise ConfigError(f"--fault {fault!r} is not one of {', '.join(FAULTS)}")
    if during not in ("", "migration"):
        raise ConfigError(f"--during {during!r}: use migration (or leave it out)")
    if fault == "rollout":
        replicas = {r.replica_id: r for r in status.replicas}
        if not replicas:
            raise ConfigError(f"run {status.run_id} has no rollout replica reporting yet; try --at-step 1")
        source = status.migrating[0].split("->", 1)[0] if during == "migration" and status.migrating else ""
        chosen = target or source or max(replicas.values(), key=lambda r: (r.in_flight, r.replica_id)).replica_id
        if chosen not in replicas:
            raise ConfigError(f"--target {chosen!r}: run {status.run_id} has replicas {sorted(replicas)}")
        return chosen, f"rollout-{replicas[chosen].host_id}"
    if fault in ("relay", "master-relay"):
        chain = [r.relay_id for r in status.relays]
        if not chain:
            raise ConfigError(f"run {status.run_id} has no relay in its chain")
        chosen = chain[0] if fault == "master-relay" else (target or chain[-1])
        if chosen not in chain:
            raise ConfigError(f"--target {chosen!r}: the chain of run {status.run_id} is {chain}")
        if fault == "master-relay" and target and target != chosen:
            raise ConfigError(f"--target {target!r} is not the master relay; the master is {chosen}")
        return chosen, f"relay-{chosen}"
    return fault, fault  # trainer, control, store: one of each


def detected_at(fault: str, target: str, injected_at: float, status: RunStatus,
                activities: list[ActivityView]) -> float | None:
    """When the control plane noticed the fault, or None if it has not yet."""
    if fault in ("control", "store"):
        return injected_at
    if fault in ("relay", "master-relay"):
        return _first_event(status, "relay_lost", target, injected_at)
    wanted = f"rollout-{target}" if fault == "rollout" else None
    for a in activities:
        mine = a.activity_id == wanted if wanted else a.activity_type in (names.TRAIN_STEP, names.TRAIN_STEPS)
        if mine and a.attempt > 1 and a.last_attempt_complete_time and a.last_attempt_complete_time >= injected_at:
            return a.last_attempt_complete_time
    if fault == "rollout":  # the retry may already have claimed (and the pending view moved on)
        return _first_event(status, "replica_rejoined", target, injected_at)
    return _first_event(status, "trainer_restored", "trainer", injected_at)


def recovered_at(fault: str, target: str, injected_at: float, detected: float | None, status: RunStatus,
                 step_times: list[float], chain_len: int) -> float | None:
    """When the run was whole again, or None. step_times: completion times of the steps since injection;
    chain_len: relays in the chain before the fault."""
    if detected is None:
        return None
    if fault == "rollout":
        return _first_event(status, "replica_recovered", target, detected)
    after = max(injected_at, detected)
    if fault in ("relay", "master-relay") and chain_len <= 1:  # no chain left until the relay is back
        rejoined = _first_event(status, "relay_joined", target, injected_at)
        if rejoined is None:
            return None
        after = max(after, rejoined)
    return next((t for t in sorted(step_times) if t > after), None)


def trainer_stall_s(step_times: list[float], start: float, end: float) -> float:
    """Longest stretch inside [start, end] with no trainer step completing."""
    marks = [start] + sorted(t for t in step_times if start < t < end) + [end]
    return max((b - a for a, b in zip(marks, marks[1:], strict=False)), default=0.0)


def groups_lost(status: RunStatus) -> int:
    """Prompt groups issued but neither consumed, waiting, leased nor queued for re-lease."""
    accounted = status.groups_consumed + status.ready_groups + status.open_leases + status.returned_leases
    return status.prompts_issued - accounted


def build_report(drill_id: str, fault: str, target: str, injected_at: float, baseline: RunStatus,
                 final: RunStatus, detected: float | None, recovered: float | None, step_times: list[float],
                 observed_until: float, notes: str = "") -> DrillReport:
    """The report. Without recovery the outage lasts until the observation ended, so the stall and the
    steps counted are what really happened up to then (never a window that ends before the fault)."""
    end = recovered if recovered is not None else max(observed_until, injected_at)
    during = sum(1 for t in step_times if injected_at < t < end)
    return DrillReport(
        drill_id=drill_id,
        run_id=final.run_id,
        fault=fault,
        target=target,
        injected_at=round(injected_at, 3),
        detected_at=None if detected is None else round(detected, 3),
        recovered_at=None if recovered is None else round(recovered, 3),
        steps_during_outage=during,
        trainer_stall_s=round(trainer_stall_s(step_times, injected_at, end), 3),
        groups_lost=groups_lost(final),
        groups_consumed_twice=final.groups_consumed_twice - baseline.groups_consumed_twice,
        tokens_regenerated=final.tokens_regenerated - baseline.tokens_regenerated,
        steps_redone=final.steps_redone - baseline.steps_redone,
        recovered=recovered is not None,
        notes=notes,
    )


def _first_event(status: RunStatus, kind: str, subject: str, after: float) -> float | None:
    return next((t for t in status.event_times.get(f"{kind}/{subject}", []) if t >= after), None)
