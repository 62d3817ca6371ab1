"""The chaos checker turns red on each broken record it exists to catch: a group consumed twice, a group lost,
a mixed-version group, a step gap or repeat, a corrupt checkpoint, a leaked process, a flat reward, a
preempted worker that did not exit 0, a tool call run twice (from real log files). Built from hand-made records
(the checker is pure), so each can fail."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from laminar.chaos.checker import (
    check_accounting,
    check_checkpoints,
    check_faults,
    check_processes,
    check_reward,
    check_steps,
    check_versions,
    detected_at,
    format_verdict,
    judge,
    kind_summary,
    throughput_restored,
)
from laminar.contract import RunStatus
from laminar.reporting.tool_calls import count_tool_calls

T0 = 1_000.0


def status(**kw) -> RunStatus:
    base = dict(run_id="r", phase="finished", step=20, total_steps=20, policy_version=20, ready_groups=2,
                open_leases=1, groups_generated=42, groups_consumed=40, groups_consumed_twice=0, tokens_consumed=0,
                reward_recent=[], versions_in_use=[], max_versions_in_use=1, staleness_histogram={},
                trainer_wait_fraction=0.0, history_events=0, history_events_max=0, continued_as_new=0,
                checkpoints=[], relays=[], replicas=[], started_at=T0, prompts_issued=44, returned_leases=1)
    return RunStatus(**{**base, **kw})


def steps(n: int = 20, rewards=None) -> dict[int, dict]:
    """n steps, one a second from T0+1, 2 groups each (g<step>a, g<step>b) at version step-1, 100 tokens."""
    rewards = rewards or [0.1 + 0.03 * i for i in range(n)]
    return {s: {"step": s, "time": T0 + s, "tokens": 100, "reward_mean": rewards[s - 1], "consumed_twice": 0,
                "groups": {f"g{s}a": [s - 1], f"g{s}b": [s - 1]}} for s in range(1, n + 1)}


def test_green_records_pass_every_check():
    # issued 44 = generated 42 + failed 0 + leased 1 + returned 1; generated 42 = consumed 40 + waiting 2;
    # the 20 step records name 2 groups each: 40 = consumed.
    table = {"stopped": True, "processes": [{"name": "trainer", "pid": 11, "pids": [10, 11]}]}
    faults = [{"index": 0, "kind": "kill", "target": "trainer", "hold_s": 0.0, "injected_at": T0 + 5,
               "healed_at": T0 + 6, "pid": 10, "skipped": False, "detail": ""}]
    v = judge(status(), steps(), {10: None, 20: None}, table, set(), [], faults, {}, T0)
    assert v.green, [c for c in v.checks if not c.ok]
    assert v.numbers["faults_injected"] == 1 and v.numbers["groups_consumed"] == 40


def test_a_group_reported_twice_turns_it_red():
    s = steps()
    s[7]["groups"]["g3a"] = [2]  # step 7 trained a group step 3 already consumed (a double-reporting double)
    c = check_accounting(status(), s)
    assert not c.ok and "g3a" in c.detail
    assert not check_accounting(status(groups_consumed_twice=1), steps()).ok  # the ledger's own count
    s = steps()
    s[4]["consumed_twice"] = 1  # the trainer's
    assert not check_accounting(status(), s).ok


def test_a_lost_or_vanished_group_turns_it_red():
    assert not check_accounting(status(prompts_issued=45), steps()).ok  # one issued group unaccounted for
    assert not check_accounting(status(ready_groups=1), steps()).ok  # one generated group neither consumed nor waiting
    s = steps()
    del s[5]["groups"]["g5b"]  # the ledger counts a consumption no step record names
    assert "name 39 groups" in check_accounting(status(), s).detail
    # dropped with a reason is accounted for: 44 = 41 generated + 1 failed + 1 + 1, 41 = 40 + 1 waiting
    assert check_accounting(status(groups_generated=41, groups_failed=1, ready_groups=1), steps()).ok


def test_mixed_versions_turn_it_red():
    s = steps()
    s[9]["groups"]["g9a"] = [7, 8]
    c = check_versions(s)
    assert not c.ok and c.detail.startswith("1 of 40")
    assert not check_versions({1: {"step": 1}}).ok  # records that name no group cannot vouch for anything


def test_step_gap_and_repeat_turn_it_red():
    s = steps()
    del s[12]
    assert "gap: steps [12]" in check_steps(s, 20).detail
    s = steps()
    s[6]["time"] = T0 + 15.5  # step 6 written again after step 15 (a repeat, not a replayed suffix)
    c = check_steps(s, 20)
    assert not c.ok and "repeat: steps [6]" in c.detail
    s = steps()
    for k in range(6, 21):  # a replay from step 6 rewrites the whole suffix, in order: not a repeat
        s[k]["time"] += 100
    assert check_steps(s, 20).ok
    assert not check_steps(steps(), 21).ok  # the workflow reached step 21: its record is missing


def test_checkpoints_must_verify_and_exist():
    assert check_checkpoints({10: None, 20: None}).ok
    assert not check_checkpoints({10: None, 20: "checkpoint step-20 part model: sha256 mismatch"}).ok
    assert not check_checkpoints({}).ok


def test_reward_must_rise():
    assert check_reward([0.1 + 0.03 * i for i in range(20)]).ok
    assert not check_reward([0.5] * 20).ok
    assert not check_reward([0.1, 0.9]).ok  # fewer than 10 steps: no rise measured


def test_leaked_and_stray_processes_turn_it_red():
    table = {"stopped": True, "processes": [{"name": "rollout-host-0", "pid": 21, "pids": [20, 21]}]}
    assert check_processes(table, set(), []).ok
    assert "rollout-host-0 (pid 20)" in check_processes(table, {20}, []).detail  # an old incarnation lives on
    assert not check_processes(table, set(), [99]).ok
    assert not check_processes({**table, "stopped": False}, set(), []).ok
    assert not check_processes({}, set(), []).ok


def test_faults_must_heal_and_preemption_exit_zero():
    f = {"index": 0, "kind": "preempt", "target": "trainer", "hold_s": 0.0, "injected_at": T0, "healed_at": T0 + 3,
         "pid": 10, "skipped": False}
    assert check_faults([f], {10: 0}).ok
    assert not check_faults([f], {10: 1}).ok
    assert not check_faults([{**f, "kind": "stop", "healed_at": None}], {}).ok
    assert not check_faults([{**f, "injected_at": None, "skipped": True, "detail": "x"}], {}).ok  # nothing injected


def test_throughput_restored_and_tokens_lost():
    # 100 tokens/s for 30 s before the fault at t=30; nothing for 10 s; 100 tokens/s again from t=41.
    pts = [(float(t), 100) for t in range(1, 31)] + [(float(t), 100) for t in range(41, 80)]
    restored, lost = throughput_restored(pts, injected=30.5, healed=35.0)
    # baseline: 30 steps of 100 in [0.5, 30.5) over min(30, 30.5 - 1) = 29.5 s -> 101.7 tok/s. The trailing 10 s
    # window reaches 0.8 * 101.7 = 81.4 tok/s at t=49 (t-10 < u <= t holds steps 41..49: 9 x 100 = 900 / 10 = 90).
    assert restored == 49.0
    # lost = 101.7 * (49 - 30.5) - 900 trained in (30.5, 49] = 1881.4 - 900 = 981
    assert lost == 981
    assert throughput_restored(pts, injected=0.5, healed=1.0) == (None, None)  # no step before the fault
    never = [(float(t), 100) for t in range(1, 31)]
    assert throughput_restored(never, injected=30.5, healed=31.0)[0] is None


@pytest.mark.parametrize("field", ["groups_consumed_twice", "prompts_issued"])
def test_judge_is_red_when_one_check_is(field):
    table = {"stopped": True, "processes": [{"name": "trainer", "pid": 11, "pids": [11]}]}
    faults = [{"index": 0, "kind": "kill", "target": "trainer", "hold_s": 0.0, "injected_at": T0 + 5,
               "healed_at": T0 + 6, "pid": 10, "skipped": False}]
    bad = replace(status(), **{field: getattr(status(), field) + 1})
    assert not judge(bad, steps(), {10: None}, table, set(), [], faults, {}, T0).green


def test_detection_is_the_first_event_about_the_target_near_the_fault():
    st = status(event_times={"trainer_restored/trainer": [T0 + 8, T0 + 90], "relay_lost/host-1": [T0 + 3]})
    f = {"index": 0, "kind": "kill", "target": "trainer", "hold_s": 0.0, "injected_at": T0 + 5, "healed_at": T0 + 6}
    assert detected_at(f, st) == T0 + 8
    # a SIGSTOP healed at +13 that nothing noticed: the restore at +90 (past +13 + 30 s) is another fault's
    assert detected_at({**f, "kind": "stop", "injected_at": T0 + 10, "healed_at": T0 + 13}, st) is None
    assert detected_at({**f, "target": "relay-host-1"}, st) is None  # the relay event came before the fault
    assert detected_at({**f, "target": "store"}, st) == T0 + 5  # noticed by the next call: at injection


def test_kind_summary_medians():
    rows = [{"kind": "kill", "injected_s": 10.0, "detected_s": 12.0, "recovered_s": 15.0, "throughput_restored_s": None,
             "tokens_lost": 100},
            {"kind": "kill", "injected_s": 50.0, "detected_s": 54.0, "recovered_s": 56.0, "throughput_restored_s": 60.0,
             "tokens_lost": 50},
            {"kind": "stop", "injected_s": 70.0, "detected_s": None, "recovered_s": 71.0, "throughput_restored_s": 72.0,
             "tokens_lost": None},
            {"kind": "store", "index": 3, "skipped": "x"}]
    kill, stop, store = kind_summary(rows)
    # kill: detection after 2 s and 4 s -> median 3; recovery after 5 and 6 -> 5.5; restored once, after 10 s
    assert kill == {"kind": "kill", "faults": 2, "skipped": 0, "detected": 2, "detect_s_p50": 3.0,
                    "recover_s_p50": 5.5, "restored": 1, "restore_s_p50": 10.0, "tokens_lost": 150}
    assert stop["detected"] == 0 and stop["detect_s_p50"] is None and stop["tokens_lost"] == 0
    # a kind whose only fault was skipped keeps its row: 0 injected, 1 skipped
    assert store == {"kind": "store", "faults": 0, "skipped": 1, "detected": 0, "detect_s_p50": None,
                     "recover_s_p50": None, "restored": 0, "restore_s_p50": None, "tokens_lost": 0}


def _fault(index: int, kind: str, target: str, **kw) -> dict:
    return {"index": index, "kind": kind, "target": target, "hold_s": 5.0, "injected_at": T0 + 5 + index,
            "healed_at": T0 + 10 + index, "pid": None, "skipped": False, "detail": "", **kw}


def test_a_kind_the_machine_cannot_inject_is_reported_skipped_never_left_out():
    table = {"stopped": True, "processes": [{"name": "trainer", "pid": 11, "pids": [11]}]}
    reason = "no packet filter on this machine"
    faults = [_fault(0, "kill", "trainer", pid=10),
              _fault(1, "partition", "relay-host-0", injected_at=None, healed_at=None, skipped=True, detail=reason),
              _fault(2, "partition", "relay-host-1", injected_at=None, healed_at=None, skipped=True, detail=reason)]
    v = judge(status(), steps(), {10: None}, table, set(), [], faults, {}, T0)
    assert v.green  # skipped is not red: the machine, not the run, is short of something
    assert v.numbers["fault_kinds"] == ["kill"] and v.numbers["fault_kinds_skipped"] == ["partition"]
    assert v.numbers["faults_skipped"] == 2
    by = {c.name: c for c in v.checks}
    assert "kinds never injected (skipped): partition" in by["faults"].detail
    report = format_verdict(v)
    # the per-kind table: partition 0 injected, 2 skipped; the fault table: each skipped row with its reason
    assert "| partition | 0 | 2 | 0 |" in report
    assert report.count(f"| skipped | | | | | | | {reason} |") == 2
    # a kind injected once and skipped once is not a skipped kind
    faults[2] = _fault(2, "partition", "relay-host-1", detail="iptables drop tcp port(s) [7000]")
    v = judge(status(), steps(), {10: None}, table, set(), [], faults, {}, T0)
    assert v.numbers["fault_kinds_skipped"] == [] and "| partition | 1 | 1 |" in format_verdict(v)


def test_readonly_faults_are_accounted_for():
    table = {"stopped": True, "processes": [{"name": "trainer", "pid": 11, "pids": [11]}]}
    ro = [_fault(0, "readonly", "store", refused=7, detail="7 write(s) refused with AccessDenied"),
          _fault(1, "readonly", "store", refused=0, detail="0 write(s) refused with AccessDenied")]
    v = judge(status(), steps(), {10: None}, table, set(), [], ro, {}, T0)
    # 7 + 0 refused; noticed at injection (the store's callers see the refusal at once)
    assert v.green and v.numbers["writes_refused"] == 7, [c for c in v.checks if not c.ok]
    assert "7 write(s) refused by a read-only store" in {c.name: c for c in v.checks}["faults"].detail
    assert v.faults[0]["detected_s"] == 5.0 and v.faults[0]["note"] == "7 write(s) refused with AccessDenied"
    assert "| 7 write(s) refused with AccessDenied |" in format_verdict(v)
    # injected without a count of what it refused (the switch back never answered): red
    assert not check_faults([{**ro[0], "refused": None}], {}).ok
    # and not healed (the store stayed read-only): red
    assert not check_faults([{**ro[0], "healed_at": None}], {}).ok


def test_a_run_that_did_not_end_is_red_and_still_judged_from_its_records():
    table = {"stopped": True, "processes": [{"name": "trainer", "pid": 11, "pids": [11]}]}
    faults = [{"index": 0, "kind": "kill", "target": "trainer", "hold_s": 0.0, "injected_at": T0 + 5,
               "healed_at": T0 + 6, "pid": 10, "skipped": False}]
    v = judge(None, steps(), {10: None}, table, set(), [], faults, {}, T0, "run r did not stop within 300s")
    by = {c.name: c for c in v.checks}
    assert not v.green and not by["run ended"].ok and "did not stop" in by["run ended"].detail
    assert not by["accounting"].ok and by["steps"].ok and by["versions"].ok  # steps 1..20 from the records alone
    assert v.numbers["steps"] == 20


def test_a_tool_call_run_twice_turns_it_red_and_a_failures_retry_does_not(tmp_path):
    # two replicas' logs (JSON lines, as `laminar chaos` runs its child): g1's call ran twice with no failure
    # between (red); g2 was retried after a failed reward, so its second run is the retry's (green)
    def line(event: str, **kw) -> str:
        return json.dumps({"event": event, "run_id": "r", **kw}) + "\n"

    call = dict(sample=0, turn=0, call_sha="abc")
    (tmp_path / "rollout-host-0.log").write_text(line("tool_executed", group_id="g1", **call)
                                                 + line("tool_executed", group_id="g2", **call))
    (tmp_path / "rollout-host-0.1.log").write_text(line("tool_executed", group_id="g1", **call))  # its successor
    (tmp_path / "rollout-host-1.log").write_text(line("group_retried", group_id="g2")
                                                 + line("tool_executed", group_id="g2", **call))
    table = {"stopped": True, "processes": [{"name": "trainer", "pid": 11, "pids": [10, 11]}]}
    faults = [_fault(0, "kill", "trainer", pid=10)]
    twice = judge(status(), steps(), {10: None}, table, set(), [], faults, {}, T0,
                  tool_calls=count_tool_calls(tmp_path, "r"))
    by = {c.name: c for c in twice.checks}
    assert not twice.green and not by["tool calls run once"].ok
    assert by["tool calls run once"].detail == "4 runs of 2 calls; 1 run again; 1 run again by a failure's retry"
    (tmp_path / "rollout-host-0.1.log").unlink()
    (tmp_path / "rollout-host-0.log").write_text(line("tool_executed", group_id="g2", **call))
    v = judge(status(), steps(), {10: None}, table, set(), [], faults, {}, T0,
              tool_calls=count_tool_calls(tmp_path, "r"))
    assert v.green, [c for c in v.checks if not c.ok]
    assert (v.numbers["tool_calls_rerun"], v.numbers["tool_calls_executed"],
            v.numbers["tool_calls_rerun_after_failure"]) == (0, 2, 1)
    assert "| tool calls run once | yes | 2 runs of 1 calls; 0 run again; 1 run again by a failure's retry |" \
        in format_verdict(v)
    # logs not on this machine: not counted, said so, not red
    v = judge(status(), steps(), {10: None}, table, set(), [], faults, {}, T0)
    assert v.green and v.numbers["tool_calls_rerun"] is None
    assert "not counted" in {c.name: c for c in v.checks}["tool calls run once"].detail
