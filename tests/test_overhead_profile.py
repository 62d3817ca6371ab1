"""The time-breakdown arithmetic (laminar/timing.py, the summary's profile) and the overhead bench's
reward-threshold arithmetic (bench/overhead.py). No timing is asserted: clocks are stepped by hand."""

from __future__ import annotations

import json

import pytest

from laminar.bench.overhead import cpu_total, ratios, side, time_to_reward
from laminar.contract import RunStatus
from laminar.reporting.summary import build_profile, build_summary, format_profile
from laminar.storage import keys
from laminar.storage.objects import LocalObjectStore
from laminar.timing import TimeBreakdown, merge


class SteppedClock:
    """A clock that reads `now`, moved by the test."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_breakdown_buckets_counts_and_other():
    clock = SteppedClock(100.0)
    tb = TimeBreakdown(clock=clock)
    tb.add("generate", 2.0, count=16)  # one engine step of 2 s over 16 sequences: 16 tokens
    tb.add("generate", 1.0, count=8)
    clock.now = 103.0
    with tb.measure("claim"):
        clock.now = 103.5  # a claim round trip of 0.5 s
    tb.latency("queue", 0.25)  # overlaps the buckets: not part of the split
    clock.now = 110.0
    d = tb.to_dict()
    # wall = 110 - 100 = 10 s; buckets 3.0 (generate) + 0.5 (claim) = 3.5 s; other = 10 - 3.5 = 6.5 s
    assert d == {"wall_s": 10.0, "buckets": {"claim": {"s": 0.5, "n": 1}, "generate": {"s": 3.0, "n": 24}},
                 "other_s": 6.5, "latency": {"queue": {"s": 0.25, "n": 1}}}


def test_breakdown_measure_counts_a_call_that_raises():
    clock = SteppedClock(0.0)
    tb = TimeBreakdown(clock=clock)
    with pytest.raises(RuntimeError), tb.measure("add_experience"):
        clock.now = 1.25
        raise RuntimeError("control plane down")
    assert tb.to_dict()["buckets"] == {"add_experience": {"s": 1.25, "n": 1}}


def test_merge_sums_every_field():
    a = {"wall_s": 10.0, "buckets": {"generate": {"s": 6.0, "n": 600}}, "other_s": 4.0, "latency": {}}
    b = {"wall_s": 5.0, "buckets": {"generate": {"s": 1.5, "n": 100}, "drain": {"s": 2.0, "n": 50}},
         "other_s": 1.5, "latency": {"q": {"s": 0.1, "n": 2}}}
    # generate 6.0 + 1.5 = 7.5 s over 600 + 100 = 700 tokens; drain only in b; wall 15, other 5.5
    assert merge([a, b]) == {"wall_s": 15.0, "other_s": 5.5,
                             "buckets": {"drain": {"s": 2.0, "n": 50}, "generate": {"s": 7.5, "n": 700}},
                             "latency": {"q": {"s": 0.1, "n": 2}}}
    assert merge([]) == {"wall_s": 0.0, "buckets": {}, "other_s": 0.0, "latency": {}}


def test_build_profile_sums_replica_incarnations_and_trainer_processes(tmp_path):
    store = LocalObjectStore(tmp_path)
    one = {"wall_s": 20.0, "buckets": {"generate": {"s": 12.0, "n": 900}, "wait_control": {"s": 1.0, "n": 2}},
           "other_s": 7.0, "latency": {"claim": {"s": 1.0, "n": 40}}}
    trainer = {"wall_s": 30.0, "buckets": {"wait_groups": {"s": 24.0, "n": 99}, "compute": {"s": 5.0, "n": 100}},
               "other_s": 1.0, "latency": {"train_step_schedule_to_start": {"s": 0.5, "n": 100}}}
    for process, body in [("rollout-r0-abc-a1", one), ("rollout-r1-abc-a1", one), ("rollout-r0-def-a1", one),
                          ("trainer-77", trainer)]:
        store.put(keys.profile("run1", process), json.dumps(body).encode())
    p = build_profile(store, "run1", {"trainer": 12.5})
    # three rollout incarnations of 20 s each: 60 s wall, 36 s generating, 3 s in 120 claims
    assert p["rollout_incarnations"] == 3
    assert p["rollout"]["wall_s"] == 60.0
    assert p["rollout"]["buckets"] == {"generate": {"s": 36.0, "n": 2700}, "wait_control": {"s": 3.0, "n": 6}}
    assert p["rollout"]["latency"] == {"claim": {"s": 3.0, "n": 120}}
    assert p["trainer"] == trainer
    text = format_profile(p)
    # claim latency per update: 3 s / 120 = 25 ms; the trainer waits 24 / 30 = 80 % of its wall time
    assert "latency claim" in text and "25.0 ms/call" in text
    assert "wait_groups" in text and "80.0 %" in text
    assert "cpu s: trainer=12.5 (total 12.5)" in text


def test_time_to_reward_is_the_first_step_whose_window_mean_exceeds():
    rewards = [0.5, 0.5, 0.5, 0.9, 0.9, 0.9]
    ends = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    # window 3: means from step 2 on are 0.5, (0.5+0.5+0.9)/3 = 0.633, (0.5+0.9+0.9)/3 = 0.767, 0.9
    assert time_to_reward(rewards, ends, 0.6, window=3) == 4.0  # step 3
    assert time_to_reward(rewards, ends, 0.8, window=3) == 6.0  # step 5
    assert time_to_reward(rewards, ends, 0.95, window=3) is None
    # "exceeds" is strict: a mean of exactly 0.5 is not above 0.5 (first mean above it is step 3)
    assert time_to_reward(rewards, ends, 0.5, window=3) == 4.0
    # fewer steps than the window: no moving average yet
    assert time_to_reward([1.0, 1.0], [1.0, 2.0], 0.6, window=3) is None


def test_side_and_ratios():
    # 30 steps at reward 0.7 then 30 at 0.9, one step per second (step i ends at i + 1 s)
    rewards = [0.7] * 30 + [0.9] * 30
    ends = [float(i + 1) for i in range(60)]
    loop = side(60.0, 12_000, rewards, ends, 0)
    # the 30-step mean is 0.7 > 0.6 at step 29 (ends 30 s); it first exceeds 0.8 when more than half of the
    # window is 0.9: k steps of 0.9 give (0.7 * (30 - k) + 0.9 k) / 30 > 0.8 for k >= 16, i.e. step 45 (46 s)
    assert loop["time_to_reward_0_6_s"] == 30.0
    assert loop["time_to_reward_0_8_s"] == 46.0
    # reward rise: last fifth (12 steps of 0.9) minus first tenth (6 steps of 0.7) = 0.2
    assert loop["reward_rise"] == pytest.approx(0.2)
    assert loop["tokens_per_s"] == 200.0  # 12,000 tokens / 60 s
    laminar = side(150.0, 12_000, rewards, [2.5 * e for e in ends], 0)
    r = ratios(loop, laminar)
    # every laminar time is 2.5x the loop's; tokens/s 200 vs 80: loop / laminar = 2.5
    assert r == {"wall_s": 2.5, "time_to_reward_0_6_s": 2.5, "time_to_reward_0_8_s": 2.5, "tokens_per_s": 2.5,
                 "cpu_s": None}  # no CPU figures on either side
    # the CPU ratio: every process the summary names, summed, against the loop's process
    loop["cpu_s"] = 40.0
    laminar["cpu_s"] = cpu_total({"cpu_s": {"trainer": 30.0, "rollout-0": 25.0, "temporal (since dev up)": 15.0}})
    assert laminar["cpu_s"] == 70.0 and ratios(loop, laminar)["cpu_s"] == 1.75
    assert cpu_total({"cpu_s": {}}) is None and cpu_total(None) is None


def test_summary_step_end_times_are_relative_to_the_run_start(tmp_path):
    store = LocalObjectStore(tmp_path)
    for step, t in [(2, 1000.75), (1, 1000.25)]:  # written out of order; the summary orders by step
        store.put(keys.step_metrics("run1", step), json.dumps(
            {"step": step, "reward_mean": 0.5, "tokens": 10, "response_lengths": [5, 5], "time": t}).encode())
    status = RunStatus(
        run_id="run1", phase="finished", step=2, total_steps=2, policy_version=2, ready_groups=0, open_leases=0,
        groups_generated=8, groups_consumed=8, groups_consumed_twice=0, tokens_consumed=20, reward_recent=[],
        versions_in_use=[2], max_versions_in_use=1, staleness_histogram={}, trainer_wait_fraction=0.0,
        history_events=10, history_events_max=10, continued_as_new=0, checkpoints=[], relays=[], replicas=[],
        started_at=1000.0)
    summary = build_summary(status, store, wall_s=2.0, started_at=1000.0, profile={"cpu_s": {}})
    # started at 1000.0: step 1 ended 0.25 s in, step 2 0.75 s in
    assert summary["step_end_s"] == [0.25, 0.75]
    assert summary["profile"] == {"cpu_s": {}}
    assert "step_end_s" not in build_summary(status, store, wall_s=2.0)
