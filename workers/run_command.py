"""`laminar run`: the embedded default, end to end, on one machine.

Starts the dev stack if none runs, one process per role, the workflow; shows live progress; stops
everything it started on exit or Ctrl-C; writes the summary.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from temporalio.client import WorkflowFailureError

from laminar.config import RunConfig
from laminar.messages import RunStatus
from storage import keys
from workers.connect import connect, store_for
from workers.devstack import DevStack
from workers.launcher import LocalLauncher, plan_processes
from workers.run_control import new_run_id, start_stored_run
from workers.settings import Settings
from workers.summary import build_summary, reward_rise

POLL_S = 1.0


def run_local(cfg: RunConfig, summary_path: Path | None, console: Console) -> int:
    if not cfg.run.run_id:
        cfg = cfg.with_run_id(new_run_id())
    console.print(f"run_id={cfg.run.run_id}", highlight=False)
    home = Settings.from_env().home
    stack = DevStack(home)
    info, started_stack = stack.ensure_up()
    settings = Settings.from_env()  # dev.json now names the endpoints
    if settings.relay_token is None:  # relays of this run accept only its own processes
        settings = settings.with_relay_token(secrets.token_hex(16))
    console.print(f"temporal={info.temporal_address} ui={info.ui_url or '-'} store={settings.store_url}",
                  highlight=False)
    # SIGTERM / SIGHUP stop the run like Ctrl-C: nothing this command started may outlive it.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
    launcher = LocalLauncher(plan_processes(cfg, settings, home / "logs" / cfg.run.run_id, spare_slots=1, allow_faults=True))
    try:
        launcher.start_all()
        launcher.start_supervision()
        return asyncio.run(_drive(cfg, settings, summary_path, console))
    except KeyboardInterrupt:
        console.print("interrupted: stopping the run and every process this command started")
        return 130
    finally:
        launcher.stop_all()
        if started_stack:
            stack.down()


async def _drive(cfg: RunConfig, settings: Settings, summary_path: Path | None, console: Console) -> int:
    store = store_for(settings)
    client = await connect(settings)
    t0 = time.time()
    handle = await start_stored_run(client, store, cfg)
    result_task = asyncio.create_task(handle.result())
    try:
        await _watch(handle, result_task, cfg, console, t0)
        final = await result_task
    except WorkflowFailureError as e:
        console.print(f"[red]run failed:[/red] {e.cause or e}")
        return 1
    finally:
        if not result_task.done():  # interrupted: never leave a run behind to resume on the next start
            result_task.cancel()
            await handle.cancel()
    summary = build_summary(final, store, time.time() - t0)
    store.put(keys.summary(cfg.run.run_id), json.dumps(summary, indent=2).encode())
    if summary_path is not None:
        summary_path.parent.mkdir(parents=True, exist_ok=True)
        summary_path.write_text(json.dumps(summary, indent=2))
    _print_summary(summary, console)
    return 0


async def _watch(handle, result_task, cfg: RunConfig, console: Console, t0: float) -> None:
    columns = [TextColumn("[bold]step"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn()]
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("train", total=cfg.run.steps, info="starting workers")
        while not result_task.done():
            try:
                st: RunStatus = await handle.query("status", result_type=RunStatus)
                bar.update(task, completed=st.step, info=_progress_line(st, time.time() - t0))
            except Exception as e:  # the control worker may be (re)starting; keep polling
                bar.update(task, info=f"waiting for control worker ({type(e).__name__})")
            await asyncio.wait({result_task}, timeout=POLL_S)


def _progress_line(st: RunStatus, elapsed: float) -> str:
    reward = f"{st.reward_recent[-1]:.3f}" if st.reward_recent else "-"
    gaps = {int(k): v for k, v in st.staleness_histogram.items()}
    n = sum(gaps.values())
    mean_gap = sum(k * v for k, v in gaps.items()) / n if n else 0.0
    tps = st.tokens_consumed / elapsed if elapsed > 0 else 0.0
    return (f"{st.phase} reward={reward} tok/s={tps:.0f} versions={st.versions_in_use} "
            f"staleness={mean_gap:.2f} ready={st.ready_groups}")


def _print_summary(s: dict, console: Console) -> None:
    rewards = s["reward_per_step"]
    console.print(
        f"steps={s['steps']} reward first={rewards[0] if rewards else 0:.3f} last={rewards[-1] if rewards else 0:.3f} "
        f"rise={reward_rise(rewards):.3f} len p50={s['response_len_p50']} p99={s['response_len_p99']} "
        f"tokens/s={s['tokens_per_s']} max_versions_in_use={s['max_versions_in_use']} "
        f"staleness={s['staleness_histogram']} consumed_twice={s['groups_consumed_twice']} "
        f"history_max={s['temporal_history_events_max']}",
        highlight=False,
    )

