"""Dynamic repack, the workflow's side: who owns a migrating group at each moment, so that a migration that
fails anywhere loses no group and runs none twice.

Pure and clock-free like workflows/ledger.py: it changes `RunState` only, the workflow calls it from its
update handlers and after each trainer step, and tests drive it directly.

A migration, end to end (the planner, workflows/repack.py, picks source S and destination D of one version v):
1. order   - the workflow records `migrations[S]` and tells S in its next answer (claim or report).
2. hand-off - S stops its unfinished groups, writes them as one segment (prefixes + log-probs), and sends the
             segment on its next claim. The workflow moves the leases S still holds to D (one owner per
             group, always) and queues an `Incoming` for D. S then loads the newest version.
3. take    - D, on an answer carrying the `Incoming`, continues the groups under v if it still holds v and
             has the slots (re-prefilling the prefixes), else declines; it acknowledges on its next claim.
             A decline sends the groups' leases back to the pool (generated again from scratch, counted).

Failures: the lease owner is what the workflow says, so every case reduces to the existing recovery.
- S dies before its hand-off is recorded: its leases are still its own; its retry resumes them from its
  partial pool (or they go back to the pool). Its order is forgotten at its first claim.
- S dies after the hand-off: the groups are D's; S's retry finds them no longer leased to it (resume_ok).
- D dies before or after taking (or hands over at a continue-as-new before taking): the groups are D's leases;
  its retry resumes those its partial pool holds and the rest go back to the pool (release_leases_of) with the
  migration's segment (`Lease.resume`, set at the hand-off as a departure's is), so the next replica continues
  them, or generates them again answering their recorded tool calls from the rows: never from their bare
  prompts, which ran their completed calls again. Its unacknowledged `Incoming`s are forgotten.
- A retried claim carries the same hand-off or acknowledgement again: the second one finds nothing pending
  under that id and changes nothing.
"""

from __future__ import annotations

from dataclasses import replace

from laminar.contract import Departure, Handoff, Incoming, MigrationOrder, ReplicaReport, Taken
from laminar.workflows.ledger import Ledger
from laminar.workflows.repack import Move, ReplicaLoad, plan_repack


