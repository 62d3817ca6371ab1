"""Trajectory store contract on both backends: segments and partial-response pools as verified Parquet."""

from __future__ import annotations

import dataclasses
import io
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from laminar.errors import CorruptDataError
from laminar.records import Trajectory
from laminar.refs import SegmentRef
from laminar.storage import keys
from laminar.storage.objects import LocalObjectStore, sha256_hex
from laminar.storage.trajectories import TRAJECTORY_SCHEMA, TrajectoryStore

RUN = "run-1"
REPLICA = "rollout-0"


def _traj(group: str, index: int, response_ids: list[int], policy_version: int, **overrides) -> Trajectory:
    values = dict(
        run_id=RUN, prompt_id=1000 + int(group[1:]), group_id=group, sample_index=index,
        prompt_ids=[1, 2, 3, 2_000_000_000],  # a large id still fits int32 (max 2_147_483_647)
        response_ids=response_ids,
        # float32-exact values (powers of two) so the list<float32> column round-trips exactly.
        logprobs=[-0.5 * (i + 1) for i in range(len(response_ids))],
        reward=0.1 * index, policy_version=policy_version, replica_id=REPLICA,
        started_at=1_700_000_000.25, ended_at=1_700_000_003.5, finish_reason="stop",
        extra={"task": "gsm8k", "answer": "42"},
    )
    values.update(overrides)
    return Trajectory(**values)


def _group_pair() -> list[Trajectory]:
    # Response lengths 3 + 2 + 4 + 1 = 10 tokens; groups g7 and g3; policy versions 3, 3, 4, 4 (max 4).
    return [
        _traj("g7", 0, [11, 12, 13], 3),
        _traj("g7", 1, [14, 15], 3, finish_reason="length", extra={}),
        _traj("g3", 0, [21, 22, 23, 24], 4),
        _traj("g3", 1, [25], 4, reward=-1.0),
    ]


def test_segment_round_trip_preserves_every_field(object_store):
    trajectories = TrajectoryStore(object_store)
    written = _group_pair()
    ref = trajectories.write_segment(RUN, REPLICA, "000001", written)
    assert ref.key == keys.experience_segment(RUN, REPLICA, "000001")
    assert (ref.rows, ref.group_ids, ref.policy_version, ref.tokens) == (4, ["g3", "g7"], 4, 10)
    data = object_store.get(ref.key)
    assert (ref.size, ref.sha256) == (len(data), sha256_hex(data))
    read = trajectories.read_segment(ref)
    assert read == written  # dataclass equality: every field, including extra and float lists
    assert [type(v) for v in dataclasses.astuple(read[0])[:4]] == [str, int, str, int]


def test_segment_is_plain_parquet_with_the_declared_schema(object_store):
    ref = TrajectoryStore(object_store).write_segment(RUN, REPLICA, "000001", _group_pair())
    table = pq.read_table(io.BytesIO(object_store.get(ref.key)))
    assert table.schema.equals(TRAJECTORY_SCHEMA)
    assert table.schema.field("response_ids").type == pa.list_(pa.int32())
    assert table.schema.field("logprobs").type == pa.list_(pa.float32())
    assert table.column("group_id").to_pylist() == ["g7", "g7", "g3", "g3"]


