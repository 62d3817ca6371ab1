"""Dynamic repack's lease hand-overs (workflows/migrations.py) on the real Ledger over a real RunState: one owner
per group at every moment, retried messages change nothing, a restart voids what it interrupted."""

from __future__ import annotations

from laminar.messages import Handoff, ReplicaReport, Taken
from laminar.refs import SegmentRef
from storage import keys
from storage.objects import sha256_hex
from workflows.ledger import Ledger
from workflows.migrations import Migrations
from workflows.state import RunState

RUN = "run-migrations"
CAP = 1000  # KV capacity of every replica (tokens)


def _report(replica: str, version: int, kv_used: int, kv_prev: int, in_flight: int) -> ReplicaReport:
    return ReplicaReport(replica_id=replica, host_id="h", policy_version=version, in_flight=in_flight,
                         kv_used=kv_used, kv_capacity=CAP, kv_prev=kv_prev)


def _setup() -> tuple[Ledger, Migrations]:
    ledger = Ledger(RunState(run_id=RUN, policy_version=4))  # the replicas below are on 3 or 2: draining
    ledger.lease("replica-0", 2)  # g00000000, g00000001
    ledger.lease("replica-1", 2)  # g00000002, g00000003
    ledger.lease("replica-2", 1)  # g00000004
    return ledger, Migrations(ledger)


def _segment(migration_id: str, group_ids: list[str]) -> SegmentRef:
    key = keys.migration(RUN, migration_id)
    return SegmentRef(key=key, sha256=sha256_hex(key.encode()), size=10, rows=8 * len(group_ids),
                      group_ids=list(group_ids), policy_version=3)


def _owners(ledger: Ledger) -> dict[str, str]:
    return {g: lease.replica_id for g, lease in ledger.state.open_leases.items()}


def test_plan_orders_the_smaller_ramp_down_replica_onto_the_other_of_its_version() -> None:
    ledger, mig = _setup()
    # replica-0: 100 tokens (was 300), 2 sequences; replica-1: 200 (was 400), 3 sequences: both in ramp-down
    # (kv_used < min(0.9 x 1000, kv_prev), 0 < in_flight < 8). replica-2 rises (500 > 450): not a candidate.
    # replica-3 holds version 2: alone in its version, nothing to pair with.
    ledger.note_report(_report("replica-0", 3, 100, 300, 2))
    ledger.note_report(_report("replica-1", 3, 200, 400, 3))
    ledger.note_report(_report("replica-2", 3, 500, 450, 4))
    ledger.note_report(_report("replica-3", 2, 100, 300, 2))
    moves = mig.plan(c_max=0.9, batch_limit=8, at=10.0)
    # smallest first: replica-0 (100) fits onto replica-1 (200 + 100 <= 900, 3 + 2 <= 8)
    assert [(m.source, m.destination, m.policy_version, m.kv_tokens, m.trajectories) for m in moves] == [
        ("replica-0", "replica-1", 3, 100, 2)]
    order = mig.order_for("replica-0")
    assert order is not None and order.destination == "replica-1" and order.migration_id == "m000001"
    assert mig.order_for("replica-1") is None and mig.pending() == 1
    assert ledger.state.last_plan_at == 10.0
    # a second plan while the migration is pending leaves both replicas out
    assert mig.plan(c_max=0.9, batch_limit=8, at=11.0) == []
    assert ledger.state.migration_seq == 1


def test_replicas_on_the_newest_version_are_not_planned() -> None:
    ledger, mig = _setup()
    ledger.state.policy_version = 3  # replica-0 and replica-1 hold the newest: they admit new prompts, not drain
    ledger.note_report(_report("replica-0", 3, 100, 300, 2))
    ledger.note_report(_report("replica-1", 3, 200, 400, 3))
    assert mig.plan(c_max=0.9, batch_limit=8, at=1.0) == [] and mig.pending() == 0


