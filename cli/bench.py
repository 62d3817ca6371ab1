"""`laminar bench`: measurements that never run as timed tests (mounted as `bench` by cli/main.py).

    laminar bench relay --size 256MiB --relays 1,2,4,8 [--rate 1000] [--json out.json] [--plot out.png]
    laminar bench heartbeats --replicas 0,16,64 [--window 30s]
    laminar bench overhead [CONFIG] [--steps N] [--json PATH]
    laminar bench throughput --modes laminar,sync,one_step,stream,partial_rollout --replicas 8
        [--engine modelled|torch] [--workload long_tail|uniform|tools|both|all] [--iterations N] [--json PATH] [--plot PATH]
    laminar bench control (--sim SIM.json ... [--scale 1,2,4] | --replicas 80 --groups-per-s 10 [--slots 64])
        [--duration 60s] [--warmup 10s] [--updates-per-segment N] [--port N] [--json PATH]
"""

from __future__ import annotations

import json
import os
import typing
from collections.abc import Callable
from pathlib import Path

import typer
from pydantic import ByteSize, TypeAdapter, ValidationError
from rich.console import Console
from rich.table import Table

from laminar.cli.options import DURATION_HELP, EXTRA_ARGS, config_and_overrides, duration, old_seconds_option
from laminar.errors import ConfigError, LaminarError

bench_app = typer.Typer(help="Systems benchmarks: relay broadcast, heartbeat cost, orchestration overhead, "
                        "throughput of every run mode.", no_args_is_help=True, pretty_exceptions_show_locals=False)
console = Console()
err = Console(stderr=True)


@bench_app.callback()
def _bench() -> None:
    """Systems benchmarks, measured and printed (never asserted in tests): relay broadcast, heartbeat cost,
    orchestration overhead, throughput of every run mode."""

def parse_size(text: str) -> int:
    """'268435456', '256MiB', '1.5GB' -> bytes (pydantic's ByteSize: decimal and binary units)."""
    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise typer.BadParameter(f"{text!r} is not a size; use bytes or a unit: 256MiB, 1GB, 65536") from None


def parse_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1:
        raise typer.BadParameter(f"{text!r} is not a comma-separated list of relay counts >= 1, e.g. 1,2,4,8")
    return counts


