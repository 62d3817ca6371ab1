"""The `laminar` command line: one Typer app (`cli.main:app`, the `laminar` entry point `cli.main:main`).

Every command is registered here, on this app: the run commands below with `@app.command`, the other modules'
commands with `app.command(...)(function)`, and the command groups (`dev`, `bench`, `model`) with `app.add_typer`.

    run, fork, start, status, report, list, stop, scale, drain, pool, pause, resume, drill, workers, worker
    init (cli/init.py), eval (cli/eval.py), chaos (cli/chaos.py), simulate and plan (cli/sim.py)
    dev up|down|status (cli/dev.py), bench relay|heartbeats|overhead|throughput (cli/bench.py),
    model import-gguf (cli/model.py)

Durations are written one way (cli/options.py): `30s`, `5m`, `1h`, or plain seconds.
Exit codes: 0 success, 1 the run or a command failed, 2 invalid input (config, settings).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import typer
from rich.console import Console

from laminar import contract
from laminar.cli.bench import bench_app
from laminar.cli.chaos import chaos_command
from laminar.cli.dev import dev_app
from laminar.cli.eval import eval_command
from laminar.cli.init import init_command
from laminar.cli.model import model_app
from laminar.cli.options import (
    CONFIG_HELP,
    DURATION_HELP,
    EXTRA_ARGS,
    config_and_overrides,
    duration,
    exit_codes,
    old_seconds_option,
)
from laminar.cli.sim import plan_command, simulate_command
from laminar.client.settings import Settings
from laminar.config import RunConfig
from laminar.errors import ConfigError
from laminar.logs import configure_logging
from laminar.rl.factory import check_engines
from laminar.workers.rollout_slots import SPARE_WAIT_S

app = typer.Typer(
    help="Laminar on Temporal: fault-tolerant asynchronous RL post-training.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
app.add_typer(dev_app, name="dev", help="The embedded dev stack: Temporal dev server (+ optional S3 server).")
app.add_typer(bench_app, name="bench", help="Systems benchmarks: relay broadcast, heartbeat cost, orchestration "
              "overhead, throughput of every run mode.")
app.add_typer(model_app, name="model", help="Pretrained models: import a GGUF file as a model directory.")
console = Console()


def _load_config(config: Path | None, overrides: list[str], steps: int | None, run_id: str | None) -> RunConfig:
    path, extra = config_and_overrides(config, overrides)
    if steps is not None:
        extra.append(f"run.steps={steps}")
    cfg = check_engines(RunConfig.load(path, extra))  # the engines fit together (rl.factory)
    return cfg.with_run_id(run_id) if run_id else cfg


INSECURE_HELP = ("Accept a relay or metrics endpoint off loopback without its secret (LAMINAR_RELAY_TOKEN, "
                 "LAMINAR_METRICS_TOKEN); logged as a warning. Same as LAMINAR_INSECURE=1.")


def _accept_insecure(insecure: bool) -> None:
    """--insecure: set LAMINAR_INSECURE=1 here, so Settings and every child process see it."""
    if insecure:
        os.environ["LAMINAR_INSECURE"] = "1"


@app.command(context_settings=EXTRA_ARGS)
def run(
    ctx: typer.Context,
    config: Path | None = typer.Argument(None, help=CONFIG_HELP, show_default=False),
    steps: int | None = typer.Option(None, help="Override run.steps."),
    run_id: str | None = typer.Option(None, "--run-id", help="Run id (default: generated)."),
    summary: Path | None = typer.Option(None, help="Write the run summary JSON here."),
    log_format: str = typer.Option("console", "--log-format", help="console | json"),
    report: Path | None = typer.Option(None, "--report", help="At the end, write `laminar report` (plots, HTML) here."),
    launcher: str = typer.Option("local", "--launcher", help="local (child processes) | ray (Ray actors)."),
    ray_address: str | None = typer.Option(None, "--ray-address", help="Ray cluster to use (default: a local Ray)."),
    insecure: bool = typer.Option(False, "--insecure", help=INSECURE_HELP),
) -> None:
    """Run a config end to end on this machine (default: the packaged tiny config): dev stack, workers, workflow,
    live progress, summary.

    Extra `--section.key=value` arguments override config values.
    """
    from laminar.cli.run import check_launcher, check_run, ensure_model, run_local

    with exit_codes():
        _accept_insecure(insecure)
        check_launcher(launcher, ray_address)
        cfg = _load_config(config, ctx.args, steps, run_id)
        ensure_model(cfg, console)  # model.gguf: the model directory imported when missing
        check_run(cfg, Settings.from_env())  # model path, task, listener binds: before anything starts
        configure_logging(log_format)
        if report is not None:
            from laminar.reporting.report import check_matplotlib

            check_matplotlib()  # fail before the run, not after it
        code = run_local(cfg, summary_path=summary, console=console, report_dir=report, launcher_kind=launcher,
                         ray_address=ray_address)
    raise typer.Exit(code)


@app.command(context_settings=EXTRA_ARGS)
def fork(
    ctx: typer.Context,
    parent: str = typer.Argument(..., help="The run to continue: its config and checkpoints are read from the store."),
    run_id: str | None = typer.Option(None, "--run-id", help="The new run's id (default: <parent>-fork-s<step>)."),
    steps: int | None = typer.Option(None, help="Steps to run (default: the parent's steps left after its checkpoint)."),
    summary: Path | None = typer.Option(None, help="Write the run summary JSON here."),
    log_format: str = typer.Option("console", "--log-format", help="console | json"),
    insecure: bool = typer.Option(False, "--insecure", help=INSECURE_HELP),
) -> None:
    """Start a new run from the newest committed checkpoint of another, as `laminar run` does (dev stack, workers,
    progress, summary). The way on when Temporal lost a run's state (its database was reset or replaced): the new
    run has a new id, records its parent (run.parent, run.parent_step, runs/<id>/run.json) and writes nothing of
    the parent's. Extra `--section.key=value` arguments override the parent's config; the result is checked as
    `laminar run` checks a config (model path, task, listener binds)."""
    from laminar.cli.run import check_binds, check_run, run_local
    from laminar.client.connect import store_for
    from laminar.client.fork import fork_config

    with exit_codes():
        _accept_insecure(insecure)
        settings = Settings.from_env()
        check_binds(settings, None)
        cfg = fork_config(store_for(settings), parent, run_id, list(ctx.args), steps)
        check_run(cfg, settings)  # the same checks as `laminar run` (model path, task) on the forked config
        console.print(f"fork of run {parent} from its checkpoint at step {cfg.run.parent_step}: new run "
                      f"{cfg.run.run_id}, {cfg.run.steps} steps", highlight=False)
        configure_logging(log_format)
        code = run_local(cfg, summary_path=summary, console=console)
    raise typer.Exit(code)


@app.command(context_settings=EXTRA_ARGS)
def start(
    ctx: typer.Context,
    config: Path | None = typer.Argument(None, help=CONFIG_HELP, show_default=False),
    steps: int | None = typer.Option(None, help="Override run.steps."),
    run_id: str | None = typer.Option(None, "--run-id", help="Run id (default: generated)."),
    insecure: bool = typer.Option(False, "--insecure", help=INSECURE_HELP),
) -> None:
    """Start a run on running workers (`laminar workers`); prints the run id. The config is checked as `laminar run`
    checks it (model path, task, listener binds) before the run starts.

    Extra `--section.key=value` arguments override config values."""
    from laminar.cli.run import check_run
    from laminar.client.run_control import start_run

    with exit_codes():
        _accept_insecure(insecure)
        cfg = _load_config(config, ctx.args, steps, run_id)
        settings = Settings.from_env()
        check_run(cfg, settings)  # the same checks as `laminar run`, before the run starts
        rid = asyncio.run(start_run(settings, cfg))
    console.print(f"run_id={rid}", highlight=False)


@app.command()
def status(run_id: str, as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Show a run's status (the workflow's `status` query)."""
    from laminar.client.run_control import query_status, render_status

    with exit_codes():
        st = asyncio.run(query_status(Settings.from_env(), run_id))
    if as_json:
        from laminar.watchdog import stall_line

        console.print_json(json.dumps({**asdict(st), "watchdog": stall_line(st, time.time())}))
    else:
        console.print(render_status(st))


