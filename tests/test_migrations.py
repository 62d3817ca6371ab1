"""Dynamic repack's lease hand-overs (workflows/migrations.py) on the real Ledger over a real RunState: one owner
per group at every moment, retried messages change nothing, a restart voids what it interrupted."""

from __future__ import annotations

from laminar.contract import Departure, Handoff, ReplicaReport, Taken
from laminar.refs import SegmentRef
from laminar.storage import keys
from laminar.storage.objects import sha256_hex
from laminar.workflows.ledger import Ledger
from laminar.workflows.migrations import Migrations
from laminar.workflows.state import RunState

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
    # the migrated group goes back with the migration's segment (its prefixes and tool outputs), the
    # destination's own groups as they were
    assert sorted((r.group_id, r.resume.key if r.resume else None, r.resume_version) for r in ledger.state.returned) == [
        ("g00000001", keys.migration(RUN, "m000002"), 3), ("g00000002", None, -1), ("g00000003", None, -1)]


def test_a_destination_that_restarts_before_its_pool_holds_the_moved_groups_returns_them_with_the_segment() -> None:
    """The tools chaos run's 32 calls run twice (seed 1, a8b5147): replica-1 handed g00004516 to replica-0 0.25 s
    after its tool calls ran; replica-0's answer carried the Incoming and `handover` (a continue-as-new) together,
    so it handed over without taking; its first claim in the next segment did not resume the group (its pool never
    held it), which went back with no segment and was generated again from its prompt, its calls with it. The same
    with a destination that took three groups and was retried (a Temporal restart) before its next pool flush."""
    ledger, mig = _setup()
    ledger.note_report(_report("replica-0", 3, 100, 300, 2))
    ledger.note_report(_report("replica-1", 3, 200, 400, 3))
    mig.plan(c_max=0.9, batch_limit=8, at=1.0)
    moved = mig.hand_off("replica-0", Handoff("m000001", _segment("m000001", ["g00000000", "g00000001"])), at=2.0)
    assert moved == ["g00000000", "g00000001"]
    # the destination's next incarnation: first claim resuming only its own groups (what its pool holds)
    mig.forget("replica-1")
    assert ledger.first_claim("replica-1", ["g00000002", "g00000003"]) == ["g00000002", "g00000003"]
    back = {r.group_id: r for r in ledger.state.returned}
    assert sorted(back) == ["g00000000", "g00000001"]
    assert all(r.resume is not None and r.resume.key == keys.migration(RUN, "m000001") and r.resume_version == 3
               and r.resume.group_ids == ["g00000000", "g00000001"] for r in back.values())
    # the next claimer gets them with the segment: it continues them, or answers their calls from its rows
    leases = ledger.lease("replica-2", 2, claimer=_report("replica-2", 3, 100, 100, 1), at=3.0)
    assert [(lease.group_id, lease.resume.key if lease.resume else None, lease.resume_version) for lease in leases] == [
        ("g00000000", keys.migration(RUN, "m000001"), 3), ("g00000001", keys.migration(RUN, "m000001"), 3)]
    # a destination that took them and resumes them from its pool keeps them, segment and all
    ledger2, mig2 = _setup()
    ledger2.note_report(_report("replica-0", 3, 100, 300, 2))
    ledger2.note_report(_report("replica-1", 3, 200, 400, 3))
    mig2.plan(c_max=0.9, batch_limit=8, at=1.0)
    mig2.hand_off("replica-0", Handoff("m000001", _segment("m000001", ["g00000000"])), at=2.0)
    mig2.take("replica-1", [Taken("m000001", True)], at=2.5)
    mig2.forget("replica-1")
    assert ledger2.first_claim("replica-1", ["g00000000", "g00000002", "g00000003"]) == [
        "g00000000", "g00000002", "g00000003"]
    assert _owners(ledger2)["g00000000"] == "replica-1" and ledger2.state.returned == []


# -- departures (a replica leaves on notice or is removed by `laminar scale`) --------------------------------


