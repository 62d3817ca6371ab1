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
| preempt      | at injection (the notice is the warning: the process says it goes) | rollout: as rollout; relay: the first trainer step after its new incarnation joined the chain; trainer: the first step of the restored trainer |

`preempt` sends the notice (SIGTERM) instead of SIGKILL to the process of `--target ROLE[:ID]`; the rules above
use its kind, "preempt-<role>" (rule_kind).

Throughput restored (throughput_restored_at): the baseline is the trainer's mean tokens/s over the minute before
the fault (from its step records: tokens and completion time); the run is back at the end of the first sliding
window wholly after the fault whose tokens/s is at least 90 % of it. The window is 5 of the mean step intervals
before the fault, at least 10 s. A run that stepped for less than 10 s before the fault has no baseline (its first
steps are a burst on groups made before them), and its report says so instead of a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from laminar import contract
from laminar.contract import FAULTS, PREEMPT_ROLES, DrillReport, RunStatus
from laminar.errors import ConfigError

THROUGHPUT_WINDOW_S = 10.0  # the sliding window of throughput_restored_at: at least this long ...
THROUGHPUT_WINDOW_STEPS = 5  # ... and at least this many of the steps before the fault (one step is no rate)
THROUGHPUT_BEFORE_S = 60.0  # the baseline: the trainer's mean tokens/s over this long before the fault
THROUGHPUT_FRACTION = 0.9  # back when the window's tokens/s is at least this fraction of the baseline
# no baseline from a run that stepped for less than this before the fault: its first steps train on the groups made
# before its first one, a burst no steady run reaches (a relay drill 0.8 s into a run measured 651 tokens/s against
# a steady 454-508, and never saw its throughput back)
THROUGHPUT_BASELINE_MIN_S = THROUGHPUT_WINDOW_S


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
    if fault == "preempt":
        role, ident = parse_preempt_target(target)
        return resolve_target(role, ident, status, during)
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


def parse_preempt_target(target: str) -> tuple[str, str]:
    """`--target ROLE[:ID]` of a preempt drill: (role, id or ""); ConfigError naming the roles otherwise."""
    role, _, ident = target.partition(":")
    if role not in PREEMPT_ROLES or (role == "trainer" and ident):
        raise ConfigError(f"--fault preempt --target {target!r}: use one of {', '.join(PREEMPT_ROLES)} "
                          f"(rollout and relay may name one: rollout:replica-1, relay:host-0)")
    return role, ident


def rule_kind(fault: str, process: str) -> str:
    """The detection and recovery rules a fault follows: its own, or for preempt "preempt-<role>", the role
    taken from the process that receives the notice (rollout-<host>, relay-<host>, trainer)."""
    return f"preempt-{process.split('-', 1)[0]}" if fault == "preempt" else fault


def detected_at(fault: str, target: str, injected_at: float, status: RunStatus,
                activities: list[ActivityView]) -> float | None:
    """When the control plane noticed the fault, or None if it has not yet. fault: rule_kind's."""
    if fault in ("control", "store") or fault.startswith("preempt-"):
        return injected_at
    if fault in ("relay", "master-relay"):
        return _first_event(status, "relay_lost", target, injected_at)
    wanted = f"rollout-{target}" if fault == "rollout" else None
    for a in activities:
        mine = a.activity_id == wanted if wanted else a.activity_type in (contract.TRAIN_STEP, contract.TRAIN_STEPS)
        if mine and a.attempt > 1 and a.last_attempt_complete_time and a.last_attempt_complete_time >= injected_at:
            return a.last_attempt_complete_time
    if fault == "rollout":  # the retry may already have claimed (and the pending view moved on)
        return _first_event(status, "replica_rejoined", target, injected_at)
    return _first_event(status, "trainer_restored", "trainer", injected_at)


def recovered_at(fault: str, target: str, injected_at: float, detected: float | None, status: RunStatus,
                 step_times: list[float], chain_len: int) -> float | None:
    """When the run was whole again, or None. step_times: completion times of the steps since injection;
    chain_len: relays in the chain before the fault. fault: rule_kind's."""
    if detected is None:
        return None
    if fault == "preempt-trainer":  # the successor's first step commits as restored (from the deadline checkpoint)
        return _first_event(status, "trainer_restored", "trainer", injected_at)
    if fault == "preempt-relay":  # as a killed relay: once out of the chain (its own leaving update), the next step;
        # with no other relay, once its new incarnation joined. (The same rule as a kill, so their stalls compare.)
        left = _first_event(status, "relay_lost", target, injected_at)
        if chain_len <= 1 or left is None:
            left = _first_event(status, "relay_joined", target, injected_at) if chain_len <= 1 else None
        return None if left is None else next((t for t in sorted(step_times) if t > left), None)
    if fault in ("rollout", "preempt-rollout"):
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


def _baseline_start(steps: list[tuple[float, int]], injected_at: float, before_s: float) -> float:
    """Where the baseline's span starts: `before_s` before the fault, or a younger run's first step completion (the
    fault itself without a step before it)."""
    times = [t for t, _ in steps if t <= injected_at]
    return max(injected_at - before_s, min(times)) if times else injected_at


