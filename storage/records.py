"""A run's records, read from the store in one place for the run summary, `laminar report` and the benchmarks
(docs/architecture/storage.md, 'Storage layout'): step metrics, time breakdowns, drill reports, summary, trajectory rows.

One de-duplication rule (`first_per`): a record is identified by its natural key (a step record by its step, a
trajectory row by (group_id, sample_index)) and, in key order, the first of each identity counts. So what a
retried activity writes again counts once: a retried train step rewrites its record under the same key, and a
retried rollout report's groups, written again in a later segment, are skipped there.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from laminar.errors import ObjectNotFoundError
from laminar.storage import keys
from laminar.storage.objects import ObjectStore

T = TypeVar("T")


def first_per(items: Iterable[T], identity: Callable[[T], Hashable]) -> list[T]:
    """The items in order, the first of each identity only."""
    firsts: dict[Hashable, T] = {}
    for item in items:
        firsts.setdefault(identity(item), item)
    return list(firsts.values())


def step_records(store: ObjectStore, run_id: str) -> list[dict[str, Any]]:
    """The trainer's per-step metric records (services/trainer.py `_write_metrics`), one per step, by step."""
    found = (json.loads(store.get(k)) for k in store.list(keys.step_metrics_prefix(run_id)))
    return sorted(first_per(found, lambda r: r["step"]), key=lambda r: r["step"])


def profiles(store: ObjectStore, run_id: str, role: str) -> list[dict[str, Any]]:
    """The time breakdowns (laminar.timing's `to_dict`) of the run's processes of one role: `trainer` (one per
    trainer process) or `rollout` (one per replica incarnation: replica x history segment x attempt)."""
    return [json.loads(store.get(k)) for k in store.list(keys.profile_prefix(run_id, role))]


def drill_reports(store: ObjectStore, run_id: str) -> list[dict[str, Any]]:
    """The run's drill reports (laminar.contract.DrillReport as written by activities/drill.py), in key order."""
    return [json.loads(store.get(k)) for k in store.list(keys.drill_reports_prefix(run_id)) if k.endswith(".json")]


def summary(store: ObjectStore, run_id: str) -> dict[str, Any] | None:
    """The summary `laminar run` wrote at the end; None for a run still going or started with `laminar start`."""
    try:
        return json.loads(store.get(keys.summary(run_id)))
    except ObjectNotFoundError:
        return None


@dataclass(frozen=True)
class TrajRow:
    """A trajectory as the reports need it. Times in unix wall s; token counts None if read without them."""

    group_id: str
    prompt_id: int
    sample_index: int
    replica_id: str
    policy_version: int
    started_at: float
    ended_at: float
    prompt_tokens: int | None = None
    response_tokens: int | None = None


_COLUMNS = ["group_id", "prompt_id", "sample_index", "replica_id", "policy_version", "started_at", "ended_at"]


def trajectory_rows(store: ObjectStore, run_id: str, token_counts: bool = True) -> list[TrajRow]:
    """Every trajectory of the run's experience segments (consumed or not), each (group, sample) once.
    token_counts=False skips reading the token columns (most of a segment's bytes)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    lists = ["prompt_ids", "response_ids"] if token_counts else []
    rows: list[TrajRow] = []
    for key in (k for k in store.list(keys.experience_prefix(run_id)) if k.endswith(".parquet")):
        table = pq.read_table(io.BytesIO(store.get(key)), columns=[*_COLUMNS, *lists])
        columns = [table[c].to_pylist() for c in _COLUMNS] + [pc.list_value_length(table[c]).to_pylist() for c in lists]
        rows.extend(TrajRow(*values) for values in zip(*columns, strict=True))
    return first_per(rows, lambda t: (t.group_id, t.sample_index))