def test_flipped_byte_in_segment_is_detected(object_store):
    trajectories = TrajectoryStore(object_store)
    ref = trajectories.write_segment(RUN, REPLICA, "000002", _group_pair())
    data = bytearray(object_store.get(ref.key))
    data[len(data) // 2] ^= 0x01
    object_store.put(ref.key, bytes(data))
    with pytest.raises(CorruptDataError, match=rf"{ref.key}: sha256 mismatch \(expected {ref.sha256[:8]}\.\., got "):
        trajectories.read_segment(ref)


def test_truncated_segment_is_a_size_mismatch(object_store):
    trajectories = TrajectoryStore(object_store)
    ref = trajectories.write_segment(RUN, REPLICA, "000003", _group_pair())
    object_store.put(ref.key, object_store.get(ref.key)[:100])
    with pytest.raises(CorruptDataError, match=rf"size mismatch \(expected {ref.size} bytes, got 100\)"):
        trajectories.read_segment(ref)


# One row of a foreign table: logprobs and extra missing, reward a string, an unknown column "score".
FOREIGN_COLUMNS = {
    "run_id": [RUN], "prompt_id": [1], "group_id": ["g1"], "sample_index": pa.array([0], pa.int32()),
    "prompt_ids": pa.array([[1]], pa.list_(pa.int32())), "response_ids": pa.array([[2]], pa.list_(pa.int32())),
    "reward": ["1.0"], "policy_version": [0], "replica_id": [REPLICA], "started_at": [0.0], "ended_at": [1.0],
    "finish_reason": ["stop"], "score": [1.0],
}


def test_schema_mismatched_parquet_names_the_columns(object_store):
    table = pa.table(FOREIGN_COLUMNS)
    buf = io.BytesIO()
    pq.write_table(table, buf)
    data = buf.getvalue()
    key = keys.experience_segment(RUN, REPLICA, "foreign")
    object_store.put(key, data)
    ref = SegmentRef(key=key, sha256=sha256_hex(data), size=len(data), rows=1)
    with pytest.raises(CorruptDataError) as info:
        TrajectoryStore(object_store).read_segment(ref)
    message = str(info.value)
    assert "does not match the trajectory schema" in message and key in message
    assert "missing columns ['logprobs', 'extra']" in message
    assert "reward is string, expected double" in message
    assert "unexpected columns ['score']" in message


def test_not_parquet_is_corrupt(object_store):
    key = keys.experience_segment(RUN, REPLICA, "junk")
    object_store.put(key, b"not parquet at all")
    ref = SegmentRef(key=key, sha256=sha256_hex(b"not parquet at all"), size=18, rows=1)
    with pytest.raises(CorruptDataError, match="not readable Parquet"):
        TrajectoryStore(object_store).read_segment(ref)


def test_empty_segment_is_refused(object_store):
    with pytest.raises(ValueError, match="no trajectories"):
        TrajectoryStore(object_store).write_segment(RUN, REPLICA, "000004", [])


FENCE = (0, 1)  # (history segment, attempt) of the writing replica incarnation


def test_partial_pool_write_overwrite_read_clear(object_store):
    trajectories = TrajectoryStore(object_store)
    assert trajectories.read_partial(RUN, REPLICA) == []
    first = [_traj("g9", i, [1, 2], 5, finish_reason="partial") for i in range(3)]
    trajectories.write_partial(RUN, REPLICA, FENCE, first)
    assert trajectories.read_partial(RUN, REPLICA) == first
    second = [_traj("g9", 0, [1, 2, 3, 4], 5, finish_reason="partial")]
    trajectories.write_partial(RUN, REPLICA, FENCE, second)  # each flush replaces the whole pool
    assert trajectories.read_partial(RUN, REPLICA) == second
    # two Parquet slots, the manifest naming the one written last
    assert set(object_store.list(f"runs/{RUN}/partial/")) == {keys.partial_manifest(RUN, REPLICA, FENCE),
                                                              keys.partial_pool(RUN, REPLICA, FENCE, 0),
                                                              keys.partial_pool(RUN, REPLICA, FENCE, 1)}
    third = [_traj("g9", 0, [1, 2, 3, 4, 5], 5, finish_reason="partial")]
    TrajectoryStore(object_store).write_partial(RUN, REPLICA, FENCE, third)  # a new writer finds the slot in use
    assert trajectories.read_partial(RUN, REPLICA) == third
    assert trajectories.read_partial(RUN, "rollout-1") == []  # pools are per replica
    trajectories.clear_partial(RUN, REPLICA)
    assert trajectories.read_partial(RUN, REPLICA) == []
    assert object_store.list(f"runs/{RUN}/partial/") == []
    trajectories.clear_partial(RUN, REPLICA)  # clearing twice is fine


def test_partial_pool_empty_flush_round_trips(object_store):
    trajectories = TrajectoryStore(object_store)
    trajectories.write_partial(RUN, REPLICA, FENCE, [])
    assert trajectories.read_partial(RUN, REPLICA) == []


def test_partial_pool_without_manifest_is_uncommitted(object_store):
    trajectories = TrajectoryStore(object_store)
    trajectories.write_partial(RUN, REPLICA, FENCE, [_traj("g1", 0, [1], 2, finish_reason="partial")])
    object_store.delete(keys.partial_manifest(RUN, REPLICA, FENCE))  # crashed after the Parquet, before the manifest
    assert trajectories.read_partial(RUN, REPLICA) == []


def test_a_flush_cut_short_leaves_the_previous_pool_whole(object_store):
    # The second flush's Parquet landed in the other slot and its manifest did not (the replica was killed, or
    # the store went down while the replica's retry started). Before, a flush first deleted the manifest, so
    # the retry found no pool, generated the groups again from their prompts and ran their tool calls again.
    trajectories = TrajectoryStore(object_store)
    first = [_traj("g1", 0, [1, 2], 2, finish_reason="partial", extra={"tool_intent": "0"})]
    trajectories.write_partial(RUN, REPLICA, FENCE, first)
    cut_short = [_traj("g1", 0, [1, 2, 3], 2, finish_reason="partial")]
    object_store.put(keys.partial_pool(RUN, REPLICA, FENCE, 1), b"PAR1 half a file")  # the other slot, torn
    assert trajectories.read_partial(RUN, REPLICA) == first
    object_store.put(keys.partial_pool(RUN, REPLICA, FENCE, 1), b"x" * 10)
    assert TrajectoryStore(object_store).read_partial(RUN, REPLICA) == first  # any reader, not only the writer
    trajectories.write_partial(RUN, REPLICA, FENCE, cut_short)  # the next flush commits
    assert trajectories.read_partial(RUN, REPLICA) == cut_short


def test_corrupt_partial_pool_raises(object_store):
    trajectories = TrajectoryStore(object_store)
    trajectories.write_partial(RUN, REPLICA, FENCE, [_traj("g1", 0, [1, 2, 3], 2, finish_reason="partial")])
    key = keys.partial_pool(RUN, REPLICA, FENCE)
    data = bytearray(object_store.get(key))
    data[len(data) // 2] ^= 0x01
    object_store.put(key, bytes(data))
    with pytest.raises(CorruptDataError, match=rf"{key}: sha256 mismatch"):
        trajectories.read_partial(RUN, REPLICA)
    object_store.delete(key)
    with pytest.raises(CorruptDataError, match="is missing but its manifest"):
        trajectories.read_partial(RUN, REPLICA)


def test_a_zombie_attempt_never_overwrites_its_retrys_pool(object_store):
    trajectories = TrajectoryStore(object_store)
    zombie = [_traj("g1", 0, [1, 2], 2, finish_reason="partial")]
    trajectories.write_partial(RUN, REPLICA, (0, 1), zombie)  # attempt 1 flushes, then stops heartbeating
    assert trajectories.read_partial(RUN, REPLICA) == zombie  # its retry (attempt 2) resumes from it...
    retry = [_traj("g1", 0, [1, 2, 3], 2, finish_reason="partial")]
    trajectories.write_partial(RUN, REPLICA, (0, 2), retry)  # ... and writes its own pool
    # the zombie is still alive and flushes again after its retry started
    trajectories.write_partial(RUN, REPLICA, (0, 1), [_traj("g1", 0, [9, 9, 9, 9], 2, finish_reason="partial")])
    assert trajectories.read_partial(RUN, REPLICA) == retry  # the newest incarnation's pool wins
    # after a continue-as-new the attempt count restarts at 1, but the segment number orders it after
    handed_over = [_traj("g1", 0, [1, 2, 3, 4], 2, finish_reason="partial")]
    trajectories.write_partial(RUN, REPLICA, (1, 1), handed_over)
    assert trajectories.read_partial(RUN, REPLICA) == handed_over
    # the new incarnation sweeps the older pools; its own stays
    trajectories.clear_partial(RUN, REPLICA, older_than=(1, 1))  # both slots of each older fence
    assert object_store.list(f"runs/{RUN}/partial/") == [keys.partial_manifest(RUN, REPLICA, (1, 1)),
                                                         keys.partial_pool(RUN, REPLICA, (1, 1))]


def test_ids_with_slashes_are_rejected(object_store):
    trajectories = TrajectoryStore(object_store)
    with pytest.raises(ValueError, match="replica_id 'a/b'"):
        trajectories.write_partial(RUN, "a/b", FENCE, [])
    with pytest.raises(ValueError, match="segment seq"):
        trajectories.write_segment(RUN, REPLICA, "", _group_pair())


_FLUSHER = """
import sys
from laminar.records import Trajectory
from laminar.storage.objects import LocalObjectStore
from laminar.storage.trajectories import TrajectoryStore

store = TrajectoryStore(LocalObjectStore(sys.argv[1]))
n = 0
while True:
    n += 1
    rows = [Trajectory(run_id="run-1", prompt_id=1, group_id=f"g{i}", sample_index=0, prompt_ids=[1, 2, 3],
                       response_ids=[n] * 200, logprobs=[-0.5] * 200, reward=0.0, policy_version=n,
                       replica_id="rollout-0", started_at=1.0, ended_at=2.0, finish_reason="partial")
            for i in range(300)]
    store.write_partial("run-1", "rollout-0", (0, 1), rows)
    print(n, flush=True)
"""


def test_a_replica_killed_mid_flush_leaves_a_whole_pool(tmp_path):
    # A real process rewrites its pool as fast as it can (300 rows a flush) and is SIGKILLed at a random point;
    # the pool read afterwards is always one whole committed flush, never "no pool" (before the fix most kills
    # landed after a flush had deleted its manifest: the retry resumed nothing and ran its groups' calls again).
    root = tmp_path / "store"
    rng = random.Random(35)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    for _ in range(5):
        proc = subprocess.Popen([sys.executable, "-c", _FLUSHER, str(root)], stdout=subprocess.PIPE, text=True,
                                env=env)
        assert proc.stdout is not None
        committed = int(proc.stdout.readline())  # one flush committed
        time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        last = max([committed, *(int(x) for x in proc.stdout.read().split())])
        pool = TrajectoryStore(LocalObjectStore(root)).read_partial(RUN, REPLICA)
        assert len(pool) == 300
        version = pool[0].policy_version
        assert last <= version <= last + 1  # the last flush it reported, or one that committed after it
        assert all(t.response_ids == [version] * 200 for t in pool)