@bench_app.command("relay")
def relay_bench(
    size: str = typer.Option("256MiB", help="Version size in bytes (units: KiB, MiB, GiB, KB, MB, GB)."),
    relays: str = typer.Option("1,2,4,8", help="Relay counts to measure, comma-separated."),
    rate: float | None = typer.Option(None, help="Link rate in Mbit/s: each node in its own network "
                                      "namespace behind a tc rate limit (needs root, iproute2). "
                                      "Without it: loopback."),
    chunk: str | None = typer.Option(None, help="Chunk size in bytes; default: the chain model's optimum "
                                     "for the measured link."),
    reps: int = typer.Option(5, min=1, help="Rounds of timed chain broadcasts, one per relay count in turn each round (median)."),
    storage: bool = typer.Option(True, help="Also measure the object-store baseline (moto_server)."),
    macs: bool = typer.Option(True, help="Run with a run token, so every frame and chunk carries HMAC-SHA256 "
                              "(as `laminar run` always does); --no-macs measures the relay without them."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the report as JSON here."),
    plot_path: Path | None = typer.Option(Path("relay-bench.png"), "--plot", help="Write a PNG plot here."),
) -> None:
    """Trainer stall, time to all relays, one hop, each-in-turn, object store and the chain model."""
    from laminar.bench.relay import BenchConfig, done_when, plot, run_bench

    cfg = BenchConfig(size=parse_size(size), relays=parse_counts(relays), rate_mbit=rate,
                      chunk_bytes=parse_size(chunk) if chunk else None, reps=reps, storage=storage,
                      macs=macs)
    try:
        report = run_bench(cfg, progress=lambda msg: err.print(f"[dim]{msg}[/dim]"))
    except LaminarError as exc:
        err.print(f"[red]relay benchmark failed:[/red] {exc}")
        raise typer.Exit(1) from None
    console.print(render_table(report))
    for what, value, bound, holds in done_when(report):
        console.print(f"{'ok  ' if holds else 'MISS'} {what} = {value:.2f} (want {bound})")
    _write_outputs(report, json_path, plot_path, lambda r, p: p.write_text(json.dumps(r, indent=2) + "\n"), plot)


def _write_outputs(report: dict, json_path: Path | None, plot_path: Path | None,
                   write_json: Callable[[dict, Path], object], draw: Callable[[dict, Path], None]) -> None:
    """A benchmark's --json and --plot files (a missing matplotlib skips the plot, with a hint)."""
    if json_path is not None:
        write_json(report, json_path)
        console.print(f"wrote {json_path}")
    if plot_path is not None:
        try:
            draw(report, plot_path)
            console.print(f"wrote {plot_path}")
        except ImportError:
            err.print("[yellow]matplotlib is not installed (pip install -e '.[bench]'); no plot written[/yellow]")


def render_table(report: dict) -> Table:
    link = report["link"]
    rate = f"{report['rate_mbit']:g} Mbit/s links" if report["rate_mbit"] else "loopback"
    table = Table(title=(f"relay broadcast of {report['size'] / 2**20:.0f} MiB, {rate} ({report['transport']}), "
                         f"MACs {'on' if report.get('macs', True) else 'off'}, {report['cpus']} CPUs; B = {link['bytes_per_s'] / 1e6:.1f} MB/s, "
                         f"t_start = {link['t_start_s'] * 1e6:.0f} us, memcpy = {report['memcpy_gbps']:.2f} GB/s, "
                         f"loopback TCP = {report['loopback_tcp_bytes_per_s'] / 1e6:.0f} MB/s"))
    for col in ("relays", "chunk", "stall s", "all relays s", "one hop s", "model s", "each in turn s",
                "object store s", "local pull GB/s", "forwarded MB/s", "relay CPU s/GiB", "master CPU s/GiB"):
        table.add_column(col, justify="right")
    for r in report["results"]:
        table.add_row(
            str(r["relays"]), f"{r['chunk_bytes'] / 2**10:.0f} KiB", f"{r['stall_s']:.3f}", f"{r['all_relays_s']:.3f}",
            f"{r['single_hop_s']:.3f}", f"{r['model_s']:.3f}", f"{r['sequential_s']:.3f}",
            "-" if r["storage_s"] is None else f"{r['storage_s']:.3f}",
            f"{r['local_pull_gbps']:.2f} ({r['local_pull_fraction_of_memcpy']:.0%})",
            f"{r['forward_bytes_per_s'] / 1e6:.0f}",
            (f"tail {r['tail_cpu_s_per_gib']:.2f}" if r["relay_cpu_s_per_gib"] is None
             else f"{r['relay_cpu_s_per_gib']:.2f} (max {r['relay_cpu_s_per_gib_max']:.2f})"),
            f"{r['master_cpu_s_per_gib']:.2f}",
        )
    return table


@bench_app.command("heartbeats")
def heartbeats_bench(
    replicas: str = typer.Option("0,16,64", help="Heartbeating activities to measure, comma-separated."),
    window: str | None = typer.Option(None, "--window", help=f"Measurement window per count ({DURATION_HELP}; at "
                                      "least 5s).", show_default="30s"),
    window_s: float | None = old_seconds_option("--window-s"),
) -> None:
    """What second-scale failure detection costs the Temporal server: heartbeat RPCs/s and server CPU."""
    import asyncio

    from laminar.bench.heartbeats import measure
    from laminar.client.exit import stop_like_ctrl_c

    try:
        seconds = duration(window, "--window", window_s, "--window-s", default="30s")
        if seconds < 5:
            raise ConfigError(f"--window {window or window_s}: measure at least 5s per count")
    except ConfigError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    stop_like_ctrl_c()  # SIGTERM too: its own dev server and workflow go with it

    table = Table("activities", "heartbeat RPCs/s", "server CPU %")
    for n in sorted({int(x) for x in replicas.split(",") if x.strip()}):
        row = asyncio.run(measure(n, seconds))
        table.add_row(str(n), str(row["heartbeat_rpcs_per_s"]), str(row["server_cpu_percent"]))
    console.print(table)


@bench_app.command("overhead", context_settings=EXTRA_ARGS)
def overhead_bench(
    ctx: typer.Context,
    config: Path | None = typer.Argument(None, help="Run config (TOML), used by both sides; default: the packaged "
                                         "tiny config.", show_default=False),
    steps: int | None = typer.Option(None, help="Override run.steps."),
    json_path: Path | None = typer.Option(None, "--json", help="Write {\"loop\": ..., \"laminar\": ...} here."),
) -> None:
    """The single-process loop, then `laminar run`, on the same config: wall time, tokens/s, time to reward,
    reward rise, ratios, and laminar's time breakdown. Extra `--section.key=value` arguments override both."""
    from laminar.bench.overhead import ratios, run_laminar, run_loop
    from laminar.client.exit import stop_like_ctrl_c

    stop_like_ctrl_c()  # SIGTERM too: its `laminar run` child and that run end with it
    from laminar.client.settings import Settings
    from laminar.config import RunConfig
    from laminar.reporting.summary import format_profile
    from laminar.rl.factory import check_engines

    config, overrides = config_and_overrides(config, ctx.args)
    overrides += [f"--run.steps={steps}"] if steps is not None else []
    try:
        cfg = check_engines(RunConfig.load(config, overrides))
        err.print("[dim]single-process loop ...[/dim]")
        loop = run_loop(cfg, Settings.from_env().home)
        err.print(f"[dim]loop: {loop}[/dim]")
        err.print("[dim]laminar run ...[/dim]")
        laminar = run_laminar(config, overrides)
    except LaminarError as exc:
        err.print(f"[red]overhead benchmark failed:[/red] {exc}")
        raise typer.Exit(1) from None
    r = ratios(loop, laminar)
    table = Table("", "single-process loop", "laminar run", "laminar / loop",
                  title=f"{config} ({loop['steps']} steps)")
    for key in ("wall_s", "tokens_per_s", "reward_rise", "time_to_reward_0_6_s", "time_to_reward_0_8_s",
                "groups_consumed_twice", "cpu_s"):
        table.add_row(key, str(loop.get(key)), str(laminar.get(key)), "" if r.get(key) is None else f"{r[key]}x")
    console.print(table)
    if laminar.get("profile"):
        console.print(format_profile(laminar["profile"]), highlight=False, soft_wrap=True)
    if json_path is not None:
        json_path.write_text(json.dumps({"loop": loop, "laminar": laminar, "ratios": r}, indent=2) + "\n")
        console.print(f"wrote {json_path}")


@bench_app.command("throughput", context_settings=EXTRA_ARGS)
def throughput_bench(
    ctx: typer.Context,
    modes: str = typer.Option("laminar,sync,one_step,stream,partial_rollout",
                              help="Run modes to compare, comma-separated, run one after another."),
    replicas: int = typer.Option(8, min=1, help="Rollout replicas; the global batch is replicas x 4 groups."),
    engine: str = typer.Option("modelled", help="modelled (GPU time from the run config's \\[modelled] "
                               "section) or torch."),
    workload: str = typer.Option("both", help="Workload of the modelled engine: long_tail, uniform, tools "
                                 "(multi-turn tool calling), both (long_tail,uniform: an honest benchmark shows the "
                                 "advantage shrink without a tail) or all three."),
    iterations: int | None = typer.Option(None, min=2, help="Global batches per run (default 8: laminar.bench.throughput."
                                          "DEFAULT_ITERATIONS); the first fifth (at least one) is a warm-up."),
    config: Path | None = typer.Option(None, help="Base run config (TOML); default: the built-in defaults."),
    json_path: Path | None = typer.Option(None, "--json", help="Write {\"results\": [...], \"config\": {...}} here."),
    plot_path: Path | None = typer.Option(None, "--plot", help="Write a PNG: throughput bars and per-run "
                                          "per-replica policy-version timelines."),
    repack: str = typer.Option("on", help="Dynamic repack in the laminar runs: on, off, or on,off (one laminar run "
                               "each; the other modes never repack)."),
) -> None:
    """Every mode on the same workload and seed on the real stack: tokens/s (paper definition, modelled time),
    KV use, trainer idle, weight-sync stall, staleness, trajectory latency, control-plane share. Extra
    `--section.key=value` arguments override every run's config."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from laminar.bench.throughput import (
        DEFAULT_ITERATIONS,
        MODES,
        WORKLOAD_SETS,
        WORKLOADS,
        BenchSpec,
        dump_json,
        plot,
        run_bench,
    )
    from laminar.config import Engine

    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    bad = [m for m in chosen if m not in MODES]
    if not chosen or bad:
        raise typer.BadParameter(f"--modes {modes!r}: {bad or 'empty'} not a run mode; pick from {','.join(MODES)}")
    if engine not in typing.get_args(Engine):
        raise typer.BadParameter(f"--engine {engine!r}: use {' or '.join(typing.get_args(Engine))}")
    if workload not in (*WORKLOADS, *WORKLOAD_SETS):
        raise typer.BadParameter(f"--workload {workload!r}: use {', '.join((*WORKLOADS, *WORKLOAD_SETS))}")
    settings_repack = [x.strip() for x in repack.split(",") if x.strip()]
    if not settings_repack or any(x not in ("on", "off") for x in settings_repack) or len(set(settings_repack)) < len(
            settings_repack):
        raise typer.BadParameter(f"--repack {repack!r}: use on, off, or on,off")
    spec = BenchSpec(modes=chosen, workloads=WORKLOAD_SETS.get(workload, (workload,)), replicas=replicas,
                     engine=engine, iterations=iterations or DEFAULT_ITERATIONS, config_path=config,
                     extra_overrides=tuple(ctx.args), repack=tuple(x == "on" for x in settings_repack))
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn()]
    with Progress(*columns, console=err, transient=False) as bar:
        tasks: dict[str, int] = {}
        shown: dict[str, int] = {}  # label -> last step printed as a line (when stderr is not a terminal)

        def progress(label: str, st, note: str) -> None:
            new_step = st is not None and shown.get(label) != st.step
            if not err.is_terminal and label != "dev stack" and (note or new_step):
                shown[label] = st.step if st is not None else shown.get(label, 0)
                total = f"/{st.total_steps}" if st is not None else ""
                err.print(f"{label}: step {shown[label]}{total} {note}", highlight=False)
            if label == "dev stack":
                bar.console.print(f"[dim]{note}[/dim]")
                return
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=spec.iterations, info="starting workers")
            if st is not None:
                kv = [r.kv_used / r.kv_capacity for r in st.replicas if r.kv_capacity]
                info = (f"{st.phase} ready={st.ready_groups} versions={st.versions_in_use} "
                        f"kv={sum(kv) / len(kv):.0%}" if kv else f"{st.phase} ready={st.ready_groups}")
                bar.update(tasks[label], total=st.total_steps, completed=st.step, info=note or info)
            elif note:
                bar.update(tasks[label], info=note)

        from laminar.client.exit import stop_like_ctrl_c

        stop_like_ctrl_c()  # SIGTERM too: its runs are ended, its workers stopped (bench/throughput.py)
        try:
            report = run_bench(spec, progress, launch_bench_workers)
        except (LaminarError, ValueError) as exc:
            err.print(f"[red]throughput benchmark failed:[/red] {exc}")
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err.print("interrupted: the benchmark's runs were ended and its workers stopped")
            raise typer.Exit(130) from None
    Console(width=max(console.width, 180)).print(render_throughput_table(report))  # 14 columns: never squeezed
    _write_outputs(report, json_path, plot_path, dump_json, plot)
    if any(r.get("error") for r in report["results"]):
        raise typer.Exit(1)


def launch_bench_workers(cfg, settings, log_dir: Path) -> Callable[[], None]:
    """Starts one throughput run's worker processes (laminar.bench.throughput.LaunchWorkers); returns what stops them."""
    from laminar.workers.launcher import LocalLauncher, plan_processes

    launcher = LocalLauncher(plan_processes(cfg, settings, log_dir, spare_slots=1))
    launcher.start_all()
    launcher.start_supervision()
    return launcher.stop_all


def render_throughput_table(report: dict) -> Table:
    from laminar.bench.throughput import COLUMNS, table_rows

    c = report["config"]
    unit = "modelled s" if c["time_scale"] != 1.0 else "wall s"
    table = Table(title=(f"throughput: {c['replicas']} replicas, {c['groups_per_step']} groups x {c['group_size']} "
                         f"samples per step, {c['iterations']} steps ({c['warmup_steps']} warm-up), {c['engine']} "
                         f"engine, times in {unit}, {c['cpus']} CPUs"))
    for _, header, _ in COLUMNS:
        table.add_column(header, justify="left" if header in ("mode", "workload") else "right")
    for row in table_rows(report):
        table.add_row(*row)
    return table


@bench_app.command("control")
def control_bench(
    sim: list[Path] = typer.Option([], "--sim", help="A `laminar simulate --json` report (repeatable): the heaviest "
                                   "cell of all their rows (most predicted updates/s) is run at each --scale."),
    scale: str = typer.Option("1,2,4", help="With --sim: multiples of the heaviest cell (replicas and groups/s)."),
    replicas: str | None = typer.Option(None, help="Without --sim: replica counts, comma-separated, one cell each."),
    groups_per_s: float | None = typer.Option(None, "--groups-per-s", help="Without --sim: groups finished per "
                                              "second by all replicas together, per cell (scaled with replicas "
                                              "from the first count)."),
    slots: int = typer.Option(64, min=1, help="Without --sim: groups in flight per replica."),
    step: str = typer.Option("0s", "--step", help=f"Without --sim: the stub trainer's time per step ({DURATION_HELP})."),
    groups_per_step: int = typer.Option(512, min=1, help="Without --sim: trainer.groups_per_step."),
    duration_opt: str = typer.Option("60s", "--duration", help=f"Measurement window per cell ({DURATION_HELP})."),
    warmup: str = typer.Option("10s", help=f"After every replica claimed, before the window ({DURATION_HELP})."),
    updates_per_segment: int | None = typer.Option(None, min=10, help="Override run.updates_per_segment "
                                                   "(default: the config's)."),
    port: int | None = typer.Option(None, help="The dev stack's Temporal port, if this command starts it "
                                    "(default: 7233 when free)."),
    dynamic_config: list[str] = typer.Option([], "--dynamic-config", help="KEY=VALUE (repeatable): run on a Temporal "
                                             "dev server of the bench's own, started as the dev stack's (SQLite, "
                                             "same flags) with these dynamic config values, e.g. "
                                             "history.maxInFlightUpdates=100."),
    seed: int = typer.Option(0, help="Seed of the lease hold times."),
    contact: str | None = typer.Option(None, "--contact", help="A what-if: the synthetic replicas contact the "
                                       f"workflow this often when busy ({DURATION_HELP}; default: the real "
                                       "replica's ReplicaTiming.contact_s)."),
    handover: str = typer.Option("keep", "--handover", help="At a continue-as-new, replicas `keep` their groups in "
                                 "flight and re-attach (run.handover_keep=true) or `write` them to their "
                                 "partial pools and start again (before/after)."),
    heartbeat_timeout: str | None = typer.Option(None, "--heartbeat-timeout", help="The replicas' "
                                                 f"rollout.heartbeat_timeout_s ({DURATION_HELP}; default: the "
                                                 "config's, 3 s); they heartbeat every quarter of it, at most once a "
                                                 "second and at least every 5 s."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the report as JSON here."),
) -> None:
    """What one run's workflow carries: the real TrainingRunWorkflow on the dev stack's Temporal server, R synthetic
    replicas (real updates, real cadence, no model) and a stub trainer; update latency per name, workflow task
    latency, CPU of server and control worker, history events/s, continue-as-new hand-overs, groups lost and
    consumed twice (docs/benchmarks/control.md)."""
    import asyncio

    from laminar.bench.control import BenchOptions, run_bench
    from laminar.bench.control_plan import Cell, cell_from_sim, done_when, heaviest
    from laminar.cli.options import parse_duration
    from laminar.client.exit import stop_like_ctrl_c
    from laminar.client.settings import Settings
    from laminar.devstack.stack import DevStack

    try:
        opts = BenchOptions(duration_s=parse_duration(duration_opt, "--duration"),
                            warmup_s=parse_duration(warmup, "--warmup", allow_zero=True),
                            updates_per_segment=updates_per_segment, seed=seed,
                            contact_s=None if contact is None else parse_duration(contact, "--contact"),
                            handover_keep=_handover_keep(handover),
                            heartbeat_timeout_s=None if heartbeat_timeout is None
                            else parse_duration(heartbeat_timeout, "--heartbeat-timeout"))
        step_s = parse_duration(step, "--step", allow_zero=True)
        if sim:
            from laminar.sim.params import WORKLOADS
            cells = []
            for path in sim:
                report = json.loads(path.read_text())
                w = WORKLOADS[report.get("config", {}).get("workload", "math")]
                cells += [cell_from_sim(r, w.prompts_per_batch, w.group_size, w.max_inflight_per_replica)
                          for r in report["rows"]]
            top = heaviest(cells)
            cells = [top.scaled(float(k)) for k in _csv_floats(scale, "--scale")]
        elif replicas and groups_per_s:
            counts = parse_counts(replicas)
            cells = [Cell(label=f"R={n}", replicas=n, groups_per_s=groups_per_s * n / counts[0], slots=slots,
                          groups_per_step=groups_per_step, step_s=step_s) for n in counts]
        else:
            raise ConfigError("give --sim SIM.json (from `laminar simulate --json`) or both --replicas and "
                              "--groups-per-s")
    except (ConfigError, ValueError, OSError, KeyError) as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    bad = [v for v in dynamic_config if "=" not in v or not v.split("=", 1)[0].strip()]
    if bad:
        err.print(f"[red]error:[/red] --dynamic-config {bad[0]!r}: give KEY=VALUE, e.g. history.maxInFlightUpdates=100")
        raise typer.Exit(2)
    stop_like_ctrl_c()  # SIGTERM too: its control worker and runs end with it
    from laminar.chaos.checker import check_accounting

    home = Settings.from_env().home
    stack, started, own = DevStack(home), False, None
    try:
        if dynamic_config:
            from laminar.bench.control import start_own_server, wait_for_server
            own, address = start_own_server(home, dynamic_config)
            asyncio.run(wait_for_server(address))
            settings, pid = Settings.from_env({**os.environ, "LAMINAR_TEMPORAL_ADDRESS": address}), own.pid
            err.print(f"[dim]own temporal={address} (pid {pid}) with {' '.join(dynamic_config)}[/dim]")
        else:
            info, started = stack.ensure_up(ui=False, port=port)
            settings, pid = Settings.from_env(), info.temporal_pid
            err.print(f"[dim]temporal={info.temporal_address} (pid {pid}) home={home}[/dim]")
        report = asyncio.run(run_bench(cells, opts, settings, pid,
                                       lambda m: err.print(m, highlight=False, soft_wrap=True), check_accounting))
        report["config"]["dynamic_config"] = list(dynamic_config)
    except LaminarError as exc:
        err.print(f"[red]control benchmark failed:[/red] {exc}")
        raise typer.Exit(1) from None
    finally:
        if started:
            stack.down()
        if own is not None:
            from laminar.bench.control import stop_process
            stop_process(own)
    Console(width=max(console.width, 200)).print(render_control_table(report))  # 19 columns: never squeezed
    for r in report["results"]:
        if r.get("error"):
            console.print(f"MISS {r['cell']}: {r['error']}")
            continue
        for what, holds, value in done_when(r):
            console.print(f"{'ok  ' if holds else 'MISS'} {r['cell']}: {what} ({value})")
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"wrote {json_path}")


def _handover_keep(text: str) -> bool:
    if text not in ("keep", "write"):
        raise ConfigError(f"--handover {text!r}: give keep (replicas park across a continue-as-new) or write "
                          "(they write their groups out)")
    return text == "keep"


def _csv_floats(text: str, what: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) <= 0:
        raise ConfigError(f"{what} {text!r} is not a comma-separated list of numbers > 0, e.g. 1,2,4")
    return out


def render_control_table(report: dict) -> Table:
    table = Table(title=f"control plane: one TrainingRunWorkflow, {report['config']['cpus']} CPUs, "
                        f"{report['config']['duration_s']:g} s per cell ({report['config']['date']})")
    for col in ("cell", "R", "groups/s", "updates/s (pred.)", "p50 ms", "p99 ms", "max ms", "wf task p99 ms",
                "server CPU", "control CPU", "bench CPU", "CPU ms/update server, control", "server MiB", "events/s",
                "CAN every s", "hand-over s", "replica stall p50/max s", "written", "lost", "twice", "load"):
        table.add_column(col, justify="right")

    def ms(v):
        return "-" if v is None else f"{v * 1000:.0f}"

    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    for r in report["results"]:
        if r.get("error"):
            table.add_row(r["cell"], str(r["replicas"]), *["-"] * 18, f"failed: {r['error'][:60]}")
            continue
        a, can, per = r["all_updates"], r["continue_as_new"], r["cpu_ms_per_update"]
        table.add_row(r["cell"], str(r["replicas"]), f"{r['groups_per_s_target']:.1f}",
                      f"{r['updates_per_s']:.0f} ({r['predicted_updates_per_s']:.0f})", ms(a["p50_s"]), ms(a["p99_s"]),
                      ms(a["max_s"]), ms(r["workflow_task"]["schedule_to_complete"]["p99_s"]),
                      f(r["cpu_cores"]["temporal_server"]), f(r["cpu_cores"]["control_worker"]),
                      f(r["cpu_cores"]["bench_process"]),
                      f"{f(per['temporal_server'], '{:.1f}')}, {f(per['control_worker'], '{:.1f}')}",
                      f(r["server_rss_mib"]["max"], "{:.0f}"),
                      f"{r['history_events_per_s']:.0f}", f(can["interval_s"]["p50_s"], "{:.0f}"),
                      f(can["stall_s"]["p50_s"]),
                      f"{f(can['replica_stall_s']['p50_s'])}/{f(can['replica_stall_s']['max_s'])}",
                      str(can["groups_written_total"]), str(r["groups_lost"]),
                      str(r["groups_consumed_twice"]), f(r["load_avg_1m"]["mean"]))
    return table
