"""Drill report arithmetic (services/drill.py) on hand-made run snapshots."""

from __future__ import annotations

import pytest

from laminar.errors import ConfigError
from laminar.messages import RelayInfo, ReplicaReport, RunEvent, RunStatus
from services import drill as rules


def status(**kw) -> RunStatus:
    base = dict(
        run_id="r", phase="running", step=10, total_steps=100, policy_version=10, ready_groups=2, open_leases=3,
        groups_generated=42, groups_consumed=40, groups_consumed_twice=0, tokens_consumed=0, reward_recent=[],
        versions_in_use=[9, 10], max_versions_in_use=2, staleness_histogram={}, trainer_wait_fraction=0.0,
        history_events=0, history_events_max=0, continued_as_new=0, checkpoints=[],
        relays=[RelayInfo("host-0", "host-0", "a:1"), RelayInfo("host-1", "host-1", "a:2")],
        replicas=[ReplicaReport("replica-0", "host-0", 9, in_flight=3), ReplicaReport("replica-1", "host-1", 10, 5)],
        started_at=0.0, prompts_issued=46, returned_leases=1,
    )
    base.update(kw)
    return RunStatus(**base)


def test_resolve_target_per_fault():
    st = status()
    assert rules.resolve_target("rollout", "", st) == ("replica-1", "rollout-host-1")  # most in flight
    assert rules.resolve_target("rollout", "replica-0", st) == ("replica-0", "rollout-host-0")
    assert rules.resolve_target("relay", "", st) == ("host-1", "relay-host-1")  # the chain's tail
    assert rules.resolve_target("master-relay", "", st) == ("host-0", "relay-host-0")
    assert rules.resolve_target("trainer", "", st) == ("trainer", "trainer")
    with pytest.raises(ConfigError, match="replica-0"):
        rules.resolve_target("rollout", "replica-9", st)
    with pytest.raises(ConfigError, match="not one of"):
        rules.resolve_target("disk", "", st)
    with pytest.raises(ConfigError, match="master is host-0"):
        rules.resolve_target("master-relay", "host-1", st)


def test_groups_lost_is_issued_minus_accounted():
    # 46 issued = 40 consumed + 2 ready + 3 leased + 1 queued for re-lease -> 0 lost
    assert rules.groups_lost(status()) == 0
    # one group vanished from every set: 46 - 45 = 1
    assert rules.groups_lost(status(open_leases=2)) == 1


def test_trainer_stall_is_longest_gap_in_window():
    # window [100, 110]; steps at 101, 102, 107 -> gaps 1, 1, 5, 3 -> 5
    assert rules.trainer_stall_s([95.0, 101.0, 102.0, 107.0, 120.0], 100.0, 110.0) == 5.0
    # no step inside the window: the whole window
    assert rules.trainer_stall_s([90.0], 100.0, 104.0) == 4.0


def test_rollout_detection_and_recovery_from_activity_view_and_events():
    events = [RunEvent("replica_rejoined", "replica-1", 106.0), RunEvent("replica_recovered", "replica-1", 108.5)]
    st = status(events=events, step_times=[101.0, 103.0, 105.0, 107.0, 109.0])
    acts = [rules.ActivityView("rollout-replica-1", "run_rollout_replica", 2, 105.5)]
    detected = rules.detected_at("rollout", "replica-1", 100.0, st, acts)
    assert detected == 105.5  # the timed-out attempt's completion time
    assert rules.detected_at("rollout", "replica-1", 100.0, st, []) == 106.0  # fallback: the rejoin event
    recovered = rules.recovered_at("rollout", "replica-1", 100.0, detected, st)
    assert recovered == 108.5
    report = rules.build_report("d", "rollout", "replica-1", 100.0, status(), st, detected, recovered)
    # steps strictly inside (100, 108.5): 101, 103, 105, 107 -> 4
    # gaps between 100, 101, 103, 105, 107, 108.5: 1, 2, 2, 2, 1.5 -> longest 2
    assert report.steps_during_outage == 4 and report.trainer_stall_s == 2.0
    assert report.recovered and report.groups_lost == 0


def test_no_recovery_is_reported_as_such():
    st = status(step_times=[90.0])
    report = rules.build_report("d", "trainer", "trainer", 100.0, st, st, None, None, "no recovery")
    assert not report.recovered and report.recovered_at is None and report.steps_during_outage == 0
