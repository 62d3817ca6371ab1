"""The run summary (`laminar run --summary PATH`): built from the final workflow status and the
per-step trainer metrics in the store."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import Any

from laminar.messages import RunStatus
from storage import keys
from storage.objects import ObjectStore


def percentile(sorted_values: list[int], q: float) -> float:
    """Nearest-rank percentile of an ascending list (q in [0, 100]); 0.0 for an empty list."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q * len(sorted_values) / 100))  # exact for whole-number q
    return float(sorted_values[rank - 1])


def step_metrics(store: ObjectStore, run_id: str) -> list[dict[str, Any]]:
    records = [json.loads(store.get(k)) for k in store.list(keys.step_metrics_prefix(run_id))]
    return sorted(records, key=lambda r: r["step"])


def build_summary(status: RunStatus, store: ObjectStore, wall_s: float) -> dict[str, Any]:
    metrics = step_metrics(store, status.run_id)
    lengths = sorted(n for r in metrics for n in r["response_lengths"])
    tokens = sum(r["tokens"] for r in metrics)
    return {
        "run_id": status.run_id,
        "steps": status.step,
        "reward_per_step": [round(r["reward_mean"], 5) for r in metrics],
        "response_len_p50": percentile(lengths, 50),
        "response_len_p99": percentile(lengths, 99),
        "tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
        "wall_s": round(wall_s, 2),
        "staleness_histogram": dict(sorted(status.staleness_histogram.items(), key=lambda kv: int(kv[0]))),
        "max_versions_in_use": status.max_versions_in_use,
        "trainer_wait_fraction": round(status.trainer_wait_fraction, 4),
        "groups_generated": status.groups_generated,
        "groups_consumed": status.groups_consumed,
        "groups_consumed_twice": status.groups_consumed_twice,
        "checkpoints": [asdict(c) for c in status.checkpoints],
        "temporal_history_events_max": status.history_events_max,
        "continued_as_new": status.continued_as_new,
    }


def reward_rise(rewards: list[float]) -> float:
    """Mean reward over the last fifth of steps minus the mean over the first tenth."""
    if len(rewards) < 10:
        return 0.0
    first = rewards[: max(1, len(rewards) // 10)]
    last = rewards[-max(1, len(rewards) // 5):]
    return sum(last) / len(last) - sum(first) / len(first)
