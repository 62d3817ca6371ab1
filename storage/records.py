"""A run's records, read from the store in one place: the trainer's step metrics, each process's time
breakdown, the drill reports, the run summary and the trajectory rows of the experience segments
(docs/architecture.md, 'Storage layout'; every key from storage/keys.py). The run summary, `laminar report`
and the benchmarks read through here.

One de-duplication rule for every kind of record (`first_per`): a record is identified by its natural key (a
step record by its step, a trajectory row by (group_id, sample_index)), records are taken in key order, and
the first of each identity is the one counted. So what a retried activity writes again counts once: a retried
train step rewrites its step record under the same key, and a retried rollout report writes its groups
again in a later segment, whose repeats are skipped (the workflow accepted the first report).
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from laminar.errors import ObjectNotFoundError
from storage import keys
from storage.objects import ObjectStore

T = TypeVar("T")


def first_per(items: Iterable[T], identity: Callable[[T], Hashable]) -> list[T]:
    """The items in order, the first of each identity only."""
    seen: set[Hashable] = set()
    out = []
    for item in items:
        ident = identity(item)
        if ident not in seen:
            seen.add(ident)
            out.append(item)
    return out


def _json(store: ObjectStore, key: str) -> Any:
    return json.loads(store.get(key))


def step_records(store: ObjectStore, run_id: str) -> list[dict[str, Any]]:
    """The trainer's per-step metric records (services/trainer.py `_write_metrics`), one per step, by step."""
    found = (_json(store, k) for k in store.list(keys.step_metrics_prefix(run_id)))
    return sorted(first_per(found, lambda r: r["step"]), key=lambda r: r["step"])


def profiles(store: ObjectStore, run_id: str) -> dict[str, dict[str, Any]]:
    """Each process's time breakdown (laminar.timing's `to_dict`) by process name, e.g. `trainer-1234`."""
    found = ((keys.parse_profile_process(run_id, k), k) for k in store.list(keys.profile_prefix(run_id)))
    return {process: _json(store, k) for process, k in found if process is not None}


def drill_reports(store: ObjectStore, run_id: str) -> list[dict[str, Any]]:
    """The reports of the drills run against the run (laminar.messages.DrillReport, written by
    activities/drill.py), in key order."""
    return [_json(store, k) for k in store.list(keys.drill_reports_prefix(run_id)) if k.endswith(".json")]


def summary(store: ObjectStore, run_id: str) -> dict[str, Any] | None:
    """The summary `laminar run` wrote at the end; None for a run still going or started with `laminar start`."""
    try:
        return _json(store, keys.summary(run_id))
    except ObjectNotFoundError:
        return None


@dataclass(frozen=True)
class TrajRow:
    """What the reports need of one trajectory (a row of an experience segment). Times are unix wall s; the
    token counts are None when read without them (`trajectory_rows(..., token_counts=False)`)."""

    group_id: str
    prompt_id: int
    sample_index: int
    replica_id: str
    policy_version: int
    started_at: float
    ended_at: float
    prompt_tokens: int | None = None
    response_tokens: int | None = None


_TRAJ_COLUMNS = ["group_id", "prompt_id", "sample_index", "replica_id", "policy_version", "started_at", "ended_at"]


def trajectory_rows(store: ObjectStore, run_id: str, token_counts: bool = True) -> list[TrajRow]:
    """Every trajectory of the run's experience segments (consumed or not), each (group, sample) once, the
    first in key order. token_counts=False skips the token columns (most of a segment's bytes)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    rows: list[TrajRow] = []
    for key in store.list(keys.experience_prefix(run_id)):
        if not key.endswith(".parquet"):
            continue
        lists = ["prompt_ids", "response_ids"] if token_counts else []
        table = pq.read_table(io.BytesIO(store.get(key)), columns=[*_TRAJ_COLUMNS, *lists])
        columns = [table[c].to_pylist() for c in _TRAJ_COLUMNS]
        columns += [pc.list_value_length(table[c]).to_pylist() for c in lists]
        rows.extend(TrajRow(*values) for values in zip(*columns, strict=True))
    return first_per(rows, lambda t: (t.group_id, t.sample_index))