@app.command()
def report(
    run_id: str = typer.Argument(..., help="The run to report on (finished or running)."),
    out: Path | None = typer.Option(None, "--out", help="Directory for the PNGs and report.html (default reports/<run>)."),
) -> None:
    """Plots and one self-contained HTML page of a run, from its records in the object store."""
    from laminar.cli.report import report as write

    with exit_codes():
        write(run_id, out, console)


@app.command(name="list")
def list_runs(
    query: str = typer.Option("", "--query", help="Extra visibility filter, e.g. \"LaminarPhase='running'\"."),
    limit: int = typer.Option(20, help="Show at most this many runs, newest first."),
) -> None:
    """List runs (TrainingRunWorkflow executions) with their mode, phase, step, policy version and reward."""
    from laminar.cli.report import list_command

    with exit_codes():
        list_command(query, limit, console)


@app.command()
def stop(
    run_id: str,
    force: bool = typer.Option(
        False, "--force", help="Terminate the workflow at once (no control worker needed; nothing is summarised)."
    ),
) -> None:
    """Ask a run to stop: replicas finish, the trainer stops, the workflow completes."""
    from laminar.client.run_control import stop_run, terminate_run

    with exit_codes():
        if force:
            asyncio.run(terminate_run(Settings.from_env(), run_id))
            phase = "terminated"
        else:
            phase = asyncio.run(stop_run(Settings.from_env(), run_id))
    console.print(f"run_id={run_id} phase={phase}", highlight=False)


