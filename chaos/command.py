"""What `laminar chaos [CONFIG] --duration 30m --seed S [--faults ...] [--rate N] [--replay FILE]`: a run under a
seeded fault schedule, judged at the end by the checker.

1. The dev stack with its S3 server (the store, readonly and Temporal faults interrupt it), then `laminar run CONFIG` as
   a child process (its launcher publishes the process table the nemesis aims at; its output goes to
   `<out>/run.log`), with `run.steps` large: chaos ends the run itself.
2. Once the run trains, the schedule (chaos/schedule.py) is planned from the seed and the table's processes,
   printed and saved to `<out>/schedule.json` (`--replay` that file, or give the same `--seed`, to run it again).
3. The nemesis (chaos/nemesis.py) injects and heals every fault; at `--duration` the run is stopped (the
   `stop` update: it finishes its step and returns its final status) and the child exits.
4. The checker (chaos/checker.py) reads the run's durable records and writes `<out>/verdict.json` and
   `<out>/report.md` (checks and the fault table). Exit 0 when green, 1 when red.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import psutil
from rich.console import Console

from laminar.chaos.checker import (
    Verdict,
    format_verdict,
    judge,
    read_step_records,
    read_workflow_resets,
    verify_checkpoints,
)
from laminar.chaos.nemesis import FaultRecord, Nemesis, alive, partition_tool, read_table, same_start
from laminar.chaos.schedule import (
    KINDS,
    Schedule,
    format_schedule,
    plan_schedule,
    schedule_from_json,
    schedule_to_json,
    targets_for,
)
from laminar.client.connect import connect, store_for
from laminar.client.exit import stop_like_ctrl_c
from laminar.client.run_control import end_runs_now, new_run_id
from laminar.client.settings import Settings, process_table_path
from laminar.client.watch import RunProgress, progress_of
from laminar.contract import RunStatus, workflow_id_for
from laminar.devstack.stack import DevStack
from laminar.errors import ConfigError, LaminarError
from laminar.reporting.tool_calls import count_tool_calls

console = Console()
STEPS_UNBOUNDED = 1_000_000  # chaos stops the run itself at --duration
START_TIMEOUT_S = 600.0  # the run must train its first step within this (base model warm-up included)
STOP_TIMEOUT_S = 300.0


def default_kinds() -> list[str]:
    """Every kind. One this machine cannot inject (partition without iptables or nft) stays in the schedule and
    each of its faults is recorded as skipped with the reason, so the chaos report shows it was not exercised."""
    return list(KINDS)


def run_chaos(config: Path, overrides: list[str], duration_s: float | None, seed: int, kinds: list[str] | None,
              rate_per_min: float, overlaps: int, replay: Path | None, out: Path | None, run_id: str | None,
              say=console.print) -> tuple[Verdict, Path]:
    if os.environ.get("LAMINAR_TEMPORAL_ADDRESS", "").strip():
        raise ConfigError("laminar chaos restarts the dev stack's Temporal server and S3 store: unset "
                          "LAMINAR_TEMPORAL_ADDRESS so that it runs against the dev stack of LAMINAR_HOME")
    partition = partition_tool()
    if kinds and "partition" in kinds and partition is None:
        raise ConfigError("--faults partition needs iptables or nft (and the right to use them) on this machine; "
                          "install one, run as root, or leave partition out of --faults")
    replayed = schedule_from_json(replay.read_text(), str(replay)) if replay is not None else None
    if replayed is None and duration_s is None:
        raise ConfigError("--duration is required (e.g. --duration 30m), unless --replay gives a schedule")
    home = Settings.from_env().home
    stack = DevStack(home)
    _, started_stack = stack.ensure_up(s3=True, ui=False)
    settings = Settings.from_env()
    run_id = run_id or new_run_id()
    out = out or home / "chaos" / run_id
    out.mkdir(parents=True, exist_ok=True)
    table_path = process_table_path(home, run_id)
    argv = [sys.executable, "-m", "laminar.cli.main", "run", str(config), "--run-id", run_id, "--log-format", "json",
            "--summary", str(out / "summary.json"), f"--run.steps={STEPS_UNBOUNDED}", *overrides]
    say(f"chaos run_id={run_id} out={out}", highlight=False)
    stop_like_ctrl_c()  # SIGTERM too: the child and the run are ended on the way out
    try:
        with open(out / "run.log", "ab") as log_file:
            child = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, "LAMINAR_HOME": str(home)})
        nemesis = Nemesis(table_path, stack.interrupt_s3, stack.restart_temporal, partition, stack.readonly_s3)
        try:
            asyncio.run(_wait_training(settings, run_id, table_path, child))
            names_ = [r["name"] for r in read_table(table_path)["processes"]]
            if replayed is not None:
                schedule = replayed
            else:
                assert duration_s is not None
                chosen = kinds or default_kinds()
                schedule = plan_schedule(seed, duration_s, chosen, targets_for(chosen, names_), rate_per_min, overlaps)
            (out / "schedule.json").write_text(schedule_to_json(schedule))
            say(format_schedule(schedule), highlight=False)
            t0 = time.time()
            (out / "chaos.json").write_text(json.dumps({"run_id": run_id, "t0": t0, "home": str(home)}))
            records = _run_nemesis(nemesis, schedule, t0, child, say)
            (out / "faults.json").write_text(json.dumps([asdict(r) for r in records], indent=2))
            final, stop_error = asyncio.run(_stop_run(settings, run_id))
            if stop_error:
                say(f"[red]{stop_error}[/red]", highlight=False)
            try:
                child.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.terminate()
                child.wait(timeout=60)
        except BaseException:  # interrupted or failed: its run ends with it (the child may not have ended it)
            _end_on_the_way_out(nemesis, child, settings, run_id, say)
            raise
        finally:
            nemesis.stop()
            nemesis.heal_all()
            if child.poll() is None:
                child.terminate()
                child.wait(timeout=60)
        verdict = _judge(settings, run_id, final, table_path, home, records, out / "run.log", t0, stop_error)
        (out / "verdict.json").write_text(verdict.to_json())
        (out / "report.md").write_text(format_verdict(verdict) + "\n")
    finally:
        if started_stack:  # the dev stack this command started (S3 keeps its snapshot)
            stack.down()
    return verdict, out


def _end_on_the_way_out(nemesis: Nemesis, child: subprocess.Popen, settings: Settings, run_id: str, say) -> None:
    """Heal the faults, stop the child `laminar run` (SIGTERM: it cancels its run and stops its workers), then
    terminate the run if it still runs: no run of `laminar chaos` outlives it."""
    nemesis.stop()
    nemesis.heal_all()
    if child.poll() is None:
        child.terminate()
        child.wait(timeout=60)
    end_runs_now(settings, [run_id], "laminar chaos was interrupted or failed",
                 say=lambda m: say(m, highlight=False))


def rejudge(out: Path) -> Verdict:
    """Judge a finished chaos run again from its output folder and its records (`laminar chaos --judge DIR`):
    the same checks on the same durable records, e.g. after the checker changed. Needs the run's dev stack."""
    try:
        meta = json.loads((out / "chaos.json").read_text())
        records = [FaultRecord(**r) for r in json.loads((out / "faults.json").read_text())]
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"--judge {out}: not the output folder of a finished `laminar chaos` run ({e})") from None
    home = Path(meta["home"])
    stack = DevStack(home)
    _, started = stack.ensure_up(s3=True, ui=False)
    try:
        settings = Settings.from_env({**os.environ, "LAMINAR_HOME": str(home)})
        final, error = asyncio.run(_result(settings, meta["run_id"]))
        verdict = _judge(settings, meta["run_id"], final, process_table_path(home, meta["run_id"]), home, records,
                         out / "run.log", meta["t0"], error)
    finally:
        if started:
            stack.down()
    (out / "verdict.json").write_text(verdict.to_json())
    (out / "report.md").write_text(format_verdict(verdict) + "\n")
    return verdict


