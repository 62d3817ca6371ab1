"""`laminar report RUN [--out DIR]` and `laminar list`: see a run after (or while) it goes.

`report` reads the run's records from the object store (reporting/report.py) and writes PNG plots and one
self-contained HTML page. `list` asks Temporal's visibility store for TrainingRunWorkflow executions and
prints each run with the search attributes its workflow keeps up to date (mode, phase, step, policy
version, reward), where the server has them registered (`laminar dev up` does; devstack/stack.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from rich.console import Console
from rich.table import Table

from client.connect import connect, store_for
from client.settings import Settings
from laminar import names
from laminar.search import SEARCH_ATTRIBUTES
from reporting import report as run_report
from reporting.report import check_matplotlib
from storage.objects import ObjectStore


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
    where = (f"WorkflowType = '{names.TRAINING_RUN_WORKFLOW}' AND ExecutionStatus != 'ContinuedAsNew'"
             + (f" AND ({query})" if query else ""))
    out = []
    async for wf in client.list_workflows(where, limit=limit):
        attrs = {key.name: wf.typed_search_attributes.get(key) for key in SEARCH_ATTRIBUTES}
        out.append({"run_id": wf.id.removeprefix("run/"), "status": wf.status.name.lower() if wf.status else "-",
                    "started": wf.start_time.strftime("%m-%d %H:%M") if wf.start_time else "-",
                    **attrs})
    return out


def print_runs(runs: list[dict], console: Console) -> None:
    table = Table(box=None)
    columns = ["run_id", "status", "started", *(key.name for key in SEARCH_ATTRIBUTES)]
    for c in columns:
        table.add_column({"LaminarPolicyVersion": "version"}.get(c, c.removeprefix("Laminar").lower()),
                         no_wrap=c in ("run_id", "started", "status"))
    for r in runs:
        table.add_row(*("-" if r.get(c) is None else (f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]))
                        for c in columns))
    console.print(table)


def list_command(query: str, limit: int, console: Console) -> None:
    print_runs(asyncio.run(list_runs(Settings.from_env(), query, limit)), console)