@app.command()
def scale(
    run_id: str,
    replicas: int | None = typer.Option(None, "--replicas", help="The rollout replica count the run should have "
                                        "(1-1024); unset: unchanged."),
    relays: int | None = typer.Option(None, "--relays", help="The relay count (one per host, host-<i>; 1-1024); "
                                      "unset: unchanged."),
) -> None:
    """Scale a live run: new replicas start on free rollout slots (or on rollout workers that join later, on any
    host); removed ones stop admitting, hand their unfinished groups to a replica of the same version (or back to
    the pool with their prefixes) and return. A new host's relay joins the chain once its relay worker runs
    (`laminar run` starts it); a removed relay leaves the chain at once."""
    from laminar.client.run_control import scale_run

    with exit_codes():
        res = asyncio.run(scale_run(Settings.from_env(), run_id, replicas, relays))
    console.print(f"run_id={run_id} replicas_target={res.replicas_target} started={','.join(res.started) or '-'} "
                  f"removed={','.join(res.removed) or '-'} relays_target={res.relays_target} "
                  f"relays_started={','.join(res.relays_started) or '-'} "
                  f"relays_removed={','.join(res.relays_removed) or '-'}", highlight=False)


@app.command()
def drain(
    worker: str = typer.Argument(..., help="The worker to drain: control, trainer, relay-<host> or rollout-<host>."),
    timeout: str | None = typer.Option(None, "--timeout", help=f"How long to wait for it to leave ({DURATION_HELP}; "
                                       "default: the notice, LAMINAR_NOTICE_S, plus 10 s)."),
    wait_s: float | None = old_seconds_option("--wait"),
) -> None:
    """Give a worker the notice, as a preemption warning would: it takes no new work, its activities leave cleanly
    (replicas hand their groups to others, the trainer checkpoints, a relay leaves the chain) and it exits 0."""
    from laminar.workers.drain import drain as drain_worker

    with exit_codes():
        settings = Settings.from_env()
        wait = duration(timeout, "--timeout", wait_s, "--wait")
        out = drain_worker(settings.home, worker, wait if wait is not None else settings.notice_s + 10)
    for d in out:
        left = f"left in {d.left_s:.1f} s" if d.left_s is not None else "still running"
        console.print(f"worker={d.name} pid={d.pid} {left}", highlight=False)
    if any(d.left_s is None for d in out):
        raise typer.Exit(1)


