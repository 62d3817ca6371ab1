"""The partial-response pool: every flush interval, all in-flight groups are written (finished samples as they
are, the rest as resumable prefixes), so a killed replica's retry resumes them under the policy version they
started on, or restarts them fresh (counted). A multi-turn sample's row carries every completed turn, tool
outputs and their mask included (services/rollout/batch.py), and is written at once after a tool call, and
before it with the call's intent (the write-ahead record that keeps a call from running twice). Each
incarnation (history segment, attempt) writes its own fenced pool, so a zombie cannot overwrite its retry's."""

from __future__ import annotations

from laminar.errors import CorruptDataError
from laminar.logs import get_logger
from laminar.records import Trajectory
from laminar.services.rollout.batch import Batch, Counters
from laminar.services.rollout.weights import Weights
from laminar.storage.trajectories import TrajectoryStore
from laminar.timing import TimeBreakdown

log = get_logger(__name__)


class PartialPool:
    def __init__(self, trajectories: TrajectoryStore, run_id: str, replica_id: str, fence: tuple[int, int],
                 batch: Batch, weights: Weights, counters: Counters, profile: TimeBreakdown) -> None:
        self.trajectories, self.run_id, self.replica_id, self.fence = trajectories, run_id, replica_id, fence
        self.batch, self.weights, self.counters, self.profile = batch, weights, counters, profile
        self.empty = False  # unknown until the first write
        self.kept = False  # the previous incarnation's groups were written as they are (keep)
        self.last_flush = 0.0
        self.writes = 0  # pool writes by this incarnation (intents and outputs of tool calls included)
        batch.write_ahead = self.write  # an engine step's tool calls are recorded before they run

    def flush_if_due(self, now: float, every_s: float) -> None:
        """Every `every_s`, and at once after a turn that ran a tool: a tool's output is recorded before the
        sample's next turn is generated, so a retry resumes after it instead of calling the tool again."""
        if now - self.last_flush >= every_s or self.batch.tool_turns_unsaved:
            self.write()
            self.last_flush = now

    def write(self) -> None:
        """All samples of every in-flight group: finished ones as they are, the rest as prefixes; then the
        complete groups not yet reported."""
        b = self.batch
        rows = b.rows(b.groups, b.engine.snapshot_inflight()) + b.deferred_rows() + b.handing_off
        rows += [t for g in b.reporting + b.completed for t in g.done.values()]
        if not rows and (self.empty or self.kept):
            return  # an idle replica does not rewrite an empty pool every flush interval, nor a kept one
        with self.profile.measure("flush_pool"):
            self.trajectories.write_partial(self.run_id, self.replica_id, self.fence, rows)
        self.writes += 1
        self.empty = not rows
        self.counters.unsaved_tokens = 0
        self.batch.tool_turns_unsaved = 0

    def keep(self, resumed: dict[str, list[Trajectory]]) -> None:
        """Write the previous incarnation's groups under this fence as they are (a hand-over at the start). The
        batch holds none of them, so a later write with nothing in flight must not replace them with nothing."""
        rows = [t for rows in resumed.values() for t in rows]
        self.trajectories.write_partial(self.run_id, self.replica_id, self.fence, rows)
        self.kept = bool(rows)

    def clear_older(self) -> None:
        self.trajectories.clear_partial(self.run_id, self.replica_id, older_than=self.fence)

    def read(self) -> dict[str, list[Trajectory]]:
        """The previous incarnation's in-flight groups by group id. A corrupt pool is dropped, not retried
        forever: its groups' leases go back to the pool at the first claim and are generated again."""
        try:
            rows = self.trajectories.read_partial(self.run_id, self.replica_id)
        except CorruptDataError as e:
            log.error("partial_pool_corrupt", replica_id=self.replica_id, error=str(e))
            rows = []
        by_group: dict[str, list[Trajectory]] = {}
        for t in rows:
            by_group.setdefault(t.group_id, []).append(t)
        return by_group

    def resume(self, resumed: dict[str, list[Trajectory]]) -> None:
        """Continue each resumed group under the policy version it started on, else restart it fresh."""
        if not resumed:
            return
        versions = {t.policy_version for rows in resumed.values() for t in rows}
        version = max(versions)
        payload = self.weights.fetch(version)
        if payload is None or len(versions) > 1:
            self._restart_fresh(resumed)
            return
        self.weights.load(version, payload)
        self.batch.resume(resumed, version)
        log.info("partial_groups_resumed", replica_id=self.replica_id, groups=len(resumed), policy_version=version)

    def _restart_fresh(self, resumed: dict[str, list[Trajectory]]) -> None:
        """The start version can no longer be loaded: regenerate those groups from scratch (counted)."""
        self.weights.poll()
        self.weights.load_newest()
        self.batch.restart_fresh(resumed)  # completed calls run once
        log.warning("partial_groups_restarted", replica_id=self.replica_id, groups=len(resumed),
                    tokens_regenerated=self.counters.tokens_regenerated)
