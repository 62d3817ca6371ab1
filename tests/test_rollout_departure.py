"""A rollout replica that leaves (a notice, or `laminar scale` removed it) hands its unfinished groups over as one
segment at once, and a replica that leases such a group continues it from its prefixes when it holds their
version, else generates it again (counted). The replica runs its real loop and a real torch engine; the control
plane is the replica's `ControlPort` seam, answered the way the workflow answers (workflows/migrations.py
`depart` is tested on the real Ledger in tests/test_migrations.py)."""

from __future__ import annotations

from laminar.contract import (
    AddExperienceInput,
    AddExperienceResult,
    ClaimPromptsInput,
    ClaimPromptsResult,
    Lease,
)
from laminar.notice import Notice
from laminar.rl.model import model_state_dict
from laminar.services.rollout import RolloutReplica
from laminar.storage.trajectories import TrajectoryStore
from tests.test_rollout_handover import CFG, GROUP_SIZE, GROUPS, RUN, Ticks, _store_with_model


class LeasesThenNotice:
    """Leases GROUPS groups on the first work claim, then gives the notice (as SIGTERM would) after `turns` more
    contacts; records the departure. `leave`: answer `leave` instead (`laminar scale` removed the replica)."""

    def __init__(self, notice: Notice, leave: bool = False, turns: int = 2) -> None:
        self.notice, self.leave, self.turns = notice, leave, turns
        self.leased = False
        self.departures: list[ClaimPromptsInput] = []

    def claim(self, inp: ClaimPromptsInput) -> ClaimPromptsResult:
        if inp.departure is not None:
            self.departures.append(inp)
            return ClaimPromptsResult(leases=[], newest_policy_version=0, relays=[])
        if inp.first_claim:
            return ClaimPromptsResult(leases=[], newest_policy_version=0, relays=[])
        if not self.leased:
            self.leased = True
            return ClaimPromptsResult(leases=[Lease(f"g{i:08d}", i) for i in range(GROUPS)], newest_policy_version=0,
                                      relays=[])
        self.turns -= 1
        if self.turns <= 0 and not self.leave:
            self.notice.give(30.0, "SIGTERM")
        return ClaimPromptsResult(leases=[], newest_policy_version=0, relays=[], leave=self.leave and self.turns <= 0)

    def add_experience(self, inp: AddExperienceInput) -> AddExperienceResult:
        return AddExperienceResult(accepted=list(inp.segment.group_ids), duplicates=[])

    def heartbeat(self, details: dict) -> None:
        pass

    def cancelled(self) -> bool:
        return False


def _replica(store, control, replica_id: str, notice: Notice, version: int = 0) -> RolloutReplica:
    replica = RolloutReplica(run_id=RUN, replica_id=replica_id, host_id="host-0", segment_prefix="seg-a1", cfg=CFG,
                             store=store, control=control, attempt=1, generation=0, clock=Ticks(), notice=notice)
    replica.engine.load_weights(model_state_dict(replica.engine.model), version)
    return replica


def test_a_replica_on_notice_hands_every_unfinished_group_over_at_its_next_turn(tmp_path):
    # GROUPS groups of GROUP_SIZE samples each with 2000 new tokens allowed: an untrained model completes none of
    # them in the few contacts before the notice, so every sample is in the departure's segment, the finished
    # ones as they are and the rest as prefixes.
    store, notice = _store_with_model(tmp_path), Notice()
    control = LeasesThenNotice(notice)
    result = _replica(store, control, "replica-0", notice).run()

    assert result.departed == "notice" and result.groups_completed == 0
    [last] = control.departures
    d = last.departure
    assert d is not None and d.reason == "notice" and d.policy_version == 0 and d.tokens_regenerated == 0
    assert d.segment is not None and sorted(d.segment.group_ids) == [f"g{i:08d}" for i in range(GROUPS)]
    rows = TrajectoryStore(store).read_segment(d.segment)
    assert len(rows) == GROUPS * GROUP_SIZE
    assert {t.finish_reason for t in rows} >= {"partial"} and all(t.policy_version == 0 for t in rows)
    assert sum(len(t.response_ids) for t in rows) > 0
    assert last.max_groups == 0  # a departing replica asks for nothing


def test_a_removed_replica_departs_the_same_way(tmp_path):
    store, notice = _store_with_model(tmp_path), Notice()
    control = LeasesThenNotice(notice, leave=True)
    result = _replica(store, control, "replica-0", notice).run()
    assert result.departed == "removed" and not notice.given
    [last] = control.departures
    assert last.departure is not None and last.departure.reason == "removed"
    assert last.departure.segment is not None and len(last.departure.segment.group_ids) == GROUPS


