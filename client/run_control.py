"""Python-client operations on runs: start, status, stop, pause/resume (what `laminar start|status|stop`
and examples/ use)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from datetime import UTC, datetime, timedelta

from rich.table import Table
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowHandle,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from laminar import contract, search, watchdog
from laminar.client.connect import connect, store_for
from laminar.client.fork import lost_error, taken_error
from laminar.client.settings import Settings
from laminar.config import RunConfig
from laminar.contract import (
    CONTROL_QUEUE,
    CONTROL_UNCACHED_QUEUE,
    PoolStatus,
    RunStatus,
    ScaleInput,
    ScaleResult,
    SlotReport,
    pool_workflow_id,
    workflow_id_for,
)
from laminar.errors import ConfigError, LaminarError, StoreError
from laminar.storage import keys
from laminar.storage.objects import ObjectStore
from laminar.storage.runs import RunMarker, stored_run, write_marker


def new_run_id() -> str:
    return "run-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S")


CONTROL_ANSWER_S = 10.0  # how long `laminar status|stop|pause|resume` wait for the control worker


OWNER_MEMO = "laminar_owner"  # the memo field naming the command that owns a run (`laminar list` reads it)


def owner_memo(command: str) -> dict:
    """Who owns a run, for its workflow's memo: the command and its process (`laminar list` shows a run whose
    owning process is gone as orphaned). pid 0: a run of `laminar start`, owned by the shared worker set."""
    pid = 0 if command == "laminar start" else os.getpid()
    return {OWNER_MEMO: {"command": command, "pid": pid, "host": socket.gethostname()}}


async def start_workflow(client: Client, cfg: RunConfig, pool: str = "", owner: str = "") -> WorkflowHandle:
    """Start the run's workflow; a run id already used, by a live or a finished run, is an error. `pool`: the slot
    pool it shares a worker set through (workflows/pool.py; "" for a run that owns its workers). `owner`: the
    command that owns the run (its memo; "" for none)."""
    try:
        return await client.start_workflow(
            contract.TRAINING_RUN_WORKFLOW,
            contract.TrainingRunInput(config=cfg.to_json(), pool=pool),
            id=workflow_id_for(cfg.run.run_id),
            task_queue=CONTROL_QUEUE,
            task_timeout=contract.WORKFLOW_TASK,
            result_type=RunStatus,
            id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,  # its store prefix holds the old run
            search_attributes=await search.initial(client, client.namespace, cfg.run.mode),  # laminar/search.py
            memo=owner_memo(owner) if owner else None,
        )
    except WorkflowAlreadyStartedError:
        raise LaminarError(
            f"run id {cfg.run.run_id!r} is already taken by another run; pick another --run-id"
        ) from None
    except RPCError as e:
        raise LaminarError(f"could not start run {cfg.run.run_id}: {e}; pick another --run-id") from None


async def start_stored_run(client: Client, store: ObjectStore, cfg: RunConfig, pool: str = "",
                           owner: str = "") -> WorkflowHandle:
    """Check the run id is free in the store, write the run's marker and config (runs/<id>/run.json,
    config.json), then start its workflow. A run id whose store prefix holds anything is refused
    (RunIdTakenError, naming the ways on): a new run never writes over an old run's records."""
    run_id = cfg.run.run_id
    found = stored_run(store, run_id)
    if found is not None:
        raise await taken_error(client, store, found)
    marker = RunMarker(run_id=run_id, started_at=datetime.now(UTC).isoformat(timespec="seconds"),
                       started_by=f"{owner or 'a client'} (pid {os.getpid()} on {socket.gethostname()})",
                       temporal=f"{client.service_client.config.target_host}/{client.namespace}",
                       parent=cfg.run.parent, parent_step=cfg.run.parent_step)
    write_marker(store, marker)
    store.put(keys.config(run_id), cfg.model_dump_json(indent=2).encode())
    try:
        return await start_workflow(client, cfg, pool, owner)
    except BaseException:  # not started: what this call wrote goes, so the id stays free for the next try
        for key in (keys.config(run_id), keys.run_marker(run_id)):
            store.delete(key)
        raise


