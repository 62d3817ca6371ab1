"""Run ids the store holds, runs Temporal lost, and `laminar fork PARENT`: a new run from the newest committed
checkpoint of another (docs/decisions/run-ids.md, 'A run id is never reused'). The way on when Temporal lost a run's state:
the store still holds the run's config and checkpoints, so training goes on under a new id, which records its
parent; nothing of the parent is written.

The fork's config is the parent's stored config (runs/<parent>/config.json) with run.parent and run.parent_step
set, then the command's overrides. Its trainer starts from the parent's checkpoint (weights and optimizer,
services/trainer.py); its steps count from 0 again, and by default it runs the parent's remaining steps.
"""

from __future__ import annotations

import json

from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from laminar.client.settings import Settings
from laminar.config import RunConfig, apply_overrides
from laminar.contract import workflow_id_for
from laminar.errors import (
    ConfigError,
    LaminarError,
    ObjectNotFoundError,
    RunIdTakenError,
    RunLostError,
    StoreError,
)
from laminar.storage import keys
from laminar.storage.objects import ObjectStore
from laminar.storage.runs import StoredRun, newest_checkpoint, stored_run

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


async def taken_error(client: Client, store: ObjectStore, found: StoredRun) -> LaminarError:
    """Why a new run cannot have this id: Temporal knows a run by it (live or finished), or it does not, and then
    its state of the run was lost (or the run ran on another server) while the store kept the records."""
    run_id = found.run_id
    try:
        status = (await client.get_workflow_handle(workflow_id_for(run_id)).describe()).status
    except RPCError as e:
        if e.status != RPCStatusCode.NOT_FOUND:
            raise LaminarError(f"run {run_id}: cannot look it up: {e}") from None
        status = None
    if status is not None:
        return RunIdTakenError(f"run id {run_id!r} is already taken by a run that is {status.name.lower()}; pick "
                               "another --run-id")
    where = f"{client.service_client.config.target_host}, namespace {client.namespace}"
    return RunIdTakenError(f"run id {run_id!r} is taken: the store {store.describe()} holds records of a run with "
                           f"this id ({found.describe()}), and Temporal at {where} has no workflow for it, so "
                           f"Temporal's state of that run was lost (its database was reset or replaced) or the run "
                           f"ran on another server. A new run under this id would write over those records, and "
                           f"laminar never does. {ways_on(found)}")


def ways_on(found: StoredRun) -> str:
    """The two ways on from a run id whose records a new run may not write over."""
    afresh = "start afresh under another id: --run-id <new id>"
    if not found.checkpoints:
        return f"It has no committed checkpoint to continue from; {afresh}."
    return (f"Either continue it from its newest committed checkpoint: `laminar fork {found.run_id}` starts a new "
            f"run (a new id that records {found.run_id} as its parent) from step {found.checkpoints[-1]}; or "
            f"{afresh}.")


def lost_error(store: ObjectStore, settings: Settings, run_id: str, what: str) -> RunLostError:
    """The run's workflow is gone from Temporal while the store holds its records: say what was lost, what is kept
    and the ways on."""
    try:
        found = stored_run(store, run_id)
    except StoreError as e:
        kept = f"the store {store.describe()} could not be read to say what it keeps ({e})"
        found = None
    else:
        kept = (f"the store {store.describe()} keeps its records untouched ({found.describe()})" if found
                else f"the store {store.describe()} holds no records of it")
    way = ways_on(found) if found else "Start a new run with `laminar run`."
    return RunLostError(f"run {run_id}: {what}: Temporal at {settings.temporal_address} (namespace "
                        f"{settings.namespace}) no longer has its workflow {workflow_id_for(run_id)}: its state of "
                        f"this run (history, step, leases) was lost, e.g. its database was reset or replaced; "
                        f"{kept}. {way}")