class GivesResumeLeases(LeasesThenNotice):
    """Leases the departed groups (with their segment) on the first work claim; then the notice, to end the run."""

    def __init__(self, notice: Notice, leases: list[Lease]) -> None:
        super().__init__(notice, turns=3)
        self.resume_leases = leases

    def claim(self, inp: ClaimPromptsInput) -> ClaimPromptsResult:
        if inp.departure is None and not inp.first_claim and not self.leased:
            self.leased = True
            return ClaimPromptsResult(leases=self.resume_leases, newest_policy_version=0, relays=[])
        return super().claim(inp)


def _departed_segment(tmp_path):
    store, notice = _store_with_model(tmp_path), Notice()
    control = LeasesThenNotice(notice)
    _replica(store, control, "replica-0", notice).run()
    d = control.departures[0].departure
    assert d is not None and d.segment is not None
    return store, d


def test_a_replica_of_the_same_version_continues_departed_groups_from_their_prefixes(tmp_path):
    store, d = _departed_segment(tmp_path)
    rows = TrajectoryStore(store).read_segment(d.segment)
    partial_tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in rows if t.finish_reason == "partial")
    leases = [Lease(g, int(g[1:]), resume=d.segment, resume_version=0) for g in d.segment.group_ids]
    notice = Notice()
    control = GivesResumeLeases(notice, leases)
    other = _replica(store, control, "replica-1", notice, version=0)
    other.run()
    # nothing generated again; every prefix prefilled once more (prompt + response of each partial sample)
    assert other.counters.tokens_regenerated == 0
    assert other.counters.reprefill_tokens == partial_tokens
    # it departs in turn with the same groups, each sample at least as long as it was handed over
    again = control.departures[0].departure
    assert again is not None and again.segment is not None
    longer = {(t.group_id, t.sample_index): len(t.response_ids) for t in TrajectoryStore(store).read_segment(again.segment)}
    assert all(longer[(t.group_id, t.sample_index)] >= len(t.response_ids) for t in rows)


def test_a_replica_of_another_version_generates_departed_groups_again_and_counts_it(tmp_path):
    store, d = _departed_segment(tmp_path)
    rows = TrajectoryStore(store).read_segment(d.segment)
    thrown_away = sum(len(t.response_ids) for t in rows)  # every generated token of those groups, finished or not
    leases = [Lease(g, int(g[1:]), resume=d.segment, resume_version=0) for g in d.segment.group_ids]
    notice = Notice()
    control = GivesResumeLeases(notice, leases)
    other = _replica(store, control, "replica-1", notice, version=1)  # it holds version 1, they started on 0
    other.run()
    assert other.counters.reprefill_tokens == 0
    again = control.departures[0].departure
    # counted with its departure (no report follows it), so the workflow adds them to tokens_regenerated
    assert again is not None and again.tokens_regenerated == thrown_away
    assert again.policy_version == 1 and again.segment is not None
    assert sorted(again.segment.group_ids) == sorted(d.segment.group_ids)  # generated again under version 1


def test_a_resume_that_does_not_fit_waits_and_is_continued_once_there_is_room(tmp_path):
    # The departed segment holds GROUPS (= max_inflight_groups) groups. A replica that already runs GROUPS groups of
    # its own has no slot for them: Batch.resume defers them (before, the engine was asked to take them and raised).
    # Once its own groups are gone (aborted here, as a finished or handed-over group would free them), the next
    # resume_deferred continues them from their prefixes, nothing regenerated.
    store, d = _departed_segment(tmp_path)
    rows = TrajectoryStore(store).read_segment(d.segment)
    notice = Notice()
    replica = _replica(store, LeasesThenNotice(notice), "replica-1", notice, version=0)
    b = replica.batch
    b.admit([Lease(f"own{i}", 100 + i) for i in range(GROUPS)])
    assert replica.engine.free_slots() < GROUP_SIZE
    by_group: dict = {}
    for t in rows:
        by_group.setdefault(t.group_id, []).append(t)
    b.resume(by_group, 0)
    assert sorted(b.deferred) == sorted(by_group) and not set(by_group) & set(b.groups)
    b.resume_deferred()  # still no room: they keep waiting
    assert sorted(b.deferred) == sorted(by_group)
    replica.engine.abort()
    b.groups = {}
    b.resume_deferred()
    assert not b.deferred and sorted(b.groups) == sorted(by_group)
    assert replica.counters.tokens_regenerated == 0