def baseline_span_s(steps: list[tuple[float, int]], injected_at: float, before_s: float = THROUGHPUT_BEFORE_S) -> float:
    """How long the baseline of baseline_tokens_per_s spans: `before_s`, or less for a run whose first step
    completed later than that before the fault (0 without a step before it)."""
    return injected_at - _baseline_start(steps, injected_at, before_s)


def baseline_tokens_per_s(steps: list[tuple[float, int]], injected_at: float,
                          before_s: float = THROUGHPUT_BEFORE_S,
                          min_s: float = THROUGHPUT_BASELINE_MIN_S) -> float | None:
    """The trainer's mean tokens/s over the `before_s` seconds before injection. steps: (completion time, tokens)
    of each step. A run younger than that is measured from its first step's completion (whose tokens were
    produced before it, so they are left out). None without a step in that span, or when it spans less than
    `min_s` (THROUGHPUT_BASELINE_MIN_S: a run's first seconds are no baseline)."""
    start = _baseline_start(steps, injected_at, before_s)
    span = injected_at - start
    if span <= 0 or span < min_s:
        return None
    tokens = sum(n for t, n in steps if start < t <= injected_at)
    return tokens / span if tokens else None


def throughput_window_s(steps: list[tuple[float, int]], injected_at: float, before_s: float = THROUGHPUT_BEFORE_S,
                        min_s: float = THROUGHPUT_WINDOW_S, window_steps: int = THROUGHPUT_WINDOW_STEPS) -> float:
    """The sliding window: window_steps mean step intervals of the baseline span (as baseline_tokens_per_s
    measures it), at least min_s, so that one step completing never makes a rate on its own at a slow step
    rate."""
    start = _baseline_start(steps, injected_at, before_s)
    count = sum(1 for t, _ in steps if start < t <= injected_at)
    return max(min_s, window_steps * (injected_at - start) / count) if count else min_s


def no_baseline_note(steps: list[tuple[float, int]], injected_at: float) -> str:
    """The report's note when the run stepped too briefly before the fault for a throughput baseline, else ""."""
    span = baseline_span_s(steps, injected_at)
    if span >= THROUGHPUT_BASELINE_MIN_S:
        return ""
    return (f"no throughput baseline: the run had stepped for {span:.1f}s before the fault (at least "
            f"{THROUGHPUT_BASELINE_MIN_S:g}s needed: inject later, e.g. a larger --at-step)")


def throughput_restored_at(steps: list[tuple[float, int]], injected_at: float, observed_until: float,
                           window_s: float | None = None, before_s: float = THROUGHPUT_BEFORE_S,
                           fraction: float = THROUGHPUT_FRACTION) -> float | None:
    """The first time t, at least `window_s` (default: throughput_window_s) after injection (the window holds
    only what came after the fault) and no later than observed_until, at which the tokens of the steps
    completed in (t - window_s, t], over window_s, reach `fraction` of baseline_tokens_per_s. A window's rate
    rises only when a step completes, so the candidates are injected_at + window_s and each later completion
    time. None when no baseline or no such time."""
    base = baseline_tokens_per_s(steps, injected_at, before_s)
    if base is None:
        return None
    if window_s is None:
        window_s = throughput_window_s(steps, injected_at, before_s)
    first = injected_at + window_s
    for c in [first] + sorted(t for t, _ in steps if t > first):
        if c > observed_until:
            return None
        if sum(n for t, n in steps if c - window_s < t <= c) / window_s >= fraction * base:
            return c
    return None


def groups_lost(status: RunStatus) -> int:
    """Prompt groups issued but neither consumed, waiting, leased nor queued for re-lease."""
    accounted = status.groups_consumed + status.ready_groups + status.open_leases + status.returned_leases
    return status.prompts_issued - accounted


def build_report(drill_id: str, fault: str, target: str, injected_at: float, baseline: RunStatus,
                 final: RunStatus, detected: float | None, recovered: float | None, step_times: list[float],
                 observed_until: float, notes: str = "", throughput_at: float | None = None) -> DrillReport:
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
        throughput_restored_at=None if throughput_at is None else round(throughput_at, 3),
        tokens_lost=tokens_lost(baseline, final),
    )


def tokens_lost(baseline: RunStatus, final: RunStatus) -> int:
    """Generated tokens thrown away between the two snapshots, from the run's durable counter of them: those a
    dead incarnation had not flushed to its partial pool (as its last heartbeat counted them: what it generated
    after that heartbeat is known to no one, so after a SIGKILL this is a lower bound) and flushed prefixes that
    could not be resumed (their start version was gone), plus the tries of groups that failed a task check."""
    return final.tokens_regenerated - baseline.tokens_regenerated


def _first_event(status: RunStatus, kind: str, subject: str, after: float) -> float | None:
    return next((t for t in status.event_times.get(f"{kind}/{subject}", []) if t >= after), None)
