"""`laminar report RUN [--out DIR]` and `laminar list`: see a run after (or while) it goes.

`report` reads the run's records from the object store (reporting/report.py) and writes PNG plots and one
self-contained HTML page. `list` asks Temporal's visibility store for TrainingRunWorkflow executions and
prints each run with the search attributes its workflow keeps up to date (mode, phase, step, policy
version, reward), where the server has them registered (`laminar dev up` does; devstack/stack.py), and its owner:
the command that started it, or ORPHANED with the command that ends it when that command's process is gone.
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

from laminar import contract
from laminar.client.connect import connect, store_for
from laminar.client.run_control import OWNER_MEMO
from laminar.client.settings import Settings
from laminar.reporting import report as run_report
from laminar.reporting.report import check_matplotlib
from laminar.search import SEARCH_ATTRIBUTES
from laminar.storage.objects import ObjectStore


def write_report(store: ObjectStore, run_id: str, out_dir: Path, console: Console) -> Path:
    """Write the run's plots and page under out_dir; print and return the page's path."""
    check_matplotlib()
    files = run_report.write(run_report.read(store, run_id), out_dir)
    for f in files:
        console.print(f"wrote {f}", highlight=False, soft_wrap=True)
    return files[-1]


def report(run_id: str, out: Path | None, console: Console) -> Path:
    settings = Settings.from_env()
    return write_report(store_for(settings), run_id, out or Path("reports") / run_id, console)


async def list_runs(settings: Settings, query: str, limit: int) -> list[dict]:
    """TrainingRunWorkflow executions, newest first, as dicts of what `laminar list` prints."""
    client = await connect(settings, core_logs=False)
    # one row per run: a segment that continued as new is followed by the run's next one
    where = (f"WorkflowType = '{contract.TRAINING_RUN_WORKFLOW}' AND ExecutionStatus != 'ContinuedAsNew'"
             + (f" AND ({query})" if query else ""))
    out = []
    async for wf in client.list_workflows(where, limit=limit):
        attrs = {key.name: wf.typed_search_attributes.get(key) for key in SEARCH_ATTRIBUTES}
        run_id, status = wf.id.removeprefix("run/"), wf.status.name.lower() if wf.status else "-"
        out.append({"run_id": run_id, "status": status,
                    "started": wf.start_time.strftime("%m-%d %H:%M") if wf.start_time else "-",
                    **attrs, "owner": owner_line(run_id, status, (await wf.memo()).get(OWNER_MEMO))})
    return out


def owner_line(run_id: str, status: str, owner: dict | None) -> str:
    """Who owns a run, from its memo (client/run_control.py owner_memo). A running run whose owning command's
    process is gone from this host is orphaned: nothing ends it, and workers on its queues serve it; the line
    names the command that ends it (docs/decisions/runs-end-with-command.md, 'Runs a command starts end with it')."""
    if not isinstance(owner, dict) or not owner.get("command"):
        return "-"
    command, pid, host = str(owner["command"]), int(owner.get("pid") or 0), str(owner.get("host", ""))
    if not pid:  # `laminar start`: the shared worker set serves it
        return command
    if host != socket.gethostname():
        return f"{command} (pid {pid} on {host})"
    if status == "running" and not psutil.pid_exists(pid):
        return f"ORPHANED: {command} (pid {pid}) is gone; end it: laminar stop --force {run_id}"
    return f"{command} (pid {pid})"


def print_runs(runs: list[dict], console: Console) -> None:
    table = Table(box=None)
    columns = ["run_id", "status", "started", *(key.name for key in SEARCH_ATTRIBUTES), "owner"]
    for c in columns:
        table.add_column({"LaminarPolicyVersion": "version"}.get(c, c.removeprefix("Laminar").lower()),
                         no_wrap=c in ("run_id", "started", "status"))
    for r in runs:
        table.add_row(*("-" if r.get(c) is None else (f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]))
                        for c in columns))
    console.print(table)


def list_command(query: str, limit: int, console: Console) -> None:
    print_runs(asyncio.run(list_runs(Settings.from_env(), query, limit)), console)
