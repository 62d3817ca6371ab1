"""`laminar run`: the embedded default, end to end, on one machine.

Starts the dev stack if none runs, one process per role, the workflow; shows live progress; stops
everything it started on exit or Ctrl-C; writes the summary.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from temporalio.client import WorkflowFailureError, WorkflowHandle

from laminar.client.connect import connect, store_for
from laminar.client.exit import stop_like_ctrl_c
from laminar.client.run_control import lost_error, new_run_id, report_slots, scale_targets, start_or_attach
from laminar.client.settings import Settings, process_table_path
from laminar.client.watch import RunProgress, watch_run
from laminar.config import RunConfig
from laminar.contract import PAYLOAD_WARNED_BYTES, RunStatus, SlotReport, retained_batches_bytes
from laminar.devstack.stack import DevStack
from laminar.errors import ConfigError, LaminarError, RunLostError, StoreError
from laminar.logs import get_logger
from laminar.reporting.summary import build_profile, build_summary, format_profile, reward_rise
from laminar.storage import keys
from laminar.storage.objects import ObjectStore
from laminar.workers.launcher import (
    LocalLauncher,
    metrics_url,
    plan_processes,
    process_cpu_s,
    rollout_slots,
)

if TYPE_CHECKING:
    from laminar.workers.launcher_ray import RayLauncher

log = get_logger(__name__)


def check_launcher(kind: str, ray_address: str | None) -> None:
    """Fail before anything starts: an unknown launcher, an address without Ray, Ray not installed."""
    if kind not in ("local", "ray"):
        raise ConfigError(f"--launcher={kind!r} is not one of local, ray")
    if kind == "local" and ray_address:
        raise ConfigError(f"--ray-address={ray_address!r} needs --launcher ray")
    if kind == "ray":
        from laminar.workers.launcher_ray import import_ray

        import_ray()


def check_binds(settings: Settings, relay_host: str | None) -> None:
    """Refuse up front, before any process starts, to run relays (at relay_host; None: they get a run token) or
    metrics endpoints off loopback without their secret (laminar/listeners.py)."""
    from laminar.listeners import check_bind
    from laminar.metrics import METRICS_RISK
    from laminar.relay.auth import RELAY_RISK

    if relay_host is not None:
        check_bind("the weight relay", relay_host, secret=settings.relay_token, variable="LAMINAR_RELAY_TOKEN",
                   insecure=settings.insecure, risk=RELAY_RISK)
    check_bind("the metrics endpoint", settings.metrics_bind, secret=settings.metrics_token,
               variable="LAMINAR_METRICS_TOKEN", insecure=settings.insecure, risk=METRICS_RISK)


def check_run(cfg: RunConfig, settings: Settings) -> None:
    """What `laminar run` and `laminar start` both check before a run starts (ConfigError, exit 2): a model.path
    that is missing or unreadable, a task that cannot be named, read or built with its params, and metrics
    endpoints off loopback without their secret (a run's relays get a run token)."""
    from laminar.envs.tasks.loader import check_task
    from laminar.services.model_files import check_model_path

    check_model_path(cfg)
    check_task(cfg.task)
    check_binds(settings, None)
    warn_large_payloads(cfg)


def ensure_model(cfg: RunConfig, console: Console) -> bool:
    """`model.gguf` set and no model directory at `model.path`: import the GGUF file there first (rl/gguf_import.py,
    what `laminar model import-gguf --out <model.path>` does), printing its progress. True when it imported."""
    if not cfg.model.gguf or not cfg.model.path:
        return False
    from laminar.rl.gguf_import import SMOLLM2, import_gguf, is_complete

    out = Path(cfg.model.path)
    if is_complete(out):
        return False
    source = None if cfg.model.gguf == SMOLLM2 else Path(cfg.model.gguf)
    console.print(f"model.path={cfg.model.path} is missing: importing model.gguf={cfg.model.gguf} there "
                  "(laminar model import-gguf, once)", highlight=False, soft_wrap=True)
    import_gguf(out, source, progress=lambda line: console.print(f"import: {line}", highlight=False, soft_wrap=True))
    return True


def warn_large_payloads(cfg: RunConfig) -> int:
    """Warn (not refuse: the config's own check refuses what cannot fit) when the batches a train step's input
    carries may pass the server's 256 KB warning: replicas that report groups one by one, with a long
    checkpoint interval. Returns that worst-case size."""
    t = cfg.trainer
    most = retained_batches_bytes(t.keep_last, t.checkpoint_every, t.groups_per_step)
    if most > PAYLOAD_WARNED_BYTES:
        log.warning("large_train_step_payloads", bytes_at_most=most, warned_above=PAYLOAD_WARNED_BYTES,
                    checkpoint_every=t.checkpoint_every, keep_last=t.keep_last,
                    groups_per_step=t.groups_per_step,
                    fix="a shorter trainer.checkpoint_every or trainer.keep_last keeps each step's input small")
    return most


def make_launcher(kind: str, cfg: RunConfig, settings: Settings, tag: str, ray_address: str | None = None,
                  allow_faults: bool = False) -> LocalLauncher | RayLauncher:
    """`local` (the default: child processes under a supervisor) or `ray` (workers/launcher_ray.py; imports Ray),
    for the processes of plan_processes; their logs go to $LAMINAR_HOME/logs/<tag>/."""
    check_launcher(kind, ray_address)
    procs = plan_processes(cfg, settings, settings.home / "logs" / tag, spare_slots=_spare_slots(cfg),
                           allow_faults=allow_faults, metrics=True)
    if kind == "local":
        return LocalLauncher(procs)
    from laminar.workers.launcher_ray import RayLauncher, plan_placements

    # On a cluster, relays listen on their node's IP unless LAMINAR_RELAY_BIND says otherwise.
    bind_node_ip = bool(ray_address) and not os.environ.get("LAMINAR_RELAY_BIND", "").strip()
    return RayLauncher(procs, plan_placements(cfg, procs, bind_node_ip), tag, ray_address)


def _spare_slots(cfg: RunConfig) -> int:
    """Spare replica slots per rollout worker: 1 (takes over a dead worker's replica), 0 for an engine a process
    holds one of (rl.factory.ENGINE_TRAITS)."""
    from laminar.rl.factory import engine_traits

    return engine_traits(cfg).spare_slots


def run_local(cfg: RunConfig, summary_path: Path | None, console: Console, report_dir: Path | None = None,
              launcher_kind: str = "local", ray_address: str | None = None) -> int:
    if not cfg.run.run_id:
        cfg = cfg.with_run_id(new_run_id())
    console.print(f"run_id={cfg.run.run_id}", highlight=False)
    home = Settings.from_env().home
    stack = DevStack(home)
    temporal_pid, started_stack = None, False
    if os.environ.get("LAMINAR_TEMPORAL_ADDRESS", "").strip():  # a Temporal of the user's own: no dev stack
        ui_url = None
    else:
        info, started_stack = stack.ensure_up()
        temporal_pid, ui_url = info.temporal_pid, info.ui_url
    settings = Settings.from_env().with_relay_token()  # dev.json now names the endpoints
    console.print(f"temporal={settings.temporal_address} ui={ui_url or '-'} store={settings.store_url}",
                  highlight=False)
    stop_like_ctrl_c()
    launcher = make_launcher(launcher_kind, cfg, settings, cfg.run.run_id, ray_address, allow_faults=True)
    if isinstance(launcher, LocalLauncher):  # the process table `laminar chaos` reads (docs/architecture/failures.md)
        launcher.table_path = process_table_path(home, cfg.run.run_id)
    for p in launcher.processes.values():
        console.print(f"metrics {p.name} {metrics_url(p)}", highlight=False, soft_wrap=True)
    try:
        code = asyncio.run(_drive(cfg, settings, launcher, summary_path, console, temporal_pid))
        if code == 0 and report_dir is not None:
            from laminar.cli.report import write_report

            write_report(store_for(settings), cfg.run.run_id, report_dir, console)
        return code
    except KeyboardInterrupt:
        console.print("interrupted: stopping the run and every process this command started")
        return 130
    finally:
        launcher.stop_all()
        if started_stack:
            stack.down()


def serve_workers(cfg: RunConfig, console: Console, launcher_kind: str = "local", ray_address: str | None = None,
                  allow_faults: bool = False) -> int:
    """`laminar workers`: the worker processes `laminar run` would start for this config (relay.relays hosts,
    rollout.replicas), against the LAMINAR_* settings, until Ctrl-C or SIGTERM. Runs are started separately
    (`laminar start`, `temporal workflow start`); the processes' logs go to $LAMINAR_HOME/logs/workers/."""
    settings = Settings.from_env()
    stop_like_ctrl_c()
    launcher = make_launcher(launcher_kind, cfg, settings, "workers", ray_address, allow_faults)
    console.print(f"temporal={settings.temporal_address} store={settings.store_url} launcher={launcher_kind}",
                  highlight=False)
    report = worker_set_slots(cfg, settings.home)
    try:
        launcher.start_all()
        launcher.start_supervision()
        for p in launcher.processes.values():
            console.print(f"worker {p.name} metrics {metrics_url(p)} log {p.log_path}", highlight=False,
                          soft_wrap=True)
        pool = asyncio.run(report_slots(settings, report))  # runs of `laminar start` share these slots through it
        console.print(f"slot pool {pool}: {report.slots} rollout slots ({', '.join(report.engines)})",
                      highlight=False)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        console.print("stopping the workers")
        return 0
    finally:
        _withdraw_slots(settings, report)
        launcher.stop_all()


def worker_set_slots(cfg: RunConfig, home: Path) -> SlotReport:
    """What a `laminar workers` set gives its slot pool: its rollout slots (spares included: docs/decisions/spare-slots.md) and
    engines, under a name stable for this host and home, so a restarted set replaces its own report."""
    from laminar.rl.factory import engines_served

    slots = sum(rollout_slots(cfg.rollout.replicas, cfg.relay.relays, _spare_slots(cfg)))
    return SlotReport(reporter=f"{socket.gethostname()}:{home}", slots=slots, engines=engines_served(cfg))


def _withdraw_slots(settings: Settings, report: SlotReport) -> None:
    """On the way out: the pool stops granting these slots (best effort; a set that cannot say so is replaced by
    its next start, which reports under the same name)."""
    try:
        asyncio.run(asyncio.wait_for(report_slots(settings, SlotReport(report.reporter, 0, report.engines)), 10.0))
    except (LaminarError, OSError, RuntimeError, TimeoutError) as e:
        log.warning("slots_not_withdrawn", reporter=report.reporter, error=str(e))


async def _drive(cfg: RunConfig, settings: Settings, launcher: LocalLauncher | RayLauncher, summary_path: Path | None,
                 console: Console, temporal_pid: int | None = None) -> int:
    store = store_for(settings)
    client = await connect(settings, core_logs=False)
    t0 = time.time()
    handle, attached = await start_or_attach(client, store, cfg)  # a taken run id fails before any process starts
    if attached:
        console.print(f"run {cfg.run.run_id} is already running: attached to it (the run keeps the config it "
                      "started with; this one only sizes the worker processes)", highlight=False)
    try:
        launcher.start_all()
    except Exception:  # e.g. Ray cannot place the workers: a run started here must not wait for them forever
        if not attached:
            await handle.terminate(reason="its worker processes could not be started")
        raise
    launcher.start_supervision()
    try:
        final = await _watch(handle, cfg, console, store, launcher)  # interrupted: the run is cancelled, never left behind
    except WorkflowFailureError as e:
        console.print(f"[red]run failed:[/red] {e.cause or e}")
        return 1
    except RunLostError:  # the server's database was reset or replaced under the run
        raise lost_error(store, settings, cfg.run.run_id, "while `laminar run` watched it") from None
    wall_s = time.time() - t0
    cpu_s = launcher.cpu_seconds()  # before stop_all: the processes are still alive
    if temporal_pid is not None and (temporal_cpu := process_cpu_s(temporal_pid)) is not None:
        cpu_s["temporal (since dev up)"] = temporal_cpu
    profile = build_profile(store, cfg.run.run_id, cpu_s)
    summary = {"mode": cfg.run.mode, **build_summary(final, store, wall_s, started_at=t0, profile=profile),
               "events": [asdict(e) for e in final.events]}  # the run's last events, for `laminar report`
    store.put(keys.summary(cfg.run.run_id), json.dumps(summary, indent=2).encode())
    if summary_path is not None:
        summary_path.parent.mkdir(parents=True, exist_ok=True)
        summary_path.write_text(json.dumps(summary, indent=2))
    _print_summary(summary, console)
    console.print(format_profile(profile), highlight=False, soft_wrap=True)
    return 0


async def _watch(handle: WorkflowHandle, cfg: RunConfig, console: Console, store: ObjectStore,
                 launcher: LocalLauncher | RayLauncher | None = None) -> RunStatus:
    """Show the run's progress without a workflow query while waiting: its phase, reward and policy version from
    the server's describe (the search attributes, upserted at most every 5 s), the steps from the trainer's step
    records in the store (read as each appears); follow `laminar scale` through its record in the store."""
    columns = [TextColumn("[bold]step"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn()]
    seen: dict[str, Any] = {"step": 0, "record": None}  # the newest step whose record was read, and that record
    with Progress(*columns, console=console, transient=False) as bar:
        task = bar.add_task("train", total=cfg.run.steps, info="starting workers")

        def show(p: RunProgress | None, note: str) -> None:
            if launcher is not None and (targets := scale_targets(store, cfg.run.run_id)) is not None:
                # `laminar scale`: a relay per host (a host beyond the count gets the notice), then rollout workers
                # for the slots the replicas need on those hosts
                replicas, relays = targets[0], targets[1] or cfg.relay.relays
                started, stopped = launcher.match_relays(relays)
                for name in started:
                    console.print(f"scale: started {name} for {relays} relays", highlight=False)
                for name in stopped:
                    console.print(f"scale: gave {name} the notice ({relays} relays)", highlight=False)
                for name in launcher.match_replicas(replicas, relays, _spare_slots(cfg)):
                    console.print(f"scale: started {name} for {replicas} replicas", highlight=False)
            if p is not None:
                _newer_steps(store, cfg, seen, p.step or 0)
            bar.update(task, info=note or _progress_line(p, seen["record"]), completed=seen["step"])

        final = await watch_run(handle, show, on_cancel_failed=lambda e: console.print(
            f"could not cancel run {cfg.run.run_id} ({e}); it is still running: `laminar run --run-id {cfg.run.run_id}` "
            f"attaches to it again, `laminar stop --force {cfg.run.run_id}` ends it", highlight=False))
        reward = f"{final.reward_recent[-1]:.3f}" if final.reward_recent else "-"
        bar.update(task, completed=final.step, info=f"{final.phase} reward={reward} version={final.policy_version}")
        return final


STEP_RECORDS_PER_LOOK = 50  # step records read at most per look (a watcher that fell behind catches up over looks)


def _newer_steps(store: ObjectStore, cfg: RunConfig, seen: dict[str, Any], attr_step: int) -> None:
    """Advance `seen` to the newest committed step whose trainer record is in the store: from the search
    attributes' step (which lags by up to 5 s), one read per step after it, and one read of the next that is not
    there yet."""
    step = max(seen["step"], attr_step)
    for _ in range(STEP_RECORDS_PER_LOOK):
        if step >= cfg.run.steps or (record := _step_record(store, cfg.run.run_id, step + 1)) is None:
            break
        step, seen["record"] = step + 1, record
    if step > seen["step"] and (seen["record"] is None or seen["record"].get("step") != step):
        seen["record"] = _step_record(store, cfg.run.run_id, step)  # the attributes ran ahead of the reads
    seen["step"] = step


def _step_record(store: ObjectStore, run_id: str, step: int) -> dict | None:
    """The trainer's record of a committed step (services/trainer.py), or None while the store does not have it."""
    try:
        return json.loads(store.get(keys.step_metrics(run_id, step)))
    except (StoreError, ValueError):
        return None


def _progress_line(p: RunProgress | None, record: dict | None) -> str:
    """The line under the bar: the run's phase (its search attributes), and the newest step's reward, tokens,
    policy versions and staleness (the trainer's record of it; before the first, the attributes' reward and
    policy version). `laminar status` shows everything."""
    if p is None:
        return ""
    if not p.phase:  # started without search attributes (the namespace lacks them: `laminar dev up` registers them)
        return f"{p.execution.lower()} history={p.history_events} (`laminar status` for the details)"
    if record is None:
        reward = f"{p.reward:.3f}" if p.reward is not None else "-"
        return f"{p.phase} reward={reward} version={p.policy_version if p.policy_version is not None else '-'}"
    gaps = {int(k): v for k, v in record.get("staleness", {}).items()}
    n = sum(gaps.values())
    mean_gap = sum(k * v for k, v in gaps.items()) / n if n else 0.0
    return (f"{p.phase} reward={record.get('reward_mean', 0.0):.3f} tokens/step={record.get('tokens', 0)} "
            f"versions={len(record.get('policy_versions', []))} staleness={mean_gap:.2f}")


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
    if s.get("tool_latency_s", {}).get("calls"):  # multi-turn tool calls (envs/tools/__init__.py)
        lat = s["tool_latency_s"]
        console.print(f"tool_calls/trajectory={s['tool_calls_per_trajectory']} multi_turn_share={s['multi_turn_share']} "
                      f"tool_latency_s p50={lat['p50']} max={lat['max']} calls={lat['calls']}", highlight=False)

