"""Where a process's wall time goes: named buckets of monotonic-clock seconds (and a count per bucket).

A `TimeBreakdown` is cheap enough for a hot loop (a dict update per measured call, no allocation per
token). Each process writes `to_dict()` to the store (`storage.keys.profile`) now and then and at exit;
`merge` sums the breakdowns of several processes of one role (e.g. every rollout replica incarnation).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class TimeBreakdown:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.started = clock()
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.latencies: dict[str, list[float]] = {}  # name -> [seconds summed, count]; not wall-time buckets

    def add(self, bucket: str, seconds: float, count: int = 1) -> None:
        self.seconds[bucket] = self.seconds.get(bucket, 0.0) + seconds
        self.counts[bucket] = self.counts.get(bucket, 0) + count

    def latency(self, name: str, seconds: float) -> None:
        """A latency measured elsewhere (e.g. an activity's queue time) that overlaps the buckets."""
        acc = self.latencies.setdefault(name, [0.0, 0])
        acc[0] += seconds
        acc[1] += 1

    @contextmanager
    def measure(self, bucket: str) -> Iterator[None]:
        t0 = self.clock()
        try:
            yield
        finally:
            self.add(bucket, self.clock() - t0)

    def to_dict(self) -> dict[str, Any]:
        """{"wall_s", "buckets": {name: {"s", "n"}}, "other_s", "latency": {name: {"s", "n"}}}: other_s is the
        wall time no bucket covers; latencies are not part of the wall-time split."""
        wall = self.clock() - self.started
        return {
            "wall_s": round(wall, 4),
            "buckets": {k: {"s": round(s, 4), "n": self.counts[k]} for k, s in sorted(self.seconds.items())},
            "other_s": round(wall - sum(self.seconds.values()), 4),
            "latency": {k: {"s": round(s, 4), "n": n} for k, (s, n) in sorted(self.latencies.items())},
        }


def _sum(parts: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    acc: dict[str, list[float]] = {}
    for part in parts:
        for name, v in part.items():
            a = acc.setdefault(name, [0.0, 0])
            a[0] += v["s"]
            a[1] += v["n"]
    return {k: {"s": round(s, 4), "n": int(n)} for k, (s, n) in sorted(acc.items())}


def merge(breakdowns: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum of several `to_dict()` results: wall, other and every bucket's and latency's seconds and counts."""
    return {
        "wall_s": round(sum(b["wall_s"] for b in breakdowns), 4),
        "buckets": _sum([b["buckets"] for b in breakdowns]),
        "other_s": round(sum(b["other_s"] for b in breakdowns), 4),
        "latency": _sum([b.get("latency", {}) for b in breakdowns]),
    }