async def ensure_pool(client: Client, report: SlotReport | None = None) -> str:
    """Start the rollout queue's slot pool unless it runs (idempotent; with `report`: signal-with-start of a worker
    set's slots); returns its workflow id."""
    pool_id = pool_workflow_id()
    signal = {"start_signal": contract.POOL_SLOTS, "start_signal_args": [report]} if report is not None else {}
    try:
        await client.start_workflow(
            contract.SLOT_POOL_WORKFLOW, contract.PoolInput(), id=pool_id, task_queue=CONTROL_UNCACHED_QUEUE,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING, **signal)
    except RPCError as e:
        raise LaminarError(f"slot pool {pool_id}: could not start it or signal it: {e}") from None
    return pool_id


async def report_slots(settings: Settings, report: SlotReport) -> str:
    """`laminar workers`: give the pool this worker set's slots (slots=0 on the way out withdraws them)."""
    return await ensure_pool(await connect(settings), report)


async def leave_pool(client: Client, run_id: str) -> None:
    """Tell the pool a run is gone (`laminar stop --force`: a terminated run cannot say so itself)."""
    try:
        await client.get_workflow_handle(pool_workflow_id()).signal(contract.POOL_LEAVE, run_id)
    except RPCError as e:
        if e.status != RPCStatusCode.NOT_FOUND:  # no pool: nothing to leave
            raise LaminarError(f"slot pool {pool_workflow_id()}: could not signal that run {run_id} left: {e}") from None


async def query_pool(settings: Settings, timeout_s: float = CONTROL_ANSWER_S) -> PoolStatus:
    """`laminar pool`: the slots, the worker sets that give them, and each run's ask and grant."""
    handle = (await connect(settings)).get_workflow_handle(pool_workflow_id())
    try:
        return await handle.query(contract.POOL_STATUS, result_type=PoolStatus,
                                  rpc_timeout=timedelta(seconds=timeout_s))
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND:
            raise LaminarError(f"no slot pool {pool_workflow_id()} in namespace {settings.namespace}: start "
                               "`laminar workers` (runs of `laminar run` own their workers and share none)") from None
        if e.status in (RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED):
            raise _no_answer(pool_workflow_id(), "pool status", timeout_s) from None
        raise LaminarError(f"slot pool {pool_workflow_id()}: status failed: {e}") from None


async def start_or_attach(client: Client, store: ObjectStore, cfg: RunConfig,
                          owner: str = "laminar run") -> tuple[WorkflowHandle, bool]:
    """`laminar run`: start the run, or attach to it when a workflow with its id is still running (a
    `laminar run` that died left it behind). Returns (handle, attached). A finished run with this id is an
    error: its id cannot be reused."""
    handle = client.get_workflow_handle(workflow_id_for(cfg.run.run_id), result_type=RunStatus)
    try:
        status = (await handle.describe()).status
    except RPCError as e:
        if e.status != RPCStatusCode.NOT_FOUND:
            raise LaminarError(f"run {cfg.run.run_id}: cannot look it up: {e}") from None
        return await start_stored_run(client, store, cfg, owner=owner), False
    if status == WorkflowExecutionStatus.RUNNING:
        return handle, True
    name = status.name.lower() if status is not None else "closed"
    raise LaminarError(f"run {cfg.run.run_id} already ran and is {name}; pick another --run-id")


async def end_runs(settings: Settings, run_ids: list[str], reason: str) -> list[str]:
    """Terminate those of these runs that still run (through the server alone: no worker needed); returns their
    ids. What a command that started runs for its own purposes (`laminar bench`, `laminar simulate --validate`,
    `laminar chaos`) calls when it is interrupted or fails, so that no run of its outlives it."""
    client = await connect(settings, core_logs=False)
    ended = []
    for run_id in run_ids:
        handle = client.get_workflow_handle(workflow_id_for(run_id))
        try:
            if (await handle.describe()).status != WorkflowExecutionStatus.RUNNING:
                continue
            await handle.terminate(reason=reason)
        except RPCError as e:
            if e.status != RPCStatusCode.NOT_FOUND:
                raise LaminarError(f"run {run_id}: could not end it ({e}); end it with "
                                   f"`laminar stop --force {run_id}`") from None
            continue
        ended.append(run_id)
    return ended


