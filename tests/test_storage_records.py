"""storage/records.py on both backends (a local directory and the S3 server): every record kind a run leaves,
read back as its writers put it, and the one de-duplication rule (the first of each identity in key order)."""

from __future__ import annotations

import json

from laminar.records import Trajectory
from laminar.storage import keys, records
from laminar.storage.trajectories import TrajectoryStore

RUN = "run-records"


def _put(store, key: str, body: dict) -> None:
    store.put(key, json.dumps(body).encode())


def _trajectory(group: str, sample: int, *, prompt: int, response: int, start: float, end: float,
                version: int = 0, replica: str = "replica-0") -> Trajectory:
    return Trajectory(run_id=RUN, prompt_id=int(group[1:]), group_id=group, sample_index=sample,
                      prompt_ids=[5] * prompt, response_ids=[7] * response, logprobs=[-1.0] * response, reward=0.5,
                      policy_version=version, replica_id=replica, started_at=start, ended_at=end,
                      finish_reason="stop")


def test_step_records_one_per_step_in_step_order(object_store):
    # written out of order; step 10 sorts after step 9 (keys are zero-padded, the sort is by the number)
    for step in (10, 2, 9):
        _put(object_store, keys.step_metrics(RUN, step), {"step": step, "reward_mean": step / 10})
    # a retried train step writes its record again, under the same key: the later write is the one record
    _put(object_store, keys.step_metrics(RUN, 2), {"step": 2, "reward_mean": 0.25, "attempt": 2})
    _put(object_store, keys.step_metrics("other-run", 1), {"step": 1, "reward_mean": 9.0})  # another run's
    got = records.step_records(object_store, RUN)
    assert [r["step"] for r in got] == [2, 9, 10]
    assert got[0] == {"step": 2, "reward_mean": 0.25, "attempt": 2}
    assert records.step_records(object_store, "no-such-run") == []


def test_trajectory_rows_count_a_retried_report_once(object_store):
    ts = TrajectoryStore(object_store)
    ts.write_segment(RUN, "replica-0", "aaaa-a1-000001", [
        _trajectory("g00000000", 0, prompt=3, response=10, start=1.0, end=2.0),
        _trajectory("g00000000", 1, prompt=3, response=20, start=1.0, end=3.0),
    ])
    # a retried report wrote sample (g00000000, 0) again (key order: after the first segment), plus a new group
    ts.write_segment(RUN, "replica-1", "aaaa-a2-000001", [
        _trajectory("g00000000", 0, prompt=3, response=99, start=5.0, end=6.0, replica="replica-1"),
        _trajectory("g00000001", 0, prompt=4, response=5, start=1.5, end=2.5, version=1, replica="replica-1"),
    ])
    object_store.put(keys.experience_prefix(RUN) + "replica-0/notes.json", b"{}")  # not a segment: skipped
    rows = records.trajectory_rows(object_store, RUN)
    # 4 rows written, 3 counted: the repeat of (g00000000, 0) with 99 response tokens is skipped, the first kept
    assert [(r.group_id, r.sample_index, r.response_tokens, r.replica_id, r.started_at) for r in rows] == [
        ("g00000000", 0, 10, "replica-0", 1.0), ("g00000000", 1, 20, "replica-0", 1.0),
        ("g00000001", 0, 5, "replica-1", 1.5)]
    assert [(r.prompt_id, r.prompt_tokens, r.policy_version, r.ended_at) for r in rows] == [
        (0, 3, 0, 2.0), (0, 3, 0, 3.0), (1, 4, 1, 2.5)]
    # without token counts: the same rows, the counts None
    bare = records.trajectory_rows(object_store, RUN, token_counts=False)
    assert [(r.group_id, r.sample_index, r.replica_id) for r in bare] == [
        (r.group_id, r.sample_index, r.replica_id) for r in rows]
    assert {(r.prompt_tokens, r.response_tokens) for r in bare} == {(None, None)}
    assert records.trajectory_rows(object_store, "other-run") == []


def test_profiles_drill_reports_and_summary(object_store):
    trainer = {"wall_s": 2.0, "buckets": {"train": {"s": 1.5, "n": 3}}, "other_s": 0.5}
    rollouts = [{"wall_s": 4.0, "buckets": {}, "other_s": float(i)} for i in range(2)]
    _put(object_store, keys.profile(RUN, "trainer-1234"), trainer)
    for i, body in enumerate(rollouts):  # two incarnations of replica 0 (history segment aaaa, attempts 1 and 2)
        _put(object_store, keys.profile(RUN, f"rollout-replica-0-aaaa-a{i + 1}"), body)
    assert records.profiles(object_store, RUN, "trainer") == [trainer]
    assert records.profiles(object_store, RUN, "rollout") == rollouts  # key order
    assert records.profiles(object_store, "other-run", "trainer") == []

    assert records.drill_reports(object_store, RUN) == []
    _put(object_store, keys.drill_report(RUN, "d2"), {"drill_id": "d2"})
    _put(object_store, keys.drill_report(RUN, "d1"), {"drill_id": "d1"})
    assert [d["drill_id"] for d in records.drill_reports(object_store, RUN)] == ["d1", "d2"]  # key order

    assert records.summary(object_store, RUN) is None  # still running, or started with `laminar start`
    _put(object_store, keys.summary(RUN), {"run_id": RUN, "steps": 3})
    assert records.summary(object_store, RUN) == {"run_id": RUN, "steps": 3}


def test_first_per_keeps_the_first_of_each_identity():
    rows = [("a", 1), ("b", 2), ("a", 3), ("c", 4), ("b", 5)]
    assert records.first_per(rows, lambda r: r[0]) == [("a", 1), ("b", 2), ("c", 4)]
    assert records.first_per([], lambda r: r) == []


def test_profile_prefix_of_one_role():
    assert keys.profile_prefix(RUN) == "runs/run-records/profile/"
    assert keys.profile_prefix(RUN, "rollout") == "runs/run-records/profile/rollout-"
    assert keys.profile(RUN, "rollout-replica-0-aaaa-a1").startswith(keys.profile_prefix(RUN, "rollout"))