def _departure(group_ids: list[str], version: int = 3, lost: int = 0) -> Departure:
    return Departure("notice", _segment("depart-replica-0-x", group_ids), version, tokens_regenerated=lost)


def test_a_departure_moves_its_groups_to_the_replica_of_its_version_with_the_most_free_cache() -> None:
    ledger, mig = _setup()
    ledger.note_report(_report("replica-0", 3, 300, 300, 8))  # the one leaving
    ledger.note_report(_report("replica-1", 3, 600, 600, 6))  # version 3, 400 tokens free
    ledger.note_report(_report("replica-2", 3, 200, 200, 2))  # version 3, 800 free: the destination
    ledger.note_report(_report("replica-3", 4, 0, 0, 0))  # all free, but another version
    # replica-0 holds g0 and g1; g0 was in flight (in the segment), g1 was leased and not started
    destination, moved = mig.depart("replica-0", _departure(["g00000000"], lost=7), [], at=5.0)
    assert (destination, moved) == ("replica-2", ["g00000000"])
    lease = ledger.state.open_leases["g00000000"]
    assert lease.replica_id == "replica-2" and lease.resume is not None and lease.resume_version == 3
    inbox = mig.incoming_for("replica-2")
    assert [(i.migration_id, i.source, i.segment.group_ids, i.policy_version) for i in inbox] == [
        ("d000001", "replica-0", ["g00000000"], 3)]
    # the lease it had not started goes back as it is (from its prompt)
    assert [(r.group_id, r.resume) for r in ledger.state.returned] == [("g00000001", None)]
    assert "g00000001" not in ledger.state.open_leases
    assert ledger.state.tokens_regenerated == 7  # its groups of another version, thrown away
    # its next incarnation is told (first claim) that it lost nothing, and it is no destination meanwhile
    assert ledger.state.departed == ["replica-0"] and "replica-0" not in ledger.state.replicas
    # the destination takes it: a plain migration from here on
    mig.take("replica-2", [Taken("d000001", ok=True)], at=6.0)
    assert _owners(ledger)["g00000000"] == "replica-2" and ledger.state.repack_groups == 1


def test_a_departure_with_no_replica_of_its_version_returns_the_groups_with_their_prefixes() -> None:
    ledger, mig = _setup()
    ledger.note_report(_report("replica-0", 3, 300, 300, 8))
    ledger.note_report(_report("replica-1", 4, 0, 0, 0))  # newer version only
    destination, moved = mig.depart("replica-0", _departure(["g00000000", "g00000001"]), [], at=5.0)
    assert (destination, moved) == ("", ["g00000000", "g00000001"])
    assert [(r.group_id, r.resume_version) for r in ledger.state.returned] == [("g00000000", 3), ("g00000001", 3)]
    # the next lease carries the segment: the replica that takes it resumes (version 3) or regenerates
    leases = ledger.lease("replica-1", 1)
    assert leases[0].group_id == "g00000000" and leases[0].resume is not None
    assert leases[0].resume.key == keys.migration(RUN, "depart-replica-0-x") and leases[0].resume_version == 3
    # no lease lost: prompt_cursor == generated + failed + open + returned
    s = ledger.state
    assert s.prompt_cursor == s.groups_generated + s.groups_failed + len(s.open_leases) + len(s.returned) == 5


def test_a_departing_replica_is_not_a_destination_and_leaving_ones_are_skipped() -> None:
    ledger, mig = _setup()
    ledger.note_report(_report("replica-0", 3, 300, 300, 8))
    ledger.note_report(_report("replica-1", 3, 0, 0, 0))  # leaving (`laminar scale` removed it)
    destination, _ = mig.depart("replica-0", _departure(["g00000000"]), ["replica-1"], at=5.0)
    # g1 (not started) went back first, then g0 with its segment
    assert destination == "" and [r.resume_version for r in ledger.state.returned] == [-1, 3]


