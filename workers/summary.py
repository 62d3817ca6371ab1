"""The run summary (`laminar run --summary PATH`): built from the final workflow status and the
per-step trainer metrics in the store."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import numpy as np

from laminar.messages import RunStatus
from storage import keys
from storage.objects import ObjectStore


def percentile(sorted_values: list[int], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]): the ceil(q / 100 * n)-th smallest value (the first for q = 0);
    0.0 for an empty list.

    numpy's `inverted_cdf` method (Hyndman and Fan's definition 1, the inverse of the empirical CDF) is the
    nearest rank. It computes q / 100 * n in floating point, which is exact for the q = 50 and q = 99 the
    summary reports (checked for every n up to 10^7), but not for every q: q = 7, n = 100 gives
    7.000000000000001 and so rank 8.
    """
    if not sorted_values:
        return 0.0
    return float(np.percentile(sorted_values, q, method="inverted_cdf"))


def _over_updates(metrics: list[dict[str, Any]], key: str) -> list[float]:
    """`key` of every step that updated the policy (samples > 0); step records written before `key`
    existed are skipped."""
    return [r[key] for r in metrics if r.get("samples", 0) > 0 and key in r]


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 5) if values else 0.0


def _median(values: list[float]) -> float:
    return round(float(np.median(values)), 3) if values else 0.0


def _max(values: list[float]) -> float:
    return round(max(values), 5) if values else 0.0


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
        # trainer idle across each continue-as-new: last step of a segment to the first step of the next
        "handover_stall_s": {"count": status.continued_as_new, "p50": _median(status.handover_stalls),
                             "max": round(status.handover_stall_max, 3)},
        "step_wall_s_p50": _median([r["busy_s"] for r in metrics if "busy_s" in r]),
        "clip_fraction_mean": _mean(_over_updates(metrics, "clip_fraction")),
        "is_weight_mean": _mean(_over_updates(metrics, "is_weight_mean")),
        "is_weight_max": _max(_over_updates(metrics, "is_weight_max")),
        "is_capped_fraction_mean": _mean(_over_updates(metrics, "is_capped_fraction")),
        "kl_behaviour_mean": _mean(_over_updates(metrics, "kl_behaviour")),
        "kl_behaviour_max": _max(_over_updates(metrics, "kl_behaviour")),
    }


def reward_rise(rewards: list[float]) -> float:
    """Mean reward over the last fifth of steps minus the mean over the first tenth."""
    if len(rewards) < 10:
        return 0.0
    first = rewards[: max(1, len(rewards) // 10)]
    last = rewards[-max(1, len(rewards) // 5):]
    return sum(last) / len(last) - sum(first) / len(first)
