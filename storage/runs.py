"""What the store holds of a run, and its marker (docs/decisions/run-ids.md, 'A run id is never reused').

The marker, runs/<run_id>/run.json, is the first object a run gets: whoever starts a run writes it before the
run's config (client/run_control.py), naming the command that started it, the Temporal server it ran on and, for
a run forked from another, its parent and the parent's checkpoint step. A run id whose prefix holds any object is
taken for good: Temporal forgets a run when its database is lost, the store does not, and a new run under the old
id would write its checkpoints, metrics and summary over the old run's.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

from laminar.errors import CorruptDataError, ObjectNotFoundError
from laminar.storage import keys
from laminar.storage.checkpoints import CheckpointStore
from laminar.storage.objects import ObjectStore

_METRICS_FILE = re.compile(r"step-(\d{8})\.json$")


@dataclass(frozen=True)
class RunMarker:
    """runs/<run_id>/run.json. `parent`/`parent_step`: the run and checkpoint step a forked run started from
    ("" and -1 for a run started afresh)."""

    run_id: str
    started_at: str  # UTC, ISO 8601
    started_by: str  # the command, e.g. "laminar run (pid 1234 on host-a)"
    temporal: str  # "<address>/<namespace>" of the server that ran it
    parent: str = ""
    parent_step: int = -1


def write_marker(store: ObjectStore, marker: RunMarker) -> None:
    store.put(keys.run_marker(marker.run_id), json.dumps(asdict(marker), indent=1).encode())


def read_marker(store: ObjectStore, run_id: str) -> RunMarker | None:
    """The run's marker; None for a run that has none (started before markers existed, or never)."""
    try:
        raw = json.loads(store.get(keys.run_marker(run_id)))
    except ObjectNotFoundError:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptDataError(f"run {run_id}: {keys.run_marker(run_id)} is not valid JSON ({e}); the store holds "
                               "a corrupt object") from None
    try:
        return RunMarker(**{k: v for k, v in raw.items() if k in RunMarker.__dataclass_fields__})
    except (TypeError, AttributeError) as e:
        raise CorruptDataError(f"run {run_id}: {keys.run_marker(run_id)} is not a run marker ({e}); the store holds "
                               "a corrupt or foreign object") from None


@dataclass(frozen=True)
class StoredRun:
    """What the store holds of one run: enough to say what a lost run leaves and where a fork starts."""

    run_id: str
    objects: int
    marker: RunMarker | None
    checkpoints: list[int] = field(default_factory=list)  # steps with a committed manifest, ascending
    last_metrics_step: int = 0  # the newest step with a metrics record (0: none)

    def describe(self) -> str:
        """One line: `runs/h26/: 412 objects, step metrics up to step 74, committed checkpoints at steps 60, 70`."""
        ckpts = ", ".join(str(s) for s in self.checkpoints[-3:]) if self.checkpoints else "none"
        more = f" ({len(self.checkpoints)} in all)" if len(self.checkpoints) > 3 else ""
        return (f"{keys.run_prefix(self.run_id)}: {self.objects} objects, step metrics up to step "
                f"{self.last_metrics_step}, committed checkpoints at steps {ckpts}{more}")


def stored_run(store: ObjectStore, run_id: str) -> StoredRun | None:
    """What the store holds under runs/<run_id>/; None when it holds nothing (the id is free)."""
    found = store.list(keys.run_prefix(run_id))
    if not found:
        return None
    metrics_prefix = keys.step_metrics_prefix(run_id)
    steps = [int(m.group(1)) for k in found if k.startswith(metrics_prefix) and (m := _METRICS_FILE.search(k))]
    ckpts = sorted({s for k in found if (s := keys.parse_checkpoint_step(run_id, k)) is not None
                    and k == keys.checkpoint_manifest(run_id, s)})
    try:
        marker = read_marker(store, run_id)
    except CorruptDataError:  # what the prefix holds still takes the id
        marker = None
    return StoredRun(run_id=run_id, objects=len(found), marker=marker, checkpoints=ckpts,
                     last_metrics_step=max(steps, default=0))


def newest_checkpoint(store: ObjectStore, run_id: str) -> int | None:
    """The step of the run's newest committed checkpoint whose every file verifies; None if it has none."""
    ref = CheckpointStore(store).latest(run_id)
    return None if ref is None else ref.step
