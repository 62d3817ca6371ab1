"""`laminar fork PARENT`: a new run from the newest committed checkpoint of another (docs/decisions.md, 'A run id
is never reused'). The way on when Temporal lost a run's state: the store still holds the run's config and
checkpoints, so training goes on under a new id, which records its parent; nothing of the parent is written.

The fork's config is the parent's stored config (runs/<parent>/config.json) with run.parent and run.parent_step
set, then the command's overrides. Its trainer starts from the parent's checkpoint (weights and optimizer,
services/trainer.py); its steps count from 0 again, and by default it runs the parent's remaining steps.
"""

from __future__ import annotations

import json

from laminar.config import RunConfig, apply_overrides
from laminar.errors import ConfigError, LaminarError, ObjectNotFoundError
from storage import keys
from storage.objects import ObjectStore
from storage.runs import newest_checkpoint, stored_run

FORK_IDS_TRIED = 100  # <parent>-fork-s<step>, then -2, -3, ...: the first id the store holds nothing of


def fork_config(store: ObjectStore, parent: str, run_id: str | None, overrides: list[str],
                steps: int | None) -> RunConfig:
    """The config of a new run forked from `parent`'s newest committed checkpoint that verifies. `run_id` None:
    `<parent>-fork-s<step>` (or the first free one after it); `steps` None: the parent's steps left after that
    checkpoint (at least 1)."""
    try:
        raw = json.loads(store.get(keys.config(parent)))
    except ObjectNotFoundError:
        raise LaminarError(f"run {parent}: the store {store.describe()} holds no {keys.config(parent)}, so there "
                           "is no run to fork (check the run id and LAMINAR_STORE)") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LaminarError(f"run {parent}: {keys.config(parent)} is not valid JSON ({e}); the store holds a "
                           "corrupt object") from None
    step = newest_checkpoint(store, parent)
    if step is None:
        raise LaminarError(f"run {parent}: no committed checkpoint in the store {store.describe()} verifies, so "
                           "there is nothing to fork from; start afresh with `laminar run --run-id <new id>`")
    left = max(1, int(raw.get("run", {}).get("steps", 1)) - step)
    run_id = run_id or _free_id(store, f"{parent}-fork-s{step}")
    if run_id == parent:
        raise ConfigError(f"--run-id {run_id!r} is the parent's own id; a fork needs a new one")
    data = {**raw, "run": {**raw.get("run", {}), "run_id": run_id, "parent": parent, "parent_step": step,
                           "steps": steps if steps is not None else left}}
    apply_overrides(data, overrides)
    cfg = RunConfig.from_json(data)
    if (cfg.run.parent, cfg.run.parent_step) != (parent, step):
        raise ConfigError(f"run.parent and run.parent_step are set by `laminar fork` ({parent!r}, {step}); leave "
                          "them out of the overrides")
    return cfg


def _free_id(store: ObjectStore, base: str) -> str:
    for n in range(1, FORK_IDS_TRIED + 1):
        candidate = base if n == 1 else f"{base}-{n}"
        if stored_run(store, candidate) is None:
            return candidate
    raise LaminarError(f"the store holds runs {base} to {base}-{FORK_IDS_TRIED}; give the fork an id: --run-id")