def end_runs_now(settings: Settings, run_ids: list[str], reason: str, say=print) -> None:
    """end_runs from synchronous code on the way out (an interrupt, a failure): says what it ended, and what it
    could not, with the command that ends it."""
    if not run_ids:
        return
    try:
        ended = asyncio.run(asyncio.wait_for(end_runs(settings, run_ids, reason), 60.0))
    except (LaminarError, OSError, RuntimeError, TimeoutError) as e:
        say(f"could not end the runs this command started ({', '.join(run_ids)}): {e}; end each with "
            "`laminar stop --force <run id>`")
        return
    for run_id in ended:
        say(f"ended run {run_id} ({reason})")


async def start_run(settings: Settings, cfg: RunConfig) -> str:
    """`laminar start`: give the run an id if it has none, store its config, start it; returns the id."""
    if not cfg.run.run_id:
        cfg = cfg.with_run_id(new_run_id())
    client = await connect(settings)
    pool = await ensure_pool(client)  # the run shares the worker set's rollout slots through it (workflows/pool.py)
    await start_stored_run(client, store_for(settings), cfg, pool, owner="laminar start")
    return cfg.run.run_id


async def _handle(settings: Settings, run_id: str) -> WorkflowHandle:
    return (await connect(settings)).get_workflow_handle(workflow_id_for(run_id))


def _no_answer(run_id: str, what: str, timeout_s: float, wedged: str = "") -> LaminarError:
    if wedged:
        return LaminarError(f"run {run_id}: {what}: no answer within {timeout_s:.0f} s: {wedged}")
    return LaminarError(
        f"run {run_id}: {what}: no control worker answered within {timeout_s:.0f} s; is `laminar worker control` "
        f"running? use `laminar stop --force {run_id}` to terminate the run"
    )


async def _wedged(handle) -> str:
    """Why a run does not answer when its workflow tasks keep failing ('' when they do not, or it cannot tell)."""
    from temporalio.api.enums.v1 import EventType

    try:
        raw = (await handle.describe()).raw_description
        attempt = raw.pending_workflow_task.attempt if raw.HasField("pending_workflow_task") else 0
        if attempt < 2:
            return ""
        error = ""
        async for e in handle.fetch_history_events():
            if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
                error = e.workflow_task_failed_event_attributes.failure.message.splitlines()[0][:300]
    except RPCError:
        return ""
    return (f"its workflow task has failed {attempt} times (last: {error or 'unknown'}); the run is wedged. Every "
            "control worker's repairer resets a wedged run to its last good workflow task within about "
            f"{contract.REPAIR_SWEEP_S:g} s (docs/guides/chaos.md, 'Wedged runs'); one that a reset cannot repair is "
            "ended with the reason")


def _rpc_failed(settings: Settings, run_id: str, what: str, e: RPCError) -> LaminarError:
    if e.status == RPCStatusCode.NOT_FOUND:
        store = store_for(settings)
        try:
            found = stored_run(store, run_id) is not None
        except StoreError:
            found = False
        if found:  # the store knows the run, Temporal does not: Temporal lost it
            return lost_error(store, settings, run_id, what)
        return LaminarError(
            f"run {run_id}: no such run in namespace {settings.namespace} at {settings.temporal_address}"
        )
    if e.status == RPCStatusCode.UNAVAILABLE:
        return LaminarError(f"run {run_id}: {what}: Temporal at {settings.temporal_address} is unreachable ({e}); "
                            "start it with `laminar dev up` or set LAMINAR_TEMPORAL_ADDRESS")
    return LaminarError(f"run {run_id}: {what} failed: {e}")