class Migrations:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.state = ledger.state

    def involved(self) -> set[str]:
        """Replicas in a migration not yet acknowledged, as source or destination: not planned again meanwhile."""
        busy = set(self.state.migrations) | {o.destination for o in self.state.migrations.values()}
        return busy | {r for r, queue in self.state.inbox.items() if queue}

    def pending(self) -> int:
        return len(self.ledger.migrating())

    def plan(self, *, c_max: float, batch_limit: int, at: float) -> list[Move]:
        """Run the planner over the replicas' latest reports and order its moves. Only replicas behind the newest
        version take part: one on the newest version admits new prompts as its slots free up (it is not
        draining), so releasing it would gain nothing. Replicas already in a migration wait for it to end."""
        busy = self.involved()
        newest = self.state.policy_version
        loads = [
            ReplicaLoad(replica_id=r.replica_id, policy_version=r.policy_version, kv_used=r.kv_used,
                        kv_prev=r.kv_prev, kv_capacity=r.kv_capacity, in_flight=r.in_flight, waiting=r.waiting)
            for r in self.state.replicas.values()
            if 0 <= r.policy_version < newest and r.kv_capacity > 0 and r.replica_id not in busy
        ]
        self.state.last_plan_at = at
        moves = plan_repack(loads, c_max=c_max, roofline_batch=batch_limit)
        for m in moves:
            self.state.migration_seq += 1
            self.state.migrations[m.source] = MigrationOrder(
                migration_id=f"m{self.state.migration_seq:06d}", destination=m.destination,
                policy_version=m.policy_version)
            self.ledger.note_event("repack_ordered", f"{m.source}->{m.destination}", at, m.trajectories)
        return moves

    def order_for(self, replica_id: str) -> MigrationOrder | None:
        return self.state.migrations.get(replica_id)

    def incoming_for(self, replica_id: str) -> list[Incoming]:
        return list(self.state.inbox.get(replica_id, []))

    def hold_for(self, replica_id: str) -> int:
        """The version a destination must keep loaded until its migrations arrive (-1: none). Without it a
        destination whose own trajectories finish first would load the newest version and have to decline."""
        versions = [o.policy_version for o in self.state.migrations.values() if o.destination == replica_id]
        versions += [i.policy_version for i in self.state.inbox.get(replica_id, [])]
        return max(versions, default=-1)

    def hand_off(self, source: str, handoff: Handoff, at: float) -> list[str]:
        """Record a source's hand-off: the groups it still holds become the destination's. Returns them."""
        order = self.state.migrations.get(source)
        if order is None or order.migration_id != handoff.migration_id:
            return []  # a retried claim, or an order forgotten when the source restarted
        del self.state.migrations[source]
        subject = f"{source}->{order.destination}"
        moved = [] if handoff.segment is None else self.ledger.held_by(source, handoff.segment.group_ids)
        if not moved:
            self.ledger.note_event("repack_declined", subject, at, 0)
            return []
        segment = replace(handoff.segment, group_ids=moved)
        for g in moved:  # the destination's now; if it restarts without them, they go back with the segment
            lease = self.state.open_leases[g]
            lease.replica_id, lease.resume, lease.resume_version = order.destination, segment, order.policy_version
        self.state.inbox.setdefault(order.destination, []).append(
            Incoming(migration_id=order.migration_id, source=source, segment=segment,
                     policy_version=order.policy_version))
        self.state.repack_overhead_s += handoff.overhead_s
        return moved

    def take(self, destination: str, taken: list[Taken], at: float) -> None:
        """A destination's acknowledgements: count the migrations it continued; send declined groups back."""
        queue = self.state.inbox.get(destination, [])
        for t in taken:
            inc = next((i for i in queue if i.migration_id == t.migration_id), None)
            if inc is None:
                continue  # already acknowledged (a retried claim)
            queue.remove(inc)
            subject = f"{inc.source}->{destination}"
            if t.ok:
                self.state.repacks += 1
                self.state.repack_groups += len(inc.segment.group_ids)
                self.state.repack_overhead_s += t.overhead_s
                self.ledger.note_event("repack_moved", subject, at, len(inc.segment.group_ids))
            else:  # back to the pool with their prefixes: a replica of that version continues them
                back = self.ledger.give_back(destination, inc.segment.group_ids, inc.segment, inc.policy_version, at)
                self.ledger.note_event("repack_declined", subject, at, len(back))
        if not queue:
            self.state.inbox.pop(destination, None)

    def depart(self, source: str, departure: Departure, leaving: list[str], at: float) -> tuple[str, list[str]]:
        """A replica leaves (laminar.contract.Departure): the groups in its segment that it still holds go to a
        replica of their version (an `Incoming`, taken or declined like a repack migration) or, with none, back
        to the pool with the segment (`Lease.resume`); every other lease it holds (not started) goes back as it
        is. Returns (destination or "", the groups in the segment). A retried claim finds nothing held: no-op."""
        self.forget(source)
        self.state.replicas.pop(source, None)  # gone until its next claim: never a destination meanwhile
        if source not in self.state.departed:
            self.state.departed.append(source)  # its next incarnation lost nothing (ClaimPromptsResult.departed)
        self.state.tokens_regenerated += departure.tokens_regenerated
        seg = departure.segment
        moving = [] if seg is None else self.ledger.held_by(source, seg.group_ids)
        plain = [g for g, lease in self.state.open_leases.items() if lease.replica_id == source and g not in moving]
        self.ledger.give_back(source, plain, None)
        if not moving or seg is None:
            self.ledger.note_event("replica_departed", source, at, len(plain))
            return "", []
        segment = replace(seg, group_ids=moving)
        destination = pick_destination(list(self.state.replicas.values()), source, departure.policy_version,
                                       set(leaving) | set(self.state.migrations))
        if not destination:
            self.ledger.give_back(source, moving, segment, departure.policy_version, at)
            self.ledger.note_event("departure_returned", source, at, len(moving))
            return "", moving
        self.state.migration_seq += 1
        migration_id = f"d{self.state.migration_seq:06d}"
        for g in moving:  # the destination's now; if it dies, its retry returns them with the segment
            lease = self.state.open_leases[g]
            lease.replica_id, lease.resume, lease.resume_version = destination, segment, departure.policy_version
        self.state.inbox.setdefault(destination, []).append(
            Incoming(migration_id=migration_id, source=source, segment=segment, policy_version=departure.policy_version))
        self.ledger.note_event("departure_moved", f"{source}->{destination}", at, len(moving))
        return destination, moving

    def forget(self, replica_id: str) -> None:
        """A (re)started replica: its order is void and its unacknowledged incoming groups are leases it holds
        like any other (kept if its partial pool has them, else back to the pool)."""
        self.state.migrations.pop(replica_id, None)
        self.state.inbox.pop(replica_id, None)


def pick_destination(reports: list[ReplicaReport], source: str, version: int, excluded: set[str]) -> str:
    """Where a departing replica's groups go: a replica that reported `version` loaded, other than the source
    and not leaving or handing off itself; the one with the most free KV cache (then the fewest sequences in
    flight or waiting, then the lowest id). "" when none holds that version."""
    fits = [r for r in reports if r.policy_version == version >= 0 and r.replica_id != source
            and r.replica_id not in excluded]
    if not fits:
        return ""
    best = max(fits, key=lambda r: (r.kv_capacity - r.kv_used, -(r.in_flight + r.waiting), _neg_index(r.replica_id)))
    return best.replica_id


def _neg_index(replica_id: str) -> int:
    head, _, tail = replica_id.rpartition("-")
    return -int(tail) if head and tail.isdigit() else -(10**9)