def test_hand_off_then_take_moves_the_leases_once_and_counts_the_repack() -> None:
    ledger, mig = _setup()
    ledger.note_report(_report("replica-0", 3, 100, 300, 2))
    ledger.note_report(_report("replica-1", 3, 200, 400, 3))
    mig.plan(c_max=0.9, batch_limit=8, at=1.0)
    handoff = Handoff("m000001", _segment("m000001", ["g00000000", "g00000001"]), overhead_s=0.25)
    assert mig.hand_off("replica-0", handoff, at=2.0) == ["g00000000", "g00000001"]
    assert _owners(ledger) == {"g00000000": "replica-1", "g00000001": "replica-1", "g00000002": "replica-1",
                               "g00000003": "replica-1", "g00000004": "replica-2"}
    assert mig.order_for("replica-0") is None
    [inc] = mig.incoming_for("replica-1")
    assert inc.source == "replica-0" and inc.policy_version == 3 and inc.segment.group_ids == ["g00000000", "g00000001"]
    # the same claim retried: nothing changes
    assert mig.hand_off("replica-0", handoff, at=2.1) == []
    assert len(mig.incoming_for("replica-1")) == 1
    mig.take("replica-1", [Taken("m000001", True, overhead_s=0.5)], at=3.0)
    assert mig.incoming_for("replica-1") == [] and mig.pending() == 0
    s = ledger.state
    assert (s.repacks, s.repack_groups, s.repack_overhead_s) == (1, 2, 0.75)  # 0.25 source + 0.5 destination
    mig.take("replica-1", [Taken("m000001", True, overhead_s=0.5)], at=3.1)  # retried acknowledgement
    assert (s.repacks, s.repack_overhead_s) == (1, 0.75)
    assert [e.kind for e in s.events] == ["repack_ordered", "repack_moved"]
    # the moved groups complete at the destination exactly once
    ledger.add_segment(_segment("x", ["g00000000", "g00000001"]), "replica-1")
    assert ledger.state.groups_generated == 2 and ledger.state.duplicate_reports == 0


def test_a_declined_take_returns_the_groups_to_the_pool() -> None:
    ledger, mig = _setup()
    ledger.note_report(_report("replica-0", 3, 100, 300, 2))
    ledger.note_report(_report("replica-1", 3, 200, 400, 3))
    mig.plan(c_max=0.9, batch_limit=8, at=1.0)
    mig.hand_off("replica-0", Handoff("m000001", _segment("m000001", ["g00000001"])), at=2.0)
    mig.take("replica-1", [Taken("m000001", False)], at=3.0)
    assert [lease.group_id for lease in ledger.state.returned] == ["g00000001"]
    assert "g00000001" not in ledger.state.open_leases and ledger.state.repacks == 0
    # g00000000 was not in the hand-off: still the source's
    assert _owners(ledger)["g00000000"] == "replica-0"
    assert [lease.group_id for lease in ledger.lease("replica-2", 1)] == ["g00000001"]


def test_a_source_that_declines_keeps_its_leases() -> None:
    ledger, mig = _setup()
    ledger.note_report(_report("replica-0", 3, 100, 300, 2))
    ledger.note_report(_report("replica-1", 3, 200, 400, 3))
    mig.plan(c_max=0.9, batch_limit=8, at=1.0)
    assert mig.hand_off("replica-0", Handoff("m000001"), at=2.0) == []
    assert _owners(ledger)["g00000000"] == "replica-0" and mig.pending() == 0
    assert ledger.state.events[-1].kind == "repack_declined"


def test_a_restarted_source_voids_its_order_and_a_restarted_destination_its_inbox() -> None:
    ledger, mig = _setup()
    ledger.note_report(_report("replica-0", 3, 100, 300, 2))
    ledger.note_report(_report("replica-1", 3, 200, 400, 3))
    mig.plan(c_max=0.9, batch_limit=8, at=1.0)
    mig.forget("replica-0")  # the source died before handing off: its leases are still its own
    assert mig.order_for("replica-0") is None and _owners(ledger)["g00000000"] == "replica-0"
    # a hand-off from the dead incarnation arriving late changes nothing
    assert mig.hand_off("replica-0", Handoff("m000001", _segment("m000001", ["g00000000"])), at=2.0) == []

    ledger.note_report(_report("replica-0", 3, 100, 300, 2))
    mig.plan(c_max=0.9, batch_limit=8, at=3.0)
    mig.hand_off("replica-0", Handoff("m000002", _segment("m000002", ["g00000000", "g00000001"])), at=4.0)
    # the destination dies before acknowledging: its inbox goes; the groups are its leases, and its restart
    # keeps those its partial pool resumes (here g00000000) and returns the rest to the pool
    mig.forget("replica-1")
    ledger.release_leases_of("replica-1", keep={"g00000000"})
    assert mig.pending() == 0
    assert _owners(ledger) == {"g00000000": "replica-1", "g00000004": "replica-2"}
    assert sorted(lease.group_id for lease in ledger.state.returned) == ["g00000001", "g00000002", "g00000003"]
