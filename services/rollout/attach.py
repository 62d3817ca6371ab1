"""A continue-as-new that replicas do not feel: live replicas parked between two history segments of their run, in
their process, until the next segment's activity re-attaches them (docs/decisions/one-run-load.md, 2026-12-02 "A continue-as-new
without a hand-over").

An activity scheduled by a workflow run ends with that run, so a replica's `run_rollout_replica` activity cannot
outlive its segment. What can is the replica itself: told `handover` with `keep`, it leaves its groups in flight (no
partial-pool write, no engine teardown), parks here under (workflow id, replica id) and returns, naming the queue
only this process polls (contract.rollout_process_queue). The next segment starts the replica's activity again (same
activity id) on that queue (patch `handover-route`, workflows/commands.py `run_kept_replica`), so it lands in this
process and adopts the parked replica, whose first claim names every group it holds as `resuming`, so the workflow
keeps those leases (they were carried in the state) and its later reports of them are accepted once. A process
that no longer holds the replica answers ReplicaNotParked; one that is gone does not take the activity within its
schedule-to-start timeout; either way the run starts the replica afresh on the shared queue, as after a crash: its
first claim releases what it does not resume from the pool. A parked replica holds its process's slot while it waits
(workers/rollout_slots.py). An activity that lands here on the shared queue (a run of older workflow code) adopts it
too; elsewhere, the parked replica is never adopted and is closed without contacting the workflow again.

Invariants (tests/test_handover_keep.py):
- a parked replica never contacts the workflow: only the activity that adopts it does, so at most one incarnation of
  a replica talks to the run at a time;
- a parked replica is adopted at most once (`adopt` pops it under the lock), and only by its own replica id in its own
  workflow id;
- one not adopted within `PARK_S` is given back to its owner for closing (`expired`), as is one a fresh start in an
  engine-exclusive process displaces (`take_all`): its groups' leases go back to the pool at that replica's next
  first claim, or are resumed from its partial pool, as after a crash; none is lost, the ledger accepts none twice.

Pure and clock-free: callers pass the time (time.monotonic in the activity, a number in tests).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

# A parked replica waits this long for the next segment's activity: the hand-over's last workflow tasks, the new
# segment's first task (decoding the carried state) and the activity's dispatch, with the machine loaded. Then it is
# closed, and its groups are recovered as a lost replica's are.
PARK_S = 300.0


@dataclass
class _Parked(Generic[T]):
    item: T
    at: float


class Parking(Generic[T]):
    """Parked replicas of this process by (workflow id, replica id)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parked: dict[tuple[str, str], _Parked[T]] = {}

    def park(self, workflow_id: str, replica_id: str, item: T, at: float) -> T | None:
        """Park `item`; returns one it displaced (an older incarnation never adopted: close it), else None."""
        with self._lock:
            old = self._parked.pop((workflow_id, replica_id), None)
            self._parked[(workflow_id, replica_id)] = _Parked(item, at)
        return None if old is None else old.item

    def adopt(self, workflow_id: str, replica_id: str) -> T | None:
        """The parked replica of this id in this workflow, taken (at most once), or None."""
        with self._lock:
            parked = self._parked.pop((workflow_id, replica_id), None)
        return None if parked is None else parked.item

    def expired(self, now: float, after_s: float = PARK_S) -> list[T]:
        """Take the replicas parked for longer than after_s (their next activity went elsewhere, or never came)."""
        with self._lock:
            old = [k for k, p in self._parked.items() if now - p.at > after_s]
            return [self._parked.pop(k).item for k in old]

    def take_all(self) -> list[T]:
        """Take every parked replica (a fresh start in a process that runs one engine at a time needs its engine)."""
        with self._lock:
            out = [p.item for p in self._parked.values()]
            self._parked.clear()
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._parked)


PARKING: Parking = Parking()  # this process's parked replicas (activities/rollout.py; bench/control.py)
