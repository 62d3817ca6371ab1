"""The chaos schedule is a pure function of its seed: same seed, same schedule; overlaps when asked; every
fault heals inside the run; a saved schedule replays exactly."""

from __future__ import annotations

import pytest

from laminar.chaos.schedule import (
    HOLD_S,
    KINDS,
    format_schedule,
    overlapping,
    parse_kinds,
    plan_schedule,
    schedule_from_json,
    schedule_to_json,
    targets_for,
)
from laminar.errors import ConfigError

PROCESSES = ["control", "trainer", "relay-host-0", "rollout-host-0", "relay-host-1", "rollout-host-1"]
ALL = targets_for(list(KINDS), PROCESSES)


def test_same_seed_same_schedule_other_seed_another():
    a = plan_schedule(7, 1800, list(KINDS), ALL, rate_per_min=4)
    assert a == plan_schedule(7, 1800, list(KINDS), ALL, rate_per_min=4)
    assert a.faults != plan_schedule(8, 1800, list(KINDS), ALL, rate_per_min=4).faults


def test_thirty_minutes_count_kinds_and_heals():
    s = plan_schedule(1, 1800, list(KINDS), ALL, rate_per_min=4)
    # warm-up min(30, 0.15*1800)=30 s, settle min(60, 0.2*1800)=60 s, longest window 35 s (preempt: the notice):
    # faults start in [30, 1800-60-35=1705]: round(4 * 1675 / 60) = 112 faults.
    assert len(s.faults) == 112
    assert {f.kind for f in s.faults} == set(KINDS)
    for f in s.faults:
        lo, hi = HOLD_S[f.kind]
        assert lo <= f.hold_s <= hi
        assert 30 <= f.at_s and f.window[1] <= 1800 - 60 + 1e-6, f  # healed and recovered before the settle
    assert [f.index for f in s.faults] == list(range(len(s.faults)))
    assert [f.at_s for f in s.faults] == sorted(f.at_s for f in s.faults)


@pytest.mark.parametrize("seed", range(20))
def test_overlaps_when_asked_and_targets_never_doubled(seed):
    kinds = ["kill", "stop", "store", "temporal", "preempt"]
    s = plan_schedule(seed, 150, kinds, targets_for(kinds, PROCESSES), rate_per_min=8, overlaps=3)
    assert overlapping(s.faults) >= 3, format_schedule(s)
    assert len(s.faults) >= 8 and len({f.kind for f in s.faults}) >= 4
    for a in s.faults:  # one target never holds two faults at once
        for b in s.faults:
            if a is not b and a.target == b.target:
                assert a.window[1] <= b.at_s or b.window[1] <= a.at_s, (a, b)


def test_no_overlap_asked_can_give_none():
    # One fault per kind on a long run: 1 fault/min over 30 min leaves room for all of them apart.
    s = plan_schedule(3, 1800, ["kill"], {"kill": PROCESSES}, rate_per_min=0.2, overlaps=0)
    assert overlapping(s.faults) == 0


def test_targets_by_kind():
    assert ALL["partition"] == ["relay-host-0", "relay-host-1"]
    assert ALL["store"] == ALL["readonly"] == ["store"] and ALL["temporal"] == ["temporal"]
    assert ALL["kill"] == PROCESSES
    with pytest.raises(ConfigError, match="no process to aim it at"):
        targets_for(["partition"], ["control", "trainer"])


def test_replay_round_trip_and_bad_files():
    s = plan_schedule(11, 300, list(KINDS), ALL)
    assert schedule_from_json(schedule_to_json(s)) == s
    with pytest.raises(ConfigError, match="not a chaos schedule"):
        schedule_from_json("[]")
    with pytest.raises(ConfigError, match="format"):
        schedule_from_json('{"format": 99}')


def test_parsing_errors_name_the_fix():
    assert parse_kinds("store,kill") == ["kill", "store"]
    with pytest.raises(ConfigError, match="fire"):
        parse_kinds("kill,fire")
    with pytest.raises(ConfigError, match="longer duration"):
        plan_schedule(0, 15, ["kill"], {"kill": PROCESSES})


def test_store_faults_share_their_target():
    # readonly and store both aim at the one dev S3 server: never both at once (a restart would end read-only)
    s = plan_schedule(5, 600, ["store", "readonly"], targets_for(["store", "readonly"], PROCESSES), rate_per_min=12,
                      overlaps=5)
    assert {f.kind for f in s.faults} == {"store", "readonly"} and {f.target for f in s.faults} == {"store"}
    held = sorted(f.window for f in s.faults)
    assert all(a[1] <= b[0] for a, b in zip(held, held[1:], strict=False)), format_schedule(s)
    for f in s.faults:
        lo, hi = HOLD_S[f.kind]
        assert lo <= f.hold_s <= hi
