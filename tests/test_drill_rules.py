"""Drill report arithmetic (drills/rules.py) on hand-made run snapshots."""

from __future__ import annotations

import pytest

from laminar.contract import RelayInfo, ReplicaReport, RunStatus
from laminar.drills import rules
from laminar.errors import ConfigError


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


def test_a_rollout_fault_during_a_migration_goes_to_its_source():
    st = status(migrating=["replica-0->replica-1"])
    # replica-1 has more in flight, but replica-0 is the source of the pending migration
    assert rules.resolve_target("rollout", "", st, "migration") == ("replica-0", "rollout-host-0")
    assert rules.resolve_target("rollout", "replica-1", st, "migration") == ("replica-1", "rollout-host-1")
    with pytest.raises(ConfigError, match="--during 'repack'"):
        rules.resolve_target("rollout", "", st, "repack")


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


def events(*items: tuple[str, str, float]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for kind, subject, at in items:
        out.setdefault(f"{kind}/{subject}", []).append(at)
    return out


def test_rollout_detection_and_recovery_from_activity_view_and_events():
    st = status(event_times=events(("replica_rejoined", "replica-1", 106.0), ("replica_recovered", "replica-1", 108.5)))
    steps = [101.0, 103.0, 105.0, 107.0, 109.0]
    acts = [rules.ActivityView("rollout-replica-1", "run_rollout_replica", 2, 105.5)]
    detected = rules.detected_at("rollout", "replica-1", 100.0, st, acts)
    assert detected == 105.5  # the timed-out attempt's completion time
    assert rules.detected_at("rollout", "replica-1", 100.0, st, []) == 106.0  # fallback: the rejoin event
    recovered = rules.recovered_at("rollout", "replica-1", 100.0, detected, st, steps, 2)
    assert recovered == 108.5
    report = rules.build_report("d", "rollout", "replica-1", 100.0, status(), st, detected, recovered, steps, 130.0)
    # steps strictly inside (100, 108.5): 101, 103, 105, 107 -> 4
    # gaps between 100, 101, 103, 105, 107, 108.5: 1, 2, 2, 2, 1.5 -> longest 2
    assert report.steps_during_outage == 4 and report.trainer_stall_s == 2.0
    assert report.recovered and report.groups_lost == 0


def test_no_recovery_is_reported_as_such_and_the_stall_runs_to_the_end_of_observation():
    # the last step completed at 90, before the fault at 100; observation ended at 400 with no recovery:
    # the stall is 400 - 100 = 300 s (it used to be measured up to the last step: 90 - 100 = -10, then -301)
    st = status()
    report = rules.build_report("d", "trainer", "trainer", 100.0, st, st, None, None, [90.0], 400.0, "no recovery")
    assert not report.recovered and report.recovered_at is None and report.steps_during_outage == 0
    assert report.trainer_stall_s == 300.0
    # steps that did complete during an unrecovered outage are counted: 150 and 160 -> 2; gaps 50, 10, 240
    report = rules.build_report("d", "relay", "host-1", 100.0, st, st, 120.0, None, [150.0, 160.0], 400.0)
    assert report.steps_during_outage == 2 and report.trainer_stall_s == 240.0


def test_recovery_is_found_at_any_step_rate():
    # 10 steps/s for 300 s after the fault at 100: 3000 step times, far more than any status window;
    # the relay was lost at 104 (detected), so the first step after 104 is the recovery: 104.1
    steps = [100.0 + 0.1 * i for i in range(1, 3001)]
    st = status(event_times=events(("relay_lost", "host-1", 104.0)))
    detected = rules.detected_at("relay", "host-1", 100.0, st, [])
    assert detected == 104.0
    assert rules.recovered_at("relay", "host-1", 100.0, detected, st, steps, 2) == pytest.approx(104.1)
    # a step a minute: the first step after detection is 160 -> recovered at 160
    assert rules.recovered_at("relay", "host-1", 100.0, detected, st, [40.0, 100.5, 160.0], 2) == 160.0


def test_one_relay_recovers_only_once_it_is_back_in_the_chain():
    # one relay: lost at 104 (detected); steps at 105 and 106 published nowhere; it re-joined at 106.5
    st = status(event_times=events(("relay_lost", "host-0", 104.0)))
    steps = [105.0, 106.0, 107.0]
    assert rules.recovered_at("relay", "host-0", 100.0, 104.0, st, steps, 1) is None  # not re-joined yet
    st = status(event_times=events(("relay_lost", "host-0", 104.0), ("relay_joined", "host-0", 106.5)))
    assert rules.recovered_at("relay", "host-0", 100.0, 104.0, st, steps, 1) == 107.0
    # with two relays the rebuilt chain (the survivor) is there at detection: 105
    assert rules.recovered_at("relay", "host-0", 100.0, 104.0, st, steps, 2) == 105.0


def test_control_recovery_counts_only_steps_the_workflow_scheduled_after_the_fault(tmp_path):
    import json

    from laminar.drills.observer import StepClock
    from laminar.storage import keys
    from laminar.storage.objects import open_store

    store = open_store((tmp_path / "store").as_uri())
    # step 11 was scheduled at 99 (before the control worker died at 100) and completes at 100.07 without it;
    # step 12 was scheduled at 111.5 by the restarted control worker and completes at 111.8
    for step, done, scheduled in [(11, 100.07, 99.0), (12, 111.8, 111.5)]:
        store.put(keys.step_metrics("r", step), json.dumps({"time": done, "scheduled_at": scheduled}).encode())
    clock = StepClock(store, "r", after_step=10)
    assert clock.times_until(12) == [100.07, 111.8]
    assert clock.recovery_candidates("control", 100.0) == [111.8]
    assert clock.recovery_candidates("trainer", 100.0) == [100.07, 111.8]
    st = status()
    assert rules.recovered_at("control", "control", 100.0, 100.0, st, clock.recovery_candidates("control", 100.0),
                              2) == 111.8
    assert clock.times_until(13) == [100.07, 111.8]  # step 13 has no record yet: read it next time


def test_a_preempt_drill_targets_a_role_and_follows_that_roles_rules():
    st = status()
    assert rules.resolve_target("preempt", "trainer", st) == ("trainer", "trainer")
    assert rules.resolve_target("preempt", "rollout", st) == ("replica-1", "rollout-host-1")  # most in flight
    assert rules.resolve_target("preempt", "rollout:replica-0", st) == ("replica-0", "rollout-host-0")
    assert rules.resolve_target("preempt", "relay", st) == ("host-1", "relay-host-1")  # the chain's tail
    assert rules.resolve_target("preempt", "relay:host-0", st) == ("host-0", "relay-host-0")
    for bad in ("", "control", "store", "trainer:x", "replica-0"):
        with pytest.raises(ConfigError, match="rollout, relay, trainer"):
            rules.resolve_target("preempt", bad, st)
    with pytest.raises(ConfigError, match="replica-0"):
        rules.resolve_target("preempt", "rollout:replica-9", st)
    assert [rules.rule_kind("preempt", p) for p in ("trainer", "rollout-host-1", "relay-host-0")] == [
        "preempt-trainer", "preempt-rollout", "preempt-relay"]
    assert rules.rule_kind("relay", "relay-host-0") == "relay"


def test_preempt_detection_is_the_notice_and_recovery_is_the_roles():
    # the notice at 100 is its own detection. trainer: the successor's first step committed as restored at 112.
    # relay host-1, the same rule as a killed relay: it left the chain at 100.4 (its leaving update: relay_lost),
    # so with another relay in the chain the run is whole at the next step, 101; with no other relay, only once its
    # new incarnation joined (104): the first step after that is 105
    st = status(event_times=events(("trainer_restored", "trainer", 112.0), ("trainer_restored", "trainer", 90.0),
                                   ("relay_lost", "host-1", 100.4), ("relay_lost", "host-1", 40.0),
                                   ("relay_joined", "host-1", 104.0), ("relay_joined", "host-1", 50.0)))
    assert rules.detected_at("preempt-trainer", "trainer", 100.0, st, []) == 100.0
    assert rules.recovered_at("preempt-trainer", "trainer", 100.0, 100.0, st, [101.0, 112.0], 2) == 112.0
    assert rules.recovered_at("preempt-relay", "host-1", 100.0, 100.0, st, [101.0, 103.0, 105.0], 2) == 101.0
    assert rules.recovered_at("preempt-relay", "host-1", 100.0, 100.0, st, [101.0, 103.0, 105.0], 1) == 105.0
    # not out of the chain yet (only a leave before the fault), and not re-joined: not recovered
    assert rules.recovered_at("preempt-relay", "host-0", 100.0, 100.0, st, [101.0], 2) is None
    assert rules.recovered_at("preempt-relay", "host-0", 100.0, 100.0, st, [101.0], 1) is None


def test_the_throughput_baseline_is_the_minute_before_the_fault():
    # a step of 100 tokens every 2 s from t=2 to t=100, fault at 100: the minute (40, 100] holds the steps at
    # 42, 44, ..., 100: 30 steps, 3000 tokens over 60 s -> 50 tokens/s (the step at 40 is outside)
    steps = [(2.0 * i, 100) for i in range(1, 51)]
    assert rules.baseline_tokens_per_s(steps, 100.0) == pytest.approx(50.0)
    # a run 20 s old at the fault: its first step (t=82, tokens made before it) starts the span, so the steps
    # at 84..100 (9 steps, 900 tokens) over 18 s -> 50 tokens/s
    young = [(80.0 + 2.0 * i, 100) for i in range(1, 11)]
    assert rules.baseline_tokens_per_s(young, 100.0) == pytest.approx(50.0)
    assert rules.baseline_tokens_per_s([(100.0, 100)], 100.0) is None  # one step: no span
    assert rules.baseline_tokens_per_s([(101.0, 100)], 100.0) is None  # nothing before the fault
    assert rules.no_baseline_note(steps, 100.0) == rules.no_baseline_note(young, 100.0) == ""


def test_a_run_that_stepped_less_than_a_window_before_the_fault_has_no_baseline_and_says_so():
    # A relay drill 0.8 s into a run (a clean-clone CI run's): 13 steps on groups made before the first one, 651
    # tokens/s, against a steady 454-508 after the fault, which never reached 90 % of it. Modelled: a burst of 13
    # steps of 50 tokens in 0.78 s, then a steady 500 tokens/s (10 steps a second)
    burst = [(99.22 + 0.06 * i, 50) for i in range(13)]
    steady = [(100.0 + 0.1 * i, 50) for i in range(1, 700)]
    assert rules.baseline_tokens_per_s(burst, 100.0) is None
    assert rules.throughput_restored_at(burst + steady, 100.0, observed_until=170.0) is None
    assert rules.baseline_tokens_per_s(burst, 100.0, min_s=0.0) == pytest.approx(12 * 50 / 0.78)  # the old figure
    note = rules.no_baseline_note(burst, 100.0)
    assert note == ("no throughput baseline: the run had stepped for 0.8s before the fault (at least 10s needed: "
                    "inject later, e.g. a larger --at-step)")
    # 10 s of steps before the fault (the burst, then steady) is a baseline again, and the throughput is back
    older = [(89.22 + 0.06 * i, 50) for i in range(13)] + [(90.0 + 0.1 * i, 50) for i in range(1, 101)]
    assert rules.baseline_span_s(older, 100.0) == pytest.approx(10.78) and rules.no_baseline_note(older, 100.0) == ""
    assert rules.throughput_restored_at(older + steady, 100.0, observed_until=170.0) is not None


def test_throughput_is_restored_at_the_end_of_the_first_good_window_after_the_fault():
    # baseline 50 tokens/s (as above: 100 tokens every 2 s up to the fault at 100). The trainer stalls until
    # 120, then steps every 2 s again from 121: 121, 123, ... With a 10 s window and the 90 % bar (45 tokens/s,
    # 450 tokens in the window), candidate window ends are 110 and each step after it:
    #   (111, 121]: 1 step -> 10/s; (113, 123]: 2 -> 20/s; ... (119, 129]: 5 steps -> 500 tokens = 50/s >= 45
    # so throughput is back at 129.
    before = [(2.0 * i, 100) for i in range(1, 51)]
    after = [(121.0 + 2.0 * i, 100) for i in range(0, 20)]
    assert rules.throughput_restored_at(before + after, 100.0, observed_until=200.0) == 129.0
    # observed only up to 128: not yet
    assert rules.throughput_restored_at(before + after, 100.0, observed_until=128.0) is None
    # no stall at all (steps go on every 2 s): the first window wholly after the fault, (100, 110], holds
    # 102..110: 5 steps -> 50/s, back at 110 (injection + window: the earliest the figure can say)
    steady = [(2.0 * i, 100) for i in range(1, 101)]
    assert rules.throughput_restored_at(steady, 100.0, observed_until=200.0) == 110.0
    # back at only 80 % (a step of 80 tokens every 2 s = 40/s < 45): never restored
    slower = before + [(100.0 + 2.0 * i, 80) for i in range(1, 50)]
    assert rules.throughput_restored_at(slower, 100.0, observed_until=200.0) is None
    # no baseline (the fault came before any step): None
    assert rules.throughput_restored_at(after, 100.0, observed_until=200.0) is None


def test_the_throughput_window_spans_several_steps_at_a_slow_step_rate():
    # 2 s steps: the minute before the fault holds 30 -> mean interval 2 s, 5 of them = 10 s (the minimum)
    assert rules.throughput_window_s([(2.0 * i, 100) for i in range(1, 51)], 100.0) == pytest.approx(10.0)
    # a step of 300 tokens every 6 s up to the fault at 102 (6, 12, ..., 102): the minute (42, 102] holds
    # 48..102, 10 steps -> baseline 3000 / 60 = 50 tokens/s, interval 6 s, window 5 * 6 = 30 s
    before = [(6.0 * i, 300) for i in range(1, 18)]
    assert rules.throughput_window_s(before, 102.0) == pytest.approx(30.0)
    # the trainer comes back at 130 and steps every 6 s: 130, 136, ... A 10 s window would call it back at
    # 136 on two steps ((126, 136]: 600 tokens = 60/s >= 45), a rate no 6 s stepping sustains. With the
    # 30 s window, the 90 % bar is 45/s = 1350 tokens: (118, 148] holds 130..148, 4 steps = 1200 < 1350;
    # (124, 154] holds 130..154, 5 steps = 1500 >= 1350 -> back at 154
    after = [(130.0 + 6.0 * i, 300) for i in range(0, 10)]
    assert rules.throughput_restored_at(before + after, 102.0, observed_until=300.0) == 154.0
    assert rules.throughput_restored_at(before + after, 102.0, observed_until=300.0, window_s=10.0) == 136.0


def test_tokens_lost_come_from_the_runs_counter_before_and_after():
    # 838 tokens thrown away during the drill: 1000 counted before it, 1838 after
    report = rules.build_report("d", "preempt", "trainer", 100.0, status(tokens_regenerated=1000),
                                status(tokens_regenerated=1838), 100.0, 112.0, [112.0], 130.0, "", 129.0)
    assert (report.tokens_lost, report.throughput_restored_at) == (838, 129.0)


def test_laminar_drill_rejects_a_bad_preempt_target_before_starting_anything(tmp_path):
    import asyncio

    from laminar.client.settings import Settings
    from laminar.contract import DrillInput
    from laminar.drills.command import run_drill

    settings = Settings.from_env({"LAMINAR_HOME": str(tmp_path)})  # nothing listens there: no connection is made
    for target in ("", "store", "trainer:2"):
        with pytest.raises(ConfigError, match=f"--fault preempt --target {target!r}: use one of rollout, relay"):
            asyncio.run(run_drill(settings, DrillInput(run_id="r", drill_id="", fault="preempt", target=target)))


def test_the_step_clock_reads_the_minute_before_the_fault_a_few_records_a_round(tmp_path):
    import json

    from laminar.drills.observer import StepClock
    from laminar.storage import keys
    from laminar.storage.objects import open_store

    store = open_store((tmp_path / "store").as_uri())
    # steps 1..30 completed every 4 s (4, 8, ..., 120), 50 tokens each; the drill planned at step 30 and the
    # fault came at 121: the minute before it starts at 61, so the reads stop at step 15 (t=60 <= 61)
    for step in range(1, 31):
        store.put(keys.step_metrics("r", step), json.dumps({"time": 4.0 * step, "tokens": 50}).encode())
    clock = StepClock(store, "r", after_step=30)
    clock.read_before(61.0, limit=10)  # steps 30..21
    assert not clock.baseline_read and sorted(clock.before) == list(range(21, 31))
    clock.read_before(61.0, limit=10)  # steps 20..15: 15 completed at 60 <= 61, done
    assert clock.baseline_read and sorted(clock.before) == list(range(15, 31))
    clock.read_before(61.0)  # nothing more to read
    assert len(clock.before) == 16
    store.put(keys.step_metrics("r", 31), json.dumps({"time": 124.0, "tokens": 50}).encode())
    clock.times_until(31)
    # (completion time, tokens) of steps 15..31; the baseline: steps 16..30 in (61, 121], 15 x 50 = 750 tokens
    # over 60 s = 12.5 tokens/s
    assert sorted(clock.tokens()) == [(4.0 * s, 50) for s in range(15, 32)]
    assert rules.baseline_tokens_per_s(clock.tokens(), 121.0) == pytest.approx(12.5)
