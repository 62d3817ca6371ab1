"""The run's rollout replicas in one history segment: which it should have, their activities, `laminar scale` (or a
slot pool's grant) starting or removing them, and removed ones retired once they return.

Deterministic like workflows/ledger.py: it changes `RunState` (replica_ids, leaving, departed, the replicas' reports)
through the `Ledger` and `Migrations`, and reaches Temporal only through `start(replica_id)`, which schedules one
`run_rollout_replica` activity and returns its handle (workflows/commands.py `start_replica`); tests/test_replica_set.py
passes futures. The choice of which to start or remove is workflows/scale.py `plan_scale`.

- A replica's activity lives as long as the segment and retries without limit (a retry on another worker is how a
  dead process is replaced), so an activity that fails has a permanent error: the run fails (`fail_if_one_failed`).
- A removed replica leaves gracefully: it is answered `leave`, hands its unfinished groups over (Departure) and
  returns; then `retire_left` returns what it still holds to the pool, as a lost replica's would be.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from temporalio.exceptions import ActivityError, ApplicationError

from laminar.config import RunConfig
from laminar.contract import ScaleResult
from laminar.workflows.commands import Runtime, fail_run_if_permanent
from laminar.workflows.ledger import Ledger
from laminar.workflows.migrations import Migrations
from laminar.workflows.scale import plan_scale, replica_ids
from laminar.workflows.state import RunState


class ReplicaSet:
    def __init__(self, state: RunState, ledger: Ledger, migrations: Migrations, cfg: RunConfig | None, rt: Runtime,
                 start: Callable[[str], Any], may_start: Callable[[], bool],
                 retired: Callable[[str], None] = lambda replica_id: None) -> None:
        self.state, self.ledger, self.migrations, self.cfg, self.rt = state, ledger, migrations, cfg, rt
        self.retired = retired  # a removed replica returned: what else it holds goes back (its eval leases)
        self.start = start  # schedule one replica's activity; returns its handle
        self.may_start = may_start  # neither handing over nor stopping: new replicas start now (else next segment)
        self.tasks: dict[str, Any] = {}  # replica id -> its activity in this segment

    def ids(self) -> list[str]:
        """The replicas the run should have: rollout.replicas of them until a `laminar scale` (workflows/scale.py)."""
        assert self.cfg is not None
        if self.state.pool:  # a run in a slot pool runs only what it is granted (none before its first grant)
            return list(self.state.replica_ids)
        return list(self.state.replica_ids) or replica_ids(self.cfg.rollout.replicas)

    def start_all(self) -> None:
        for replica_id in self.ids():
            self.tasks[replica_id] = self.start(replica_id)

    def running(self) -> int:
        return sum(1 for t in self.tasks.values() if not t.done())

    def returned(self) -> bool:
        """Every replica activity of this segment has returned (or was cancelled)."""
        return all(t.done() for t in self.tasks.values())

    def kept_on(self) -> dict[str, str]:
        """The replicas whose activity returned parked (run.handover_keep), by id: the queue of the process that holds
        each (RolloutReplicaResult.queue; none from a worker that predates it, nor for a removed replica)."""
        out: dict[str, str] = {}
        for replica_id, t in self.tasks.items():
            if not t.done() or t.cancelled() or t.exception() is not None or replica_id in self.state.leaving:
                continue
            res = t.result()
            if getattr(res, "kept", -1) >= 0 and getattr(res, "queue", ""):
                out[replica_id] = res.queue
        return out

    def leaving(self, replica_id: str) -> bool:
        return replica_id in self.state.leaving

    def scale_to(self, target: int) -> ScaleResult:
        """Bring the running replicas to `target` (`laminar scale`, or a slot pool's grant): start new ones, or ask the
        chosen ones to leave (workflows/scale.py)."""
        active = [r for r in self.ids() if r not in self.state.leaving]
        held: dict[str, int] = {}
        for lease in self.state.open_leases.values():
            held[lease.replica_id] = held.get(lease.replica_id, 0) + 1
        plan = plan_scale(active, list(self.state.leaving), held, target, least=0 if self.state.pool else 1)
        at = self.rt.now()
        for replica_id in plan.remove:
            self.state.leaving.append(replica_id)
            self.migrations.forget(replica_id)
            self.ledger.note_event("replica_leaving", replica_id, at, held.get(replica_id, 0))
        self.state.replica_ids = plan.active
        if self.may_start():
            for replica_id in plan.start:
                self.tasks[replica_id] = self.start(replica_id)
                self.ledger.note_event("replica_added", replica_id, at)
        # (a segment handing over starts the new ids in the next segment, from state.replica_ids)
        return ScaleResult(replicas_target=len(plan.active), started=plan.start, removed=plan.remove)

    def left(self) -> list[str]:
        """Removed replicas whose activity has returned (or whose activity this segment never started)."""
        return [r for r in self.state.leaving if r not in self.tasks or self.tasks[r].done()]

    def retire_left(self) -> None:
        """A removed replica returned. It handed its unfinished groups to others as it left (Departure); what it
        still holds (it died before that, or predates departures) goes back to the pool, as a lost replica's does."""
        for replica_id in self.left():
            self.migrations.forget(replica_id)  # orders to or from it since the scale are void
            released = self.ledger.release_leases_of(replica_id, keep=set())
            self.retired(replica_id)
            self.state.scale_groups_returned += len(released)
            self.state.leaving.remove(replica_id)
            if replica_id in self.state.departed:
                self.state.departed.remove(replica_id)  # no next incarnation to tell
            self.state.replicas.pop(replica_id, None)
            self.state.last_claims.pop(replica_id, None)
            self.tasks.pop(replica_id, None)
            self.ledger.note_event("replica_left", replica_id, self.rt.now(), len(released))

    def failed(self) -> str | None:
        """A replica activity that failed: it retries without limit, so only a permanent error (a ConfigError in the
        replica, say) ends it that way."""
        return next((r for r, t in self.tasks.items()
                     if t.done() and not t.cancelled() and t.exception() is not None), None)

    def fail_if_one_failed(self) -> None:
        """Fail the run with a failed replica's own error (its type, when it is a non-retryable ApplicationError)."""
        replica_id = self.failed()
        if replica_id is not None:
            error = self.tasks[replica_id].exception()
            if isinstance(error, ActivityError):
                fail_run_if_permanent(error, f"rollout {replica_id}")
            raise ApplicationError(f"rollout {replica_id} failed: {error}", type="ReplicaFailed", non_retryable=True)
