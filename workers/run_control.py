"""Python-client operations on runs: start, status, stop, pause/resume (what `laminar start|status|stop`
and examples/ use)."""

from __future__ import annotations

from datetime import UTC, datetime

from rich.table import Table
from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.service import RPCError

from laminar.config import RunConfig
from laminar.errors import LaminarError
from laminar.messages import CONTROL_QUEUE, RunStatus, workflow_id_for
from storage import keys
from storage.objects import ObjectStore
from workers.connect import connect, store_for
from workers.settings import Settings
from workflows.state import TrainingRunInput


def new_run_id() -> str:
    return "run-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S")


async def start_workflow(client: Client, cfg: RunConfig) -> WorkflowHandle:
    try:
        return await client.start_workflow(
            "TrainingRunWorkflow",
            TrainingRunInput(config=cfg.to_json()),
            id=workflow_id_for(cfg.run.run_id),
            task_queue=CONTROL_QUEUE,
            result_type=RunStatus,
            id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
        )
    except RPCError as e:
        raise LaminarError(f"could not start run {cfg.run.run_id}: {e}; pick another --run-id") from None


async def start_stored_run(client: Client, store: ObjectStore, cfg: RunConfig) -> WorkflowHandle:
    """Store the config with the run (runs/<id>/config.json), then start its workflow."""
    store.put(keys.config(cfg.run.run_id), cfg.model_dump_json(indent=2).encode())
    return await start_workflow(client, cfg)


async def start_run(settings: Settings, cfg: RunConfig) -> str:
    """`laminar start`: give the run an id if it has none, store its config, start it; returns the id."""
    if not cfg.run.run_id:
        cfg = cfg.with_run_id(new_run_id())
    await start_stored_run(await connect(settings), store_for(settings), cfg)
    return cfg.run.run_id


async def _handle(settings: Settings, run_id: str) -> WorkflowHandle:
    return (await connect(settings)).get_workflow_handle(workflow_id_for(run_id))


async def query_status(settings: Settings, run_id: str) -> RunStatus:
    try:
        return await (await _handle(settings, run_id)).query("status", result_type=RunStatus)
    except RPCError as e:
        raise LaminarError(f"run {run_id}: status query failed: {e}; is the control worker running?") from None


async def send_control(settings: Settings, run_id: str, name: str) -> str:
    try:
        return await (await _handle(settings, run_id)).execute_update(name, result_type=str)
    except RPCError as e:
        raise LaminarError(f"run {run_id}: {name} failed: {e}") from None


async def stop_run(settings: Settings, run_id: str) -> str:
    return await send_control(settings, run_id, "stop")


def render_status(st: RunStatus) -> Table:
    t = Table(title=f"run {st.run_id}", show_header=False)
    rows = {
        "phase": st.phase,
        "step": f"{st.step}/{st.total_steps}",
        "policy_version": st.policy_version,
        "reward (recent)": f"{st.reward_recent[-1]:.3f}" if st.reward_recent else "-",
        "groups generated/consumed": f"{st.groups_generated}/{st.groups_consumed}",
        "groups consumed twice": st.groups_consumed_twice,
        "ready groups / open leases": f"{st.ready_groups}/{st.open_leases}",
        "versions in use (max)": f"{st.versions_in_use} ({st.max_versions_in_use})",
        "staleness histogram": st.staleness_histogram,
        "trainer wait fraction": f"{st.trainer_wait_fraction:.2f}",
        "history events (max)": f"{st.history_events} ({st.history_events_max})",
        "continued as new": st.continued_as_new,
        "relays": ", ".join(f"{r.relay_id}@{r.address}" for r in st.relays) or "-",
        "latest checkpoint": st.checkpoints[-1].step if st.checkpoints else "-",
    }
    for k, v in rows.items():
        t.add_row(k, str(v))
    return t
