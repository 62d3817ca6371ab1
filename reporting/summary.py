"""The run summary (`laminar run --summary PATH`): built from the final workflow status and the
per-step trainer metrics in the store; the time breakdown; the percentile and reward rise the benchmarks share."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import Any

import numpy as np

from laminar.contract import RunStatus
from laminar.storage import records
from laminar.storage.objects import ObjectStore
from laminar.timing import merge


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


def build_profile(store: ObjectStore, run_id: str, cpu_s: dict[str, float]) -> dict[str, Any]:
    """Where the run's time went: the rollout replicas' breakdowns summed over every incarnation (replica x
    history segment x attempt), the trainer's (summed over its processes), and CPU seconds per process."""
    rollout = records.profiles(store, run_id, "rollout")
    return {"rollout": merge(rollout), "rollout_incarnations": len(rollout),
            "trainer": merge(records.profiles(store, run_id, "trainer")), "cpu_s": cpu_s}


def format_profile(profile: dict[str, Any]) -> str:
    """The breakdown as text, rollout and trainer side by side: seconds, share of the role's wall time, count."""
    cols = []
    for role in ("rollout", "trainer"):
        p = profile[role]
        wall = p["wall_s"] or 1.0
        rows = [(name, v["s"], v["n"]) for name, v in sorted(p["buckets"].items(), key=lambda kv: -kv[1]["s"])]
        rows.append(("(other)", p["other_s"], 0))
        lines = [f"{role} ({p['wall_s']:.1f} s wall{', summed over replicas' if role == 'rollout' else ''})"]
        lines += [f"  {name:<22}{s:8.1f} s {100 * s / wall:5.1f} % {n or '':>8}" for name, s, n in rows]
        lines += [f"  latency {name:<14}{1000 * v['s'] / max(1, v['n']):8.1f} ms/call {v['n']:>6}"
                  for name, v in p.get("latency", {}).items()]
        cols.append(lines)
    width = max(len(line) for line in cols[0]) + 2
    height = max(len(c) for c in cols)
    out = [f"{(cols[0] + [''] * height)[i]:<{width}}{(cols[1] + [''] * height)[i]}" for i in range(height)]
    cpu = profile.get("cpu_s", {})
    if cpu:
        out.append("cpu s: " + ", ".join(f"{k}={v:.1f}" for k, v in cpu.items()) + f" (total {sum(cpu.values()):.1f})")
    return "\n".join(out)


def build_summary(status: RunStatus, store: ObjectStore, wall_s: float, started_at: float | None = None,
                  profile: dict[str, Any] | None = None) -> dict[str, Any]:
    """started_at: the run's start (time.time()), for each step's completion time; profile: build_profile's."""
    metrics = records.step_records(store, status.run_id)
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
        "dropped_stale": status.dropped_stale,
        # groups dropped after task.max_group_retries failed tries (never trained on); the reasons of the last
        # RECENT_FAILURES of them (workflows/state.py)
        "groups_failed": status.groups_failed,
        "groups_failed_recent_reasons": dict(sorted(Counter(f.reason for f in status.failures).items())),
        "staleness_max": max((int(k) for k in status.staleness_histogram), default=0),
        # dynamic repack (laminar mode): migrations carried out, groups moved, mean wall s per migration (the
        # source's stop + segment write and the destination's read + admission)
        "reprefill_tokens": status.reprefill_tokens,  # prompt + prefix tokens prefilled again
        "repacks": status.repacks,
        "repack_groups": status.repack_groups,
        "repack_overhead_s_mean": round(status.repack_overhead_s / status.repacks, 4) if status.repacks else None,
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
        **tool_stats(metrics),
        # writes a failing experiment tracker dropped (services/tracking.py), per tracker, as of the last step
        "tracker_skipped": (metrics[-1].get("tracker_skipped") or {}) if metrics else {},
        # steps each tracker never wrote ("66-70,81"), where the trainer records Trackers.stats() as tracker_stats
        **({"tracker_missing": missing} if (missing := tracker_missing(metrics)) else {}),
        # held-out evals recorded so far (laminar eval; eval rounds): version, accuracy, its standard error, prompts
        "evals": eval_lines(store, status.run_id),
        # eval rounds during training still open at the summary (policy version -> prompts not scored)
        "eval_rounds_pending": dict(status.eval_pending),
        # seconds from the run's start to each step's end (time to reward)
        **({"step_end_s": [round(r["time"] - started_at, 3) for r in metrics]} if started_at is not None else {}),
        **({"profile": profile} if profile is not None else {}),
    }


def tracker_missing(metrics: list[dict[str, Any]]) -> dict[str, str]:
    """Per tracker, the steps it is missing as of the last step record (services/tracking.py Trackers.stats())."""
    stats = (metrics[-1].get("tracker_stats") or {}) if metrics else {}
    return {name: s["missing_steps"] for name, s in sorted(stats.items()) if s.get("missing_steps")}


def eval_lines(store: ObjectStore, run_id: str) -> list[dict[str, Any]]:
    from laminar.reporting.report import eval_records

    return [{"policy_version": e["policy_version"], "accuracy": round(e["accuracy"], 4),
             "accuracy_stderr": round(e.get("accuracy_stderr", 0.0), 4), "prompts": e["prompts"],
             "samples": e["samples"], "pass_at_k": round(e.get("pass_at_k", 0.0), 4), "failures": e.get("failures", 0),
             "during_training": bool(e.get("during_training"))} for e in eval_records(store, run_id)]


def tool_stats(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """Multi-turn tool calls over the trained trajectories: calls per trajectory, the share with two or more
    model turns, and tool latency (s, p50 and max over calls); steps recorded before these keys are skipped."""
    rows = [r for r in metrics if "trajectories" in r]
    n = sum(r["trajectories"] for r in rows)
    latency = sorted(x for r in rows for x in r.get("tool_latency_s", []))
    return {"tool_calls_per_trajectory": round(sum(r["tool_calls"] for r in rows) / n, 4) if n else 0.0,
            "multi_turn_share": round(sum(r["multi_turn"] for r in rows) / n, 4) if n else 0.0,
            "tool_latency_s": {"calls": len(latency), "p50": round(float(np.median(latency)), 6) if latency else 0.0,
                               "max": round(latency[-1], 6) if latency else 0.0}}


def reward_rise(rewards: list[float]) -> float:
    """Mean reward over the last fifth of steps minus the mean over the first tenth."""
    if len(rewards) < 10:
        return 0.0
    first = rewards[: max(1, len(rewards) // 10)]
    last = rewards[-max(1, len(rewards) // 5):]
    return sum(last) / len(last) - sum(first) / len(first)