async def query_status(settings: Settings, run_id: str, timeout_s: float = CONTROL_ANSWER_S) -> RunStatus:
    """The run's status query, answered by the control worker within timeout_s or a clear error."""
    handle = await _handle(settings, run_id)
    try:
        return await handle.query(contract.STATUS, result_type=RunStatus, rpc_timeout=timedelta(seconds=timeout_s))
    except RPCError as e:
        if e.status in (RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED):  # the rpc_timeout expired
            raise _no_answer(run_id, "status", timeout_s, await _wedged(handle)) from None
        raise _rpc_failed(settings, run_id, "status", e) from None


async def send_control(settings: Settings, run_id: str, name: str, timeout_s: float = CONTROL_ANSWER_S) -> str:
    """Send a control update (stop, pause, resume); the control worker must answer within timeout_s."""
    handle = await _handle(settings, run_id)
    try:
        return await handle.execute_update(name, result_type=str, rpc_timeout=timedelta(seconds=timeout_s))
    except WorkflowUpdateRPCTimeoutOrCancelledError:
        raise _no_answer(run_id, name, timeout_s, await _wedged(handle)) from None
    except RPCError as e:
        raise _rpc_failed(settings, run_id, name, e) from None


async def stop_run(settings: Settings, run_id: str) -> str:
    return await send_control(settings, run_id, contract.STOP)


async def scale_run(settings: Settings, run_id: str, replicas: int | None = None, relays: int | None = None,
                    timeout_s: float = CONTROL_ANSWER_S) -> ScaleResult:
    """`laminar scale`: set the run's rollout replica count and/or relay count (None: unchanged). New replicas
    start on free rollout slots (or on workers that join later); removed ones hand their unfinished groups to
    other replicas and return. A new host's relay joins the chain when its relay worker runs; a removed relay
    leaves the chain at once."""
    if replicas is None and relays is None:
        raise ConfigError("scale: give --replicas N, --relays M, or both")
    handle = await _handle(settings, run_id)
    try:
        res = await handle.execute_update(contract.SCALE, ScaleInput(replicas=replicas, relays=relays),
                                          result_type=ScaleResult,
                                          rpc_timeout=timedelta(seconds=timeout_s))
    except WorkflowUpdateRPCTimeoutOrCancelledError:
        raise _no_answer(run_id, contract.SCALE, timeout_s, await _wedged(handle)) from None
    except RPCError as e:
        raise _rpc_failed(settings, run_id, contract.SCALE, e) from None
    try:  # for the `laminar run` that owns the run's workers: it follows this record, not the workflow
        store_for(settings).put(keys.scale_targets(run_id), json.dumps(
            {"replicas_target": res.replicas_target, "relays_target": res.relays_target}).encode())
    except StoreError as e:
        raise LaminarError(f"run {run_id} scaled to replicas_target={res.replicas_target} "
                           f"relays_target={res.relays_target}, but the store refused the record that its "
                           f"`laminar run` follows to start worker processes ({e}); run the same `laminar scale` "
                           "again once the store answers") from None
    return res


def scale_targets(store: ObjectStore, run_id: str) -> tuple[int, int] | None:
    """(replicas_target, relays_target) of the run's last `laminar scale`, or None when it was never scaled or the
    store does not answer now (asked again at the next look)."""
    try:
        record = json.loads(store.get(keys.scale_targets(run_id)))
        return int(record["replicas_target"]), int(record["relays_target"])
    except (StoreError, ValueError, KeyError, TypeError):
        return None


async def terminate_run(settings: Settings, run_id: str) -> None:
    """`laminar stop --force`: terminate the workflow through the server alone (no worker needed)."""
    client = await connect(settings)
    handle = client.get_workflow_handle(workflow_id_for(run_id))
    try:
        await handle.terminate(reason="laminar stop --force")
    except RPCError as e:
        raise _rpc_failed(settings, run_id, "terminate", e) from None
    await leave_pool(client, run_id)  # its slots go to the other runs at once


