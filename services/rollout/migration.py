"""The dynamic-repack hand-off (workflows/migrations.py): a source stops its unfinished groups and hands them
over as one segment; a destination continues them under their version, or declines. Both are reported on
the next claim."""

from __future__ import annotations

import time
from collections.abc import Callable

from laminar.contract import Departure, Handoff, Incoming, Lease, MigrationOrder, Taken
from laminar.errors import CorruptDataError
from laminar.logs import get_logger
from laminar.records import Trajectory
from laminar.services.rollout.batch import Batch, Counters
from laminar.storage.trajectories import TrajectoryStore
from laminar.timing import TimeBreakdown

log = get_logger(__name__)


class Repack:
    def __init__(self, batch: Batch, trajectories: TrajectoryStore, run_id: str, replica_id: str,
                 counters: Counters, profile: TimeBreakdown,
                 load_version: Callable[[int], bool] = lambda version: False) -> None:
        self.load_version = load_version  # an idle replica loads a departed group's version (from a relay)
        self.batch, self.engine, self.trajectories = batch, batch.engine, trajectories
        self.run_id, self.replica_id, self.counters, self.profile = run_id, replica_id, counters, profile
        self.handoff: Handoff | None = None  # what the next claim carries
        self.taken: list[Taken] = []
        self._seen: set[str] = set()  # migrations already handled
        self._sent = False  # a claim carrying a hand-off is out, not yet answered

    @property
    def urgent(self) -> bool:
        """A hand-off or acknowledgement waits: claim at once."""
        return self.handoff is not None or bool(self.taken)

    def outgoing(self) -> tuple[Handoff | None, list[Taken]]:
        """What the next claim carries (then forgotten here; the handed-off rows stay in the pool until that
        claim's answer: `on_answer`)."""
        out, self.handoff, self.taken = (self.handoff, self.taken), None, []
        self._sent = out[0] is not None
        return out

    def on_answer(self, order: MigrationOrder | None, incoming: list[Incoming]) -> None:
        """An answer's repack part: an order makes this replica a source, each Incoming a destination. Each
        migration is handled once: answers repeat it until the workflow has this replica's hand-off or
        acknowledgement, so an id is remembered only while answers still carry it."""
        if self._sent:  # the claim that carried the hand-off is answered: the workflow has it
            self.batch.handing_off, self._sent = [], False
        if order is not None and order.migration_id not in self._seen:
            self._seen.add(order.migration_id)
            self._hand_off(order)
        for inc in incoming:
            if inc.migration_id not in self._seen:
                self._seen.add(inc.migration_id)
                self._take(inc)
        self._seen &= {inc.migration_id for inc in incoming} | ({order.migration_id} if order else set())

    def _hand_off(self, order: MigrationOrder) -> None:
        """Stop every unfinished group, write them (prefixes and log-probs) as one segment, and hand them over
        on the next claim; declines when its version is no longer the order's or nothing is left in flight.
        The leases stay this replica's until the workflow records the hand-off, so a death before that
        recovers them as any other in-flight group."""
        t0 = time.perf_counter()
        if self.engine.policy_version != order.policy_version or not self.batch.groups:
            self.handoff = Handoff(order.migration_id)
            log.info("repack_declined_as_source", replica_id=self.replica_id, migration=order.migration_id,
                     policy_version=self.engine.policy_version, groups=len(self.batch.groups))
            return
        moving, self.batch.groups = self.batch.groups, {}  # every in-flight request belongs to one of these
        stopped = self.engine.abort()
        rows = self.batch.rows(moving, stopped)
        with self.profile.measure("repack_out"):
            ref = self.trajectories.write_migration(self.run_id, order.migration_id, rows)
        self.handoff = Handoff(order.migration_id, ref, overhead_s=time.perf_counter() - t0)
        # until the workflow has the hand-off the leases are this replica's: its pool keeps the rows, so a death
        # before that resumes them (with their tool calls) instead of generating them again from their prompts
        self.batch.handing_off = rows
        log.info("repack_handed_off", replica_id=self.replica_id, migration=order.migration_id,
                 destination=order.destination, groups=len(moving), sequences=len(stopped),
                 policy_version=order.policy_version)

    def depart(self, reason: str, segment_id: str) -> Departure:
        """Stop every unfinished group and write those of the loaded version (and deferred ones of it) as one
        segment, for the workflow to move (laminar.contract.Departure). Groups of another version are not
        moved: their leases go back from their prompts, and their tokens are returned as thrown away."""
        version = self.engine.policy_version
        stopped = self.engine.abort() if self.batch.groups else []
        groups, self.batch.groups = self.batch.groups, {}
        rows = self.batch.rows(groups, stopped) + self.batch.deferred_rows()
        self.batch.deferred = {}
        keep, lost = [], 0
        for t in rows:
            if version is not None and t.policy_version == version:
                keep.append(t)
            else:
                lost += len(t.response_ids)
        with self.profile.measure("depart_out"):
            ref = self.trajectories.write_migration(self.run_id, segment_id, keep) if keep else None
        log.info("replica_departing", replica_id=self.replica_id, reason=reason, groups=len(ref.group_ids) if ref else 0,
                 sequences=len(stopped), pending=len(self.batch.pending), tokens_dropped=lost, policy_version=version)
        return Departure(reason, ref, -1 if version is None else int(version), tokens_regenerated=lost)

    def take_leases(self, leases: list[Lease]) -> None:
        """Leases that carry a departed replica's (or a declined migration's) prefixes: continue each group from
        its rows when this replica has their version loaded, else generate it again from its prompt (its
        recorded tool calls answered from the rows). A segment that cannot be read costs only the prefixes."""
        rows_of: dict[str, list[Trajectory]] = {}
        for key, ref in {lease.resume.key: lease.resume for lease in leases if lease.resume is not None}.items():
            try:
                with self.profile.measure("resume_in"):
                    rows_of[key] = self.trajectories.read_segment(ref)
            except CorruptDataError as e:
                log.error("resume_segment_unreadable", replica_id=self.replica_id, key=key, error=str(e))
                rows_of[key] = []
        fresh: list[Lease] = []
        resumed = restarted = 0
        wanted = {lease.resume_version for lease in leases}
        if (len(wanted) == 1 and self.engine.policy_version not in wanted and not self.engine.in_flight()
                and not self.batch.groups):  # idle: load their version first (a relay keeps recent versions)
            self.load_version(next(iter(wanted)))
        for lease in leases:
            assert lease.resume is not None
            rows = [t for t in rows_of[lease.resume.key] if t.group_id == lease.group_id]
            if not rows:
                fresh.append(Lease(lease.group_id, lease.prompt_id))
            elif self.engine.policy_version == lease.resume_version:
                self.batch.resume({lease.group_id: rows}, lease.resume_version)
                self.counters.reprefilled(sum(len(t.prompt_ids) + len(t.response_ids) for t in rows
                                              if t.finish_reason == "partial"))
                resumed += 1
            else:
                self.batch.restart_fresh({lease.group_id: rows})
                restarted += 1
        if fresh:
            self.batch.admit(fresh)
        log.info("resume_leases_taken", replica_id=self.replica_id, resumed=resumed, restarted=restarted,
                 without_rows=len(fresh), policy_version=self.engine.policy_version)

    def _take(self, inc: Incoming) -> None:
        """Continue a source's groups under their version if this replica still holds it and has the slots;
        else decline (the workflow sends them back to the pool). Acknowledged on the next claim."""
        t0 = time.perf_counter()
        by_group = self._incoming_groups(inc) if self.engine.policy_version == inc.policy_version else None
        ok = by_group is not None
        if by_group is not None:
            self.batch.resume(by_group, inc.policy_version)
            self.counters.reprefilled(sum(len(t.prompt_ids) + len(t.response_ids) for g in by_group.values()
                                          for t in g if t.finish_reason == "partial"))
        self.taken.append(Taken(inc.migration_id, ok, overhead_s=time.perf_counter() - t0))
        log.info("repack_taken" if ok else "repack_declined_as_destination", replica_id=self.replica_id,
                 migration=inc.migration_id, source=inc.source, groups=len(inc.segment.group_ids),
                 policy_version=self.engine.policy_version, wanted_version=inc.policy_version)

    def _incoming_groups(self, inc: Incoming) -> dict[str, list[Trajectory]] | None:
        """The migration's groups by id, or None when the segment lacks one or they do not fit the free slots."""
        try:
            with self.profile.measure("repack_in"):
                rows = self.trajectories.read_segment(inc.segment)
        except CorruptDataError as e:
            log.error("repack_segment_corrupt", replica_id=self.replica_id, migration=inc.migration_id,
                      error=str(e))
            rows = []
        wanted = set(inc.segment.group_ids)
        by_group: dict[str, list[Trajectory]] = {}
        for t in rows:
            if t.group_id in wanted:
                by_group.setdefault(t.group_id, []).append(t)
        size = self.batch.group_size
        unfinished = sum(size - sum(1 for t in g if t.finish_reason != "partial") for g in by_group.values())
        return by_group if set(by_group) == wanted and unfinished <= self.engine.free_slots() else None