async def _result(settings: Settings, run_id: str) -> tuple[RunStatus | None, str]:
    client = await connect(settings, core_logs=False)
    handle = client.get_workflow_handle(workflow_id_for(run_id), result_type=RunStatus)
    desc = await handle.describe()
    if desc.status is None or desc.status.name != "COMPLETED":
        return None, f"run {run_id} did not end: its workflow is {desc.status.name if desc.status else 'unknown'}"
    return await handle.result(), ""


def _run_nemesis(nemesis: Nemesis, schedule: Schedule, t0: float, child: subprocess.Popen, say) -> list[FaultRecord]:
    def done(r: FaultRecord) -> None:
        when = "-" if r.injected_at is None else f"+{r.injected_at - t0:.1f}s"
        healed = "-" if r.healed_at is None else f"+{r.healed_at - t0:.1f}s"
        say(f"fault #{r.index} {r.kind} {r.target} injected {when} healed {healed}"
            + (f" skipped: {r.detail}" if r.skipped else (f" ({r.detail})" if r.detail else "")), highlight=False)

    th = threading.Thread(target=nemesis.run, args=(schedule, t0, done), name="nemesis", daemon=True)
    th.start()
    while time.time() < t0 + schedule.duration_s:
        if child.poll() is not None:
            nemesis.stop()
            th.join()
            raise LaminarError(f"`laminar run` exited with code {child.returncode} during the chaos run; see its log")
        time.sleep(0.5)
    nemesis.stop()
    th.join()
    return nemesis.records