def _grant_rows(st: RunStatus) -> dict[str, str]:
    """A run on a shared worker set: what it asked, what its slot pool granted, what runs, and why it got less."""
    if st.replicas_granted < 0 and not st.grant_note:
        return {}
    granted = "-" if st.replicas_granted < 0 else str(st.replicas_granted)
    rows = {"replicas (asked/granted/running)": f"{st.replicas_target}/{granted}/{st.replicas_running}"}
    if st.grant_note:
        rows["slot pool"] = st.grant_note
    return rows


def render_pool(p: PoolStatus) -> Table:
    t = Table(title=f"slot pool {pool_workflow_id()}: {p.slots} slots")
    for col in ("run", "asked", "quota", "granted", "why less"):
        t.add_column(col)
    for r in p.runs:
        t.add_row(r.run_id, str(r.asked), str(r.quota or "-"), str(r.granted), r.note or "")
    t.caption = ("worker sets: " + (", ".join(f"{k} ({v} slots)" for k, v in p.reporters.items()) or "none")
                 + (f"; engines served: {', '.join(p.engines)}" if p.engines else ""))
    return t


def _eval_rows(st: RunStatus) -> dict[str, str]:
    """Held-out eval rounds during training (workflows/evaluation.py): the last closed one and the open ones."""
    if not st.eval_done and not st.eval_pending:
        return {}
    rows = {}
    if st.eval_done:
        last = st.eval_done[-1]
        s = last.summary
        rows["eval (last)"] = (f"version {last.policy_version}: accuracy {s.accuracy:.3f} +- {s.accuracy_stderr:.3f}, "
                               f"pass@{s.samples} {s.pass_at_k:.3f}, {s.prompts} prompts, {s.failures} failed"
                               + ("" if last.recorded else " (record not stored yet)"))
    rows["eval rounds open"] = ", ".join(f"version {v}: {n} prompts to score" for v, n in st.eval_pending.items()) or "-"
    return rows


def render_status(st: RunStatus) -> Table:
    t = Table(title=f"run {st.run_id}", show_header=False)
    rows = {
        "phase": f"{st.phase} (its steps in flight finish)" if st.phase == "paused" and st.training else st.phase,
        "step": f"{st.step}/{st.total_steps}",
        "policy_version": st.policy_version,
        "reward (recent)": f"{st.reward_recent[-1]:.3f}" if st.reward_recent else "-",
        "groups generated/consumed": f"{st.groups_generated}/{st.groups_consumed}",
        "groups consumed twice": st.groups_consumed_twice,
        "groups failed": f"{st.groups_failed}" + (f" (last: {st.failures[-1].reason}, prompt {st.failures[-1].prompt_id})"
                                                  if st.failures else ""),
        "ready groups / open leases": f"{st.ready_groups}/{st.open_leases}",
        "versions in use (max)": f"{st.versions_in_use} ({st.max_versions_in_use})",
        "staleness histogram": st.staleness_histogram,
        "trainer wait fraction": f"{st.trainer_wait_fraction:.2f}",
        "history events (max)": f"{st.history_events} ({st.history_events_max})",
        "continued as new": st.continued_as_new,
        "workflow resets": f"{len(st.workflow_resets)}" + (
            f" (last: {st.workflow_resets[-1].error[:80]}; reset to event {st.workflow_resets[-1].reset_to}, "
            f"steps redone {max(0, st.workflow_resets[-1].step_before - st.workflow_resets[-1].step_after)})"
            if st.workflow_resets else ""),
        "replicas (target/running)": f"{st.replicas_target}/{st.replicas_running}"
                                     + (f", {st.scale_groups_returned} groups given back by removed replicas"
                                        if st.scale_groups_returned else ""),
        **_grant_rows(st),
        "relays (target/in chain)": f"{st.relays_target}/{len(st.relays)}: "
                                    + (", ".join(f"{r.relay_id}@{r.address}" for r in st.relays) or "-"),
        "latest checkpoint": st.checkpoints[-1].step if st.checkpoints else "-",
        **_eval_rows(st),
    }
    stall = watchdog.stall_line(st, time.time())  # the workflow's `at` times are the server's clock
    if stall:
        rows["watchdog"] = stall
    for k, v in rows.items():
        t.add_row(k, str(v))
    return t