def test_a_declined_departure_goes_back_with_its_segment() -> None:
    ledger, mig = _setup()
    ledger.note_report(_report("replica-0", 3, 300, 300, 8))
    ledger.note_report(_report("replica-1", 3, 0, 0, 0))
    mig.depart("replica-0", _departure(["g00000000"]), [], at=5.0)
    mig.take("replica-1", [Taken("d000001", ok=False)], at=6.0)  # it had loaded version 4 meanwhile
    assert [(r.group_id, r.resume_version, r.resume is not None) for r in ledger.state.returned] == [
        ("g00000001", -1, False), ("g00000000", 3, True)]


def test_a_retried_departure_changes_nothing() -> None:
    ledger, mig = _setup()
    ledger.note_report(_report("replica-0", 3, 300, 300, 8))
    mig.depart("replica-0", _departure(["g00000000"]), [], at=5.0)
    before = (list(ledger.state.returned), dict(ledger.state.open_leases))
    assert mig.depart("replica-0", _departure(["g00000000"]), [], at=6.0) == ("", [])
    assert (list(ledger.state.returned), dict(ledger.state.open_leases)) == before


def test_a_returned_group_with_prefixes_waits_for_a_replica_that_can_continue_it() -> None:
    ledger, mig = _setup()
    ledger.note_report(_report("replica-0", 3, 300, 300, 8))
    mig.depart("replica-0", _departure(["g00000000"]), [], at=100.0)  # no other replica on 3: returned at t=100
    # returned: g1 (plain, not started), then g0 (prefixes under version 3)
    busy_on_4 = _report("replica-1", 4, 500, 500, 6)
    # a busy replica of version 4 gets the plain one and a fresh prompt, not g0 (it would regenerate it)
    got = ledger.lease("replica-1", 2, claimer=busy_on_4, at=101.0)
    assert [lease.group_id for lease in got] == ["g00000001", "g00000005"]
    assert [r.group_id for r in ledger.state.returned] == ["g00000000"]
    # an idle replica (nothing in flight or waiting) takes it: it loads version 3 from a relay first
    idle_on_4 = _report("replica-2", 4, 0, 0, 0)
    assert [lease.resume_version for lease in ledger.lease("replica-2", 1, claimer=idle_on_4, at=102.0)] == [3]
    # and once it has waited RESUME_PREFERENCE_S (15 s), anyone takes it
    mig.depart("replica-2", _departure(["g00000000"]), [], at=200.0)  # g4 (its, not started) back plain
    got = ledger.lease("replica-1", 2, claimer=busy_on_4, at=214.9)
    assert [lease.group_id for lease in got] == ["g00000004", "g00000006"]  # g0 passed by: 14.9 s < 15 s
    assert ledger.lease("replica-1", 1, claimer=busy_on_4, at=215.0)[0].group_id == "g00000000"


def test_an_idle_replica_takes_returned_groups_of_one_version_only() -> None:
    # Two replicas of one host left at once, on versions 3 and 2: their groups are returned with prefixes. An idle
    # replica loads one older version to continue groups, so it gets those of the first version it takes (3) and
    # passes the version-2 group by; a second idle replica then takes that one.
    ledger, mig = _setup()
    ledger.note_report(_report("replica-0", 3, 300, 300, 8))
    ledger.note_report(_report("replica-1", 2, 300, 300, 8))
    mig.depart("replica-0", _departure(["g00000000", "g00000001"], version=3), [], at=100.0)
    mig.depart("replica-1", Departure("notice", _segment("depart-replica-1-x", ["g00000002"]), 2), [], at=100.0)
    idle = _report("replica-5", 5, 0, 0, 0)
    got = ledger.lease("replica-5", 4, claimer=idle, at=101.0)
    assert [(lease.group_id, lease.resume_version) for lease in got] == [
        ("g00000000", 3), ("g00000001", 3), ("g00000003", -1), ("g00000005", -1)]  # g3: replica-1's unstarted
    assert [(r.group_id, r.resume_version) for r in ledger.state.returned] == [("g00000002", 2)]
    assert [lease.group_id for lease in ledger.lease("replica-6", 1, claimer=_report("replica-6", 5, 0, 0, 0),
                                                     at=101.0)] == ["g00000002"]
