"""The watchdog's diagnosis (laminar/watchdog.py): every branch on worked cases, the facts of a real status and
of a real Ledger's state, and the config bound."""

from __future__ import annotations

import pytest

from laminar.config import RunConfig
from laminar.contract import RelayInfo, ReplicaReport
from laminar.errors import ConfigError
from laminar.watchdog import Facts, diagnose, facts_of_status, stall_line
from laminar.workflows.ledger import Ledger
from laminar.workflows.state import RunState

WARN = 60.0


def facts(**kw) -> Facts:
    base = dict(phase="running", idle_s=0.0, stall_warn_s=WARN, trainer_ready=True, relays_joined=2,
                replicas_wanted=2, silent_s={"replica-0": 1.0, "replica-1": 2.0})
    return Facts(**{**base, **kw})


def test_healthy_runs_and_fresh_stalls_are_quiet() -> None:
    assert diagnose(facts(idle_s=10.0)) is None
    assert diagnose(facts(idle_s=59.9)) is None  # just under run.stall_warn_s=60
    # a replica loading its weights for 30 s < 60 s is not yet a stall
    assert diagnose(facts(idle_s=10.0, unversioned_s={"replica-1": 30.0})) is None


@pytest.mark.parametrize("phase", ["paused", "stopping", "finished", "failed"])
def test_a_run_that_is_not_running_never_stalls(phase: str) -> None:
    assert diagnose(facts(phase=phase, idle_s=1000.0, silent_s={})) is None


def test_starting_without_relays_waits_for_weights_then_for_the_trainer() -> None:
    assert diagnose(facts(phase="starting", trainer_ready=False, idle_s=30.0, relays_joined=0)) is None
    kind, reason = diagnose(facts(phase="starting", trainer_ready=False, idle_s=61.0, relays_joined=0))
    assert kind == "weights" and "no relay joined in 61s" in reason
    kind, reason = diagnose(facts(phase="starting", trainer_ready=False, idle_s=90.0, relays_joined=2))
    assert kind == "trainer" and "not initialised after 90s (2 relays joined)" in reason


def test_a_replica_without_weights_past_the_bound_waits_for_weights_even_while_steps_come() -> None:
    # replica-1 has reported version -1 for 75 s >= 60 s; the trainer stepped 5 s ago: still a stall
    kind, reason = diagnose(facts(idle_s=5.0, unversioned_s={"replica-1": 75.0}))
    assert kind == "weights"
    assert "1 replica(s)" in reason and "replica-1 (75s)" in reason and "run.stall_warn_s=60s" in reason


def test_a_silent_unversioned_replica_is_a_replicas_wait_not_a_weights_one() -> None:
    # both replicas silent for 70 s (their worker stopped); replica-0 had no weights: it is not reporting, so the
    # run waits for replicas (no replica to load weights into)
    f = facts(idle_s=70.0, silent_s={"replica-0": 70.0, "replica-1": 70.0}, unversioned_s={"replica-0": 70.0},
              ready_groups=1, open_leases=3)
    kind, reason = diagnose(f)
    assert kind == "replicas"
    assert "0 of 2 replicas reported in the last 60s (1 ready groups, 3 leases in flight)" in reason


def test_no_replica_ever_reported_is_a_replicas_wait() -> None:
    assert diagnose(facts(idle_s=61.0, silent_s={}))[0] == "replicas"


def test_a_step_in_flight_or_an_unused_batch_waits_for_the_trainer() -> None:
    kind, reason = diagnose(facts(idle_s=120.0, training=True))
    assert kind == "trainer" and "a train step is in flight" in reason and "120s" in reason
    kind, reason = diagnose(facts(idle_s=61.0, has_batch=True, ready_groups=4))
    assert kind == "trainer" and "batch ready (4 ready groups)" in reason


def test_reporting_replicas_without_a_batch_wait_for_groups() -> None:
    # replica-0 reported 1 s ago, replica-1 is silent for 80 s: 1 of 2 reporting
    f = facts(idle_s=80.0, ready_groups=1, open_leases=2, silent_s={"replica-0": 1.0, "replica-1": 80.0})
    kind, reason = diagnose(f)
    assert kind == "groups"
    assert "no step for 80s: 1 ready groups are not a batch, 2 leases in flight, 1 of 2 replicas reporting" == reason


def _status_of(state: RunState, **kw):
    return Ledger(state).status(phase="running", total_steps=10, history_events=0, **kw)


def test_facts_of_a_real_ledgers_status() -> None:
    # the trainer was ready at t=100 and stepped last at t=130; replica-0 reported at t=140 with weights,
    # replica-1 at t=145 still without (first at t=110). At t=200: idle 70 s, replica-1 unversioned 90 s.
    state = RunState(run_id="r", started_at=0.0, trainer_ready=True, trainer_ready_at=100.0, last_step_at=130.0)
    state.relays["host-0"] = RelayInfo(relay_id="host-0", host_id="host-0", address="127.0.0.1:1")
    ledger = Ledger(state)
    ledger.note_report(ReplicaReport(replica_id="replica-1", host_id="h", policy_version=-1), at=110.0)
    ledger.note_report(ReplicaReport(replica_id="replica-0", host_id="h", policy_version=2), at=140.0)
    ledger.note_report(ReplicaReport(replica_id="replica-1", host_id="h", policy_version=-1), at=145.0)
    st = _status_of(state, stall_warn_s=WARN, replicas_wanted=2, has_batch=False)
    f = facts_of_status(st, now=200.0)
    assert f.idle_s == 70.0 and f.relays_joined == 1
    assert f.silent_s == {"replica-0": 60.0, "replica-1": 55.0}
    assert f.unversioned_s == {"replica-1": 90.0}
    # replica-0 is silent for exactly 60 s (not < 60: not reporting); replica-1 reports without weights
    assert stall_line(st, 200.0) == ("waits for weights: 1 replica(s) report no policy version (-1) after "
                                     "run.stall_warn_s=60s: replica-1 (90s)")
    # replica-1 loads version 2 at t=150: its wait ends; at t=200 the run waits for groups (1 of 2 reporting)
    ledger.note_report(ReplicaReport(replica_id="replica-1", host_id="h", policy_version=2), at=150.0)
    st = _status_of(state, stall_warn_s=WARN, replicas_wanted=2, has_batch=False)
    assert st.unversioned_since == {}
    assert stall_line(st, 200.0).startswith("waits for groups: no step for 70s")
    # before the first step the trainer's readiness is the start of the wait: at t=150, 50 s < 60 s
    state.last_step_at = None
    st = _status_of(state, stall_warn_s=WARN, replicas_wanted=2, has_batch=False)
    assert facts_of_status(st, now=150.0).idle_s == 50.0 and stall_line(st, 150.0) is None


def test_a_status_from_before_the_watchdog_prints_no_line() -> None:
    st = _status_of(RunState(run_id="r", last_step_at=0.0))  # stall_warn_s defaults to 0
    assert stall_line(st, 10_000.0) is None


def test_stall_warn_s_is_validated_with_field_and_value() -> None:
    assert RunConfig.load(None, []).run.stall_warn_s == 60.0
    with pytest.raises(ConfigError) as exc:
        RunConfig.load(None, ["run.stall_warn_s=0.5"])
    assert "run.stall_warn_s=0.5" in str(exc.value) and "greater than or equal to 1" in str(exc.value)
