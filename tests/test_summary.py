"""The run summary: nearest-rank percentiles (numpy's inverted_cdf), the reward rise and build_summary over
per-step metric objects in a real local object store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from laminar.contract import FailedGroup, RunStatus
from laminar.refs import CheckpointRef
from laminar.reporting.summary import build_summary, percentile, reward_rise
from laminar.storage import keys
from laminar.storage.objects import LocalObjectStore
from laminar.storage.records import step_records

RUN = "run-summary"


@pytest.mark.parametrize(("values", "q", "expected"), [
    ([], 50, 0.0),  # empty: 0.0
    ([7], 50, 7.0),  # one value is every percentile
    ([7], 99, 7.0),
    # n = 10: rank = ceil(q/100 * 10)
    (list(range(1, 11)), 50, 5.0),  # ceil(5.0) = 5 -> 5
    (list(range(1, 11)), 99, 10.0),  # ceil(9.9) = 10 -> 10
    (list(range(1, 11)), 0, 1.0),  # ceil(0) = 0, clamped to rank 1 -> 1
    (list(range(1, 11)), 100, 10.0),  # ceil(10) = 10 -> 10
    (list(range(1, 11)), 51, 6.0),  # ceil(5.1) = 6 -> 6
    # n = 4, values 10 20 30 40
    ([10, 20, 30, 40], 50, 20.0),  # ceil(2.0) = 2 -> 20 (nearest rank, no interpolation)
    ([10, 20, 30, 40], 25, 10.0),  # ceil(1.0) = 1 -> 10
    ([10, 20, 30, 40], 26, 20.0),  # ceil(1.04) = 2 -> 20
    ([10, 20, 30, 40], 99, 40.0),  # ceil(3.96) = 4 -> 40
    # n = 5 with repeats: 1 1 2 3 100
    ([1, 1, 2, 3, 100], 50, 2.0),  # ceil(2.5) = 3 -> 2
    ([1, 1, 2, 3, 100], 80, 3.0),  # ceil(4.0) = 4 -> 3
    ([1, 1, 2, 3, 100], 81, 100.0),  # ceil(4.05) = 5 -> 100
    # n = 200: p99 -> ceil(198.0) = 198 -> value 198; p50 -> ceil(100.0) = 100
    (list(range(1, 201)), 99, 198.0),
    (list(range(1, 201)), 50, 100.0),
])
def test_percentile_nearest_rank(values: list[int], q: float, expected: float) -> None:
    got = percentile(values, q)
    assert got == expected and isinstance(got, float)


def test_p50_and_p99_ranks_are_exact_for_every_length_up_to_1000() -> None:
    # the two percentiles the summary reports: rank = ceil(q * n / 100) in integer arithmetic
    for n in range(1, 1001):
        values = list(range(1, n + 1))  # value == rank
        assert percentile(values, 50) == (50 * n + 99) // 100, n
        assert percentile(values, 99) == (99 * n + 99) // 100, n


def test_reward_rise_needs_ten_steps() -> None:
    assert reward_rise([]) == 0.0
    assert reward_rise([0.0] * 5 + [1.0] * 4) == 0.0  # 9 steps: too few to tell


def test_reward_rise_hand_worked() -> None:
    # 10 steps: first tenth = 10 // 10 = 1 step [0.1]; last fifth = 10 // 5 = 2 steps [0.8, 1.0]
    # rise = (0.8 + 1.0) / 2 - 0.1 = 0.9 - 0.1 = 0.8
    rewards = [0.1, 0.2, 0.3, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 1.0]
    assert reward_rise(rewards) == pytest.approx(0.8)
    # 20 steps 0, 1, ..., 19 scaled by 0.05: first tenth = steps 0,1 -> mean 0.025;
    # last fifth = steps 16..19 -> mean 17.5 * 0.05 = 0.875; rise = 0.875 - 0.025 = 0.85
    assert reward_rise([i * 0.05 for i in range(20)]) == pytest.approx(0.85)
    # a falling curve gives a negative rise: 10 steps 1.0 .. 0.1 -> last [0.2, 0.1] mean 0.15 minus 1.0
    assert reward_rise([1.0 - i / 10 for i in range(10)]) == pytest.approx(-0.85)


def _status(**overrides: object) -> RunStatus:
    fields: dict[str, object] = dict(
        run_id=RUN, phase="finished", step=3, total_steps=3, policy_version=3, ready_groups=0, open_leases=0,
        groups_generated=14, groups_consumed=12, groups_consumed_twice=0, tokens_consumed=0,
        reward_recent=[], versions_in_use=[3], max_versions_in_use=2,
        staleness_histogram={"0": 20, "1": 4}, trainer_wait_fraction=0.123456, history_events=800,
        history_events_max=1900, continued_as_new=1,
        checkpoints=[CheckpointRef(run_id=RUN, step=2, manifest_key=keys.checkpoint_manifest(RUN, 2),
                                   manifest_sha256="ab" * 32, policy_version=2)],
        relays=[], replicas=[], started_at=0.0,
    )
    fields.update(overrides)
    return RunStatus(**fields)  # type: ignore[arg-type]


def _write_metrics(store: LocalObjectStore, records: list[dict]) -> None:
    for r in records:
        store.put(keys.step_metrics(RUN, r["step"]), json.dumps(r).encode())


def test_build_summary_from_store(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "store")
    # written out of order: the summary orders by step
    _write_metrics(store, [
        {"step": 3, "reward_mean": 0.75, "tokens": 300, "response_lengths": [9, 1], "loss": 0.1, "samples": 2, "busy_s": 0.5,
         "clip_fraction": 0.3, "is_weight_mean": 1.5, "is_weight_max": 9.0, "is_capped_fraction": 0.1,
         "kl_behaviour": 0.25, "trajectories": 2, "tool_calls": 3, "multi_turn": 1, "tool_latency_s": [0.5, 0.1, 0.2]},
        {"step": 1, "reward_mean": 0.1234567, "tokens": 100, "response_lengths": [4, 2, 8], "samples": 3, "busy_s": 0.25,
         "clip_fraction": 0.0, "is_weight_mean": 1.0, "is_weight_max": 1.0, "is_capped_fraction": 0.0,
         "kl_behaviour": 0.0, "trajectories": 3, "tool_calls": 0, "multi_turn": 0, "tool_latency_s": []},
        {"step": 2, "reward_mean": 0.5, "tokens": 200, "response_lengths": [3, 6, 5, 7], "samples": 4, "busy_s": 1.0,
         "clip_fraction": 0.1234567, "is_weight_mean": 1.25, "is_weight_max": 3.0, "is_capped_fraction": 0.2,
         "kl_behaviour": 0.125},
        # every sample was too stale: no update, and its zeros do not count in the off-policy means
        {"step": 4, "reward_mean": 0.0, "tokens": 0, "response_lengths": [], "samples": 0, "busy_s": 0.125,
         "clip_fraction": 0.0,
         "is_weight_mean": 0.0, "is_weight_max": 0.0, "is_capped_fraction": 0.0, "kl_behaviour": 0.0},
    ])
    # another run's metrics are not read
    store.put(keys.step_metrics("other-run", 1), json.dumps({"step": 1, "reward_mean": 9.0, "tokens": 10 ** 6,
                                                               "response_lengths": [1000]}).encode())
    assert [r["step"] for r in step_records(store, RUN)] == [1, 2, 3, 4]
    # 5 groups failed over the run; the status keeps the recent ones: 2 timeouts and 1 raised among them
    failures = [FailedGroup(f"g{i}", i, reason) for i, reason in enumerate(("timeout", "raised", "timeout"))]
    summary = build_summary(_status(step=4, groups_failed=5, failures=failures), store, wall_s=12.3456)
    # lengths sorted: 1 2 3 4 5 6 7 8 9 (n = 9); p50 rank ceil(4.5) = 5 -> 5; p99 rank ceil(8.91) = 9 -> 9
    # tokens 100 + 200 + 300 = 600 over 12.3456 s = 48.600... -> 48.6
    # off-policy figures over the three steps that updated (1, 2, 3), rounded to 5 places:
    #   clip_fraction mean (0 + 0.1234567 + 0.3) / 3 = 0.14115; is_weight mean (1 + 1.25 + 1.5) / 3 = 1.25, max 9;
    #   capped (0 + 0.2 + 0.1) / 3 = 0.1; KL mean (0 + 0.125 + 0.25) / 3 = 0.125, max 0.25
    assert summary == {
        "run_id": RUN,
        "steps": 4,
        "reward_per_step": [0.12346, 0.5, 0.75, 0.0],  # rounded to 5 places
        "response_len_p50": 5.0,
        "response_len_p99": 9.0,
        "tokens_per_s": 48.6,
        "wall_s": 12.35,
        "staleness_histogram": {"0": 20, "1": 4},
        "max_versions_in_use": 2,
        "trainer_wait_fraction": 0.1235,  # 0.123456 rounded to 4 places
        "groups_generated": 14,
        "groups_consumed": 12,
        "groups_consumed_twice": 0,
        "dropped_stale": 0,
        "groups_failed": 5,
        "groups_failed_recent_reasons": {"raised": 1, "timeout": 2},
        "staleness_max": 1,  # the histogram's largest gap
        "reprefill_tokens": 0, "repacks": 0, "repack_groups": 0, "repack_overhead_s_mean": None,  # no migration: no mean
        "checkpoints": [{"run_id": RUN, "step": 2, "manifest_key": keys.checkpoint_manifest(RUN, 2),
                         "manifest_sha256": "ab" * 32, "policy_version": 2}],
        "temporal_history_events_max": 1900,
        "continued_as_new": 1,
        "handover_stall_s": {"count": 1, "p50": 0.0, "max": 0.0},  # no stall recorded in the status
        "step_wall_s_p50": 0.375,  # busy_s 0.125 0.25 0.5 1.0: median (0.25 + 0.5) / 2
        "clip_fraction_mean": 0.14115,
        "is_weight_mean": 1.25,
        "is_weight_max": 9.0,
        "is_capped_fraction_mean": 0.1,
        "kl_behaviour_mean": 0.125,
        "kl_behaviour_max": 0.25,
        # tool calls over the steps that recorded them (1 and 3; 2 and 4 predate the keys): 2 + 3 = 5 trajectories,
        # 0 + 3 calls -> 0.6 a trajectory; 1 with two or more turns -> 0.2; latencies 0.1 0.2 0.5 -> p50 0.2, max 0.5
        "tool_calls_per_trajectory": 0.6,
        "multi_turn_share": 0.2,
        "tool_latency_s": {"calls": 3, "p50": 0.2, "max": 0.5},
        "tracker_skipped": {},  # no tracker failed (the last step's record has no tracker_skipped)
        "evals": [],  # no eval record under runs/<id>/evals/
        "eval_rounds_pending": {},  # no eval round open (no eval during training)
    }
    json.dumps(summary)  # what `laminar run --summary` writes must be JSON


def test_build_summary_without_metrics_or_time(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "store")
    summary = build_summary(_status(step=0, checkpoints=[]), store, wall_s=0.0)
    assert summary["reward_per_step"] == []
    assert (summary["response_len_p50"], summary["response_len_p99"]) == (0.0, 0.0)
    assert (summary["tokens_per_s"], summary["wall_s"]) == (0.0, 0.0)  # no division by zero
    assert summary["checkpoints"] == []
    assert (summary["is_weight_mean"], summary["is_weight_max"], summary["kl_behaviour_max"]) == (0.0, 0.0, 0.0)