async def _wait_training(settings: Settings, run_id: str, table_path: Path, child: subprocess.Popen) -> None:
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        if child.poll() is not None:
            raise LaminarError(f"`laminar run` exited with code {child.returncode} before training; see its log")
        table = read_table(table_path)
        if table.get("processes") and all(r["pid"] for r in table["processes"]):
            p = await _progress(settings, run_id)
            if p is not None and p.phase == "running" and (p.step or 0) >= 1:
                return
        await asyncio.sleep(1.0)
    raise LaminarError(f"run {run_id} trained no step within {START_TIMEOUT_S:.0f}s (as its search attributes "
                       "LaminarPhase and LaminarStep show); see its log")


async def _progress(settings: Settings, run_id: str) -> RunProgress | None:
    """The run's phase and step from the server's describe (its search attributes), never a workflow query: a
    query polled while Temporal restarts is the window that wedges a run (docs/upstream/wedged-run.md)."""
    try:
        client = await connect(settings, core_logs=False)
        return progress_of(await client.get_workflow_handle(workflow_id_for(run_id)).describe())
    except Exception:  # not started yet, or Temporal restarting
        return None


async def _stop_run(settings: Settings, run_id: str) -> tuple[RunStatus | None, str]:
    """Send `stop` (retried while Temporal or the control worker comes back); the workflow's result, or None and
    why the run did not end (then the run is left as it is, for its history to be read: the verdict is red)."""
    deadline = time.time() + STOP_TIMEOUT_S
    while True:
        try:
            client = await connect(settings, core_logs=False)
            handle = client.get_workflow_handle(workflow_id_for(run_id), result_type=RunStatus)
            await asyncio.wait_for(handle.execute_update("stop", result_type=str), timeout=30)
            return await asyncio.wait_for(handle.result(), timeout=max(1.0, deadline - time.time())), ""
        except Exception as e:
            if time.time() > deadline:
                return None, f"run {run_id} did not stop within {STOP_TIMEOUT_S:.0f}s: {type(e).__name__}: {e}"
            await asyncio.sleep(2.0)


def _judge(settings: Settings, run_id: str, final: RunStatus | None, table_path: Path, home: Path,
           records: list[FaultRecord], run_log: Path, t0: float, stop_error: str = "") -> Verdict:
    store = store_for(settings)
    table = read_table(table_path)
    known = incarnations(table)
    log_dir = home / "logs" / run_id  # the local launcher's (cli/run.py make_launcher), as `laminar drill` counts
    calls = count_tool_calls(log_dir, run_id) if log_dir.is_dir() else None
    return judge(final, read_step_records(store, run_id), verify_checkpoints(store, run_id), table,
                 {pid for pid, created in known if alive(pid, created)}, strays(home, known),
                 [asdict(r) for r in records],
                 exit_codes(run_log), t0, stop_error, read_workflow_resets(store, run_id), calls)


def incarnations(table: dict) -> set[tuple[int, float | None]]:
    """(pid, start time) of every incarnation the launcher's table lists; the start time is None in a table written
    before it recorded them (then the pid alone identifies the process, as it did)."""
    out: set[tuple[int, float | None]] = set()
    for r in table.get("processes", []):
        times = r.get("create_times") or []
        for i, pid in enumerate(r.get("pids", [])):
            out.add((int(pid), times[i] if i < len(times) else None))
    return out


def strays(home: Path, known: set[tuple[int, float | None]]) -> list[int]:
    """Worker processes (`cli.main worker`) of this LAMINAR_HOME that are none of the table's incarnations (a
    process with the pid of one but a later start time is not that one)."""
    starts: dict[int, list[float | None]] = {}
    for pid, created in known:
        starts.setdefault(pid, []).append(created)
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info.get("cmdline") or []
        if "laminar.cli.main" not in cmd or "worker" not in cmd:
            continue
        try:
            if any(same_start(p, created) for created in starts.get(p.info["pid"], [])):
                continue
            if p.environ().get("LAMINAR_HOME") == str(home) and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.info["pid"])
        except psutil.Error:
            pass
    return out


def exit_codes(run_log: Path) -> dict[int, int]:
    """pid -> exit code of every worker exit the launcher logged (`process_exited`, JSON log lines)."""
    out = {}
    try:
        lines = run_log.read_text(errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        if '"process_exited"' in line and line.lstrip().startswith("{"):
            try:
                e = json.loads(line)
                out[int(e["pid"])] = int(e["code"])
            except (ValueError, KeyError, TypeError):
                pass
    return out