@app.command()
def pool(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Show the slot pool of the shared worker set: its rollout slots, and each `laminar start` run's ask, quota,
    grant and why it got less."""
    from laminar.client.run_control import query_pool, render_pool

    with exit_codes():
        p = asyncio.run(query_pool(Settings.from_env()))
    if as_json:
        console.print_json(json.dumps(asdict(p)))
    else:
        console.print(render_pool(p))


@app.command()
def pause(run_id: str) -> None:
    """Pause a run: no new prompts are leased and the trainer waits."""
    from laminar.client.run_control import send_control

    with exit_codes():
        phase = asyncio.run(send_control(Settings.from_env(), run_id, contract.PAUSE))
    console.print(f"run_id={run_id} phase={phase}", highlight=False)


@app.command()
def resume(run_id: str) -> None:
    """Resume a paused run."""
    from laminar.client.run_control import send_control

    with exit_codes():
        phase = asyncio.run(send_control(Settings.from_env(), run_id, contract.RESUME))
    console.print(f"run_id={run_id} phase={phase}", highlight=False)


@app.command()
def drill(
    run_id: str = typer.Argument(..., help="The live run to inject the fault into."),
    fault: str = typer.Option(..., help="rollout | relay | master-relay | trainer | control | store | preempt "
                              "(preempt: the notice, SIGTERM, instead of SIGKILL)"),
    target: str = typer.Option("", help="Replica id (rollout) or relay id (relay); default: picked. preempt: "
                               "rollout | relay | trainer, optionally :ID (rollout:replica-1)."),
    at_step: int = typer.Option(0, "--at-step", help="Inject once the run has completed this many steps."),
    report: Path | None = typer.Option(None, help="Also write the report here as JSON."),
    timeout: str | None = typer.Option(None, "--timeout", help=f"Give up waiting for recovery after this long "
                                       f"({DURATION_HELP}).", show_default="5m"),
    outage: str | None = typer.Option(None, "--outage", help=f"store: how long the S3 server stays down "
                                      f"({DURATION_HELP}).", show_default="3s"),
    timeout_s: float | None = old_seconds_option("--timeout-s"),
    outage_s: float | None = old_seconds_option("--outage-s"),
    during: str = typer.Option("", help="migration: wait for a pending repack migration and inject then (a rollout "
                               "fault goes to its source replica's process)."),
) -> None:
    """Inject a failure into a live run, watch it recover, report (also stored under runs/<id>/drills/)."""
    from laminar.contract import DrillInput
    from laminar.drills.command import render_report, run_drill

    with exit_codes():
        settings = Settings.from_env()
        configure_logging(settings.log_format, "warning")
        inp = DrillInput(run_id=run_id, drill_id="", fault=fault, target=target, at_step=at_step,
                         timeout_s=duration(timeout, "--timeout", timeout_s, "--timeout-s", default="5m"),
                         outage_s=duration(outage, "--outage", outage_s, "--outage-s", default="3s"), during=during)
        result = asyncio.run(run_drill(settings, inp, report))
    console.print(render_report(result))
    if not result.recovered or result.groups_lost or result.groups_consumed_twice:
        raise typer.Exit(1)


@app.command(context_settings=EXTRA_ARGS)
def workers(
    ctx: typer.Context,
    config: Path | None = typer.Argument(None, help="Config that sizes the workers (hosts, replicas); default: the "
                                         "packaged tiny config.", show_default=False),
    launcher: str = typer.Option("local", "--launcher", help="local (child processes) | ray (Ray actors)."),
    ray_address: str | None = typer.Option(None, "--ray-address", help="Ray cluster to use (default: a local Ray)."),
    allow_faults: bool = typer.Option(False, "--allow-faults", help="Every process accepts recovery-drill faults."),
    insecure: bool = typer.Option(False, "--insecure", help=INSECURE_HELP),
) -> None:
    """Start every worker process a config needs and keep them until Ctrl-C (start runs with `laminar start`)."""
    from laminar.cli.run import check_binds, serve_workers

    with exit_codes():
        _accept_insecure(insecure)
        cfg = _load_config(config, ctx.args, None, None)
        settings = Settings.from_env()
        configure_logging(settings.log_format)
        on_node_ip = launcher == "ray" and ray_address and not os.environ.get("LAMINAR_RELAY_BIND", "").strip()
        check_binds(settings, "the Ray node's address" if on_node_ip else settings.relay_bind)
        code = serve_workers(cfg, console, launcher, ray_address, allow_faults)
    raise typer.Exit(code)


@app.command()
def worker(
    role: str = typer.Argument(..., help="control | trainer | rollout | relay"),
    slots: int = typer.Option(1, help="Rollout replicas this worker runs at once (rollout only)."),
    spare: int = typer.Option(0, help="Of --slots, those kept for a replica whose worker died: taken for a new "
                                      f"replica only after {SPARE_WAIT_S:g} s without one (rollout only), so new "
                                      "replicas spread over the workers first."),
    allow_faults: bool = typer.Option(
        False, "--allow-faults", help="Accept recovery-drill faults on this process's own fault queue."
    ),
    insecure: bool = typer.Option(False, "--insecure", help=INSECURE_HELP),
) -> None:
    """Run one worker process against any Temporal address and store (LAMINAR_* settings)."""
    import signal

    # A notice (SIGTERM/SIGINT: a preemption, a drain) before the worker serves finds it holding no work: it leaves
    # at once and exits 0, as it would once serving (the worker's own handler replaces this one when it polls).
    # Without it, a notice while the worker imports or connects killed it (exit -15), unlike any other notice.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _leave_before_serving)
    from laminar.workers import processes

    with exit_codes():
        _accept_insecure(insecure)
        settings = Settings.from_env()
        if role not in processes.ROLES:
            raise ConfigError(f"worker role {role!r} is not one of {', '.join(processes.ROLES)}")
        if slots < 1:
            raise ConfigError(f"--slots={slots} must be at least 1")
        if not 0 <= spare < slots:
            raise ConfigError(f"--spare={spare} must be at least 0 and below --slots={slots} (a worker keeps one slot "
                              "or more for new replicas)")
        configure_logging(settings.log_format, settings.log_level)
        from laminar.metrics import serve

        process = role if role in ("control", "trainer") else f"{role}-{settings.host_id}"
        serve(settings.metrics_port, settings.metrics_bind, process, role, settings.host_id,
              token=settings.metrics_token, insecure=settings.insecure)
        main_fn = processes.ROLES[role]
        if role == "rollout":
            asyncio.run(main_fn(settings, allow_faults, slots, spare))
        else:
            asyncio.run(main_fn(settings, allow_faults))


def _leave_before_serving(signum: int, frame: object) -> None:
    import signal

    print(f"notice ({signal.Signals(signum).name}) before the worker serves: it holds no work; leaving",
          file=sys.stderr, flush=True)
    raise SystemExit(0)


# the commands of the other modules, after this module's own (the order of `laminar --help`)
app.command("init")(init_command)
app.command("eval", context_settings=EXTRA_ARGS)(eval_command)
app.command("chaos", context_settings=EXTRA_ARGS)(chaos_command)
app.command("simulate")(simulate_command)
app.command("plan")(plan_command)


def main() -> None:
    """Run the CLI, then leave without interpreter finalisation (client.exit.run_then_exit: the Temporal
    client's native runtime can abort a finalising interpreter, turning a finished command's status into a crash)."""
    from laminar.client.exit import run_then_exit

    run_then_exit(app)


if __name__ == "__main__":
    sys.exit(main())
