"""`laminar simulate` and `laminar plan`: the discrete-event simulator at GPU scale (sim/, docs/guides/simulate.md).

    laminar simulate --model 7b|32b|72b [--gpus 16,32,...] [--modes ...] [--workload math|uniform|tool]
        [--repack on|off] [--relay-bench docs/benchmarks/data/relay-bench.json] [--fail rollout@10m ...] [--json F] [--plot F]
    laminar simulate --validate [--modes ...] [--workloads long_tail,uniform] [--iterations N] [--kv-binds]
    laminar plan --model 7b --gpus 256 [--workload math]
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

console = Console() if sys.stdout.isatty() else Console(width=200)  # tables whole when piped to a file
err = Console(stderr=True)

FAILURES = ("rollout", "relay", "trainer", "preempt")


def _csv(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        out = tuple(sorted({int(x) for x in _csv(text)}))
    except ValueError:
        out = ()
    if not out or min(out) < 1:
        raise typer.BadParameter(f"{what}={text!r} is not a comma-separated list of counts >= 1, e.g. 64,128,256")
    return out


def _check_modes(modes: tuple[str, ...]) -> tuple[str, ...]:
    from laminar.sim.scenarios import MODES
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise typer.BadParameter(f"--modes {','.join(modes)!r}: unknown {bad}; use a subset of {','.join(MODES)}")
    return modes


def _check_model(model: str) -> str:
    from laminar.sim.params import MODELS
    if model not in MODELS:
        raise typer.BadParameter(f"--model {model!r} is not simulated; one of {', '.join(MODELS)}")
    return model


def _check_workload(workload: str) -> str:
    from laminar.sim.params import WORKLOADS
    if workload not in WORKLOADS:
        raise typer.BadParameter(f"--workload {workload!r} is not simulated; one of {', '.join(WORKLOADS)}")
    return workload


def parse_failure(text: str) -> tuple[str, float]:
    """'rollout@600' or 'rollout@10m' -> ('rollout', 600.0): a failure kind and the modelled time it strikes (a
    duration as every flag writes one: cli/options.py parse_duration)."""
    from laminar.cli.options import parse_duration
    from laminar.errors import ConfigError

    kind, _, at = text.partition("@")
    try:
        t = parse_duration(at, "--fail", allow_zero=True)
    except ConfigError:
        t = -1.0
    if kind not in FAILURES or t < 0:
        raise typer.BadParameter(f"--fail {text!r} is not KIND@TIME with KIND one of {', '.join(FAILURES)} and "
                                 f"TIME as 30s, 10m, 1h or plain seconds (e.g. rollout@600, rollout@10m)")
    return kind, t


def _fmt(v: float | None, digits: int = 0) -> str:
    if v is None:
        return "-"
    return f"{v:,.{digits}f}"


def sweep_table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="simulated throughput (modelled H800 seconds)")
    for col in ("model", "GPUs", "mode", "placement (train/rollout)", "paper Table 2", "tokens/s", "laminar vs it",
                "iteration s", "staleness max", "KV use", "trainer idle", "scaling eff."):
        t.add_column(col)
    for r in rows:
        t.add_row(r["model"], str(r["gpus"]), r["mode"], r["placement"], r["paper_placement"],
                  _fmt(r["tokens_per_s"]), f"{r['laminar_speedup']:.2f}x" if r.get("laminar_speedup") else "-",
                  _fmt(r["iteration_s"], 1), str(r["staleness_max"]), f"{r['kv_utilisation']:.0%}",
                  f"{r['trainer_idle_fraction']:.0%}",
                  f"{r['scaling_efficiency']:.0%}" if r.get("scaling_efficiency") is not None else "-")
    return t


def fig11_table(summary: dict[str, dict[str, float]]) -> Table:
    from laminar.sim.paper import FIG11_SPEEDUP
    t = Table(title="laminar's speedup: simulated vs the paper's Fig. 11 (math)")
    for col in ("baseline", "sim average", "paper average", "sim max", "paper max", "sim at largest scale"):
        t.add_column(col)
    for mode, s in summary.items():
        avg, mx = FIG11_SPEEDUP.get(mode, (None, None))
        t.add_row(mode, f"{s['average']:.2f}x", f"{avg:.2f}x" if avg else "-", f"{s['max']:.2f}x",
                  f"{mx:.2f}x" if mx else "-", f"{s['largest_scale']:.2f}x")
    return t


def plot_sweep(report: dict[str, Any], path: Path) -> None:
    """Throughput against GPUs per mode, and laminar's speedups per scale beside the paper's Fig. 11 values."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise typer.BadParameter("--plot needs matplotlib: pip install 'laminar[bench]'") from None
    from laminar.sim.paper import FIG11_SPEEDUP
    rows = report["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    for mode in modes:
        rs = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["gpus"])
        a.plot([r["gpus"] for r in rs], [r["tokens_per_s"] for r in rs], marker="o", label=mode)
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("GPUs")
    a.set_ylabel("tokens/s (simulated)")
    a.set_title(f"{report['config']['model']} {report['config']['workload']}: throughput")
    a.legend()
    for mode in (m for m in modes if m != "laminar"):
        rs = sorted((r for r in rows if r["mode"] == mode and r.get("laminar_speedup")), key=lambda r: r["gpus"])
        line, = b.plot([r["gpus"] for r in rs], [r["laminar_speedup"] for r in rs], marker="o", label=f"vs {mode}")
        if mode in FIG11_SPEEDUP:
            avg, mx = FIG11_SPEEDUP[mode]
            b.axhline(avg, color=line.get_color(), linestyle=":", linewidth=1)
            b.axhline(mx, color=line.get_color(), linestyle="--", linewidth=1)
    b.axhline(1.0, color="grey", linewidth=0.5)
    b.set_xscale("log", base=2)
    b.set_xlabel("GPUs")
    b.set_ylabel("laminar speedup")
    b.set_title("speedups (dotted: paper Fig. 11 average, dashed: max)")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def simulate_command(
    model: str = typer.Option("7b", help="Model size: 7b, 32b or 72b (sim/params.py)."),
    gpus: str | None = typer.Option(None, help="GPU budgets, comma-separated (default: the paper's Table 2 scales)."),
    modes: str = typer.Option("laminar,sync,one_step,stream,partial_rollout", help="Run modes, comma-separated."),
    workload: str = typer.Option("math", help="math (long tail), uniform (no tail) or tool (multi-turn)."),
    repack: str = typer.Option("on", help="Dynamic repack in laminar mode: on or off."),
    iterations: int = typer.Option(8, min=2, help="Global batches per final run."),
    warmup: int = typer.Option(3, min=1, help="Of which excluded from the metrics (warm-up)."),
    control_plane: str = typer.Option("off", "--control-plane", help="on: replicas claim and report through one "
                                      "workflow that serves one update at a time, at the measured costs "
                                      "(sim/params.py CONTROL_*), each parked across a continue-as-new (as "
                                      "shipped); write: each writes its groups out instead (run.handover_keep = "
                                      "false); no-handover: a continue-as-new nobody feels; off: a control plane "
                                      "that answers at once (the default: the on case is slow to simulate at 7B "
                                      "scale). With --validate, the simulator's side of each row."),
    relay_bench: Path | None = typer.Option(None, "--relay-bench", help="Relay chain bandwidths from a `laminar "
                                            "bench relay --json` report (e.g. docs/benchmarks/data/relay-bench.json)."),
    fail: list[str] = typer.Option([], "--fail", help="KIND@TIME (rollout, relay, trainer, preempt; TIME as 10m "
                                   "or plain seconds): predict the throughput a failure costs; repeatable."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the report as JSON here."),
    plot_path: Path | None = typer.Option(None, "--plot", help="Write the plots (PNG) here."),
    validate: bool = typer.Option(False, "--validate", help="Run the simulator and `laminar bench throughput` on "
                                  "the same configuration and print both."),
    workloads: str = typer.Option("long_tail,uniform", help="--validate: modelled workloads."),
    replicas: int = typer.Option(8, min=1, help="--validate: rollout replicas."),
    kv_binds: bool = typer.Option(False, "--kv-binds", help="--validate: also a configuration where the KV cache "
                                  "bounds admission (modelled.kv_capacity_tokens lowered)."),
) -> None:
    """Simulate trainer, rollout replicas, relays and the control plane at GPU scale (modelled time)."""
    from laminar.sim.scenarios import CONTROL_PLANES, RelayLink
    from laminar.sim.sweep import SweepSpec, failure_runs, speedup_summary, sweep

    mode_list = _check_modes(_csv(modes))
    if control_plane not in CONTROL_PLANES:
        raise typer.BadParameter(f"--control-plane {control_plane!r}: use one of {', '.join(CONTROL_PLANES)}")
    if validate:
        validate_command(mode_list, _csv(workloads), replicas, iterations, kv_binds, json_path, control_plane)
        return
    if repack not in ("on", "off"):
        raise typer.BadParameter(f"--repack {repack!r}: use on or off")
    if warmup >= iterations:
        raise typer.BadParameter(f"--warmup {warmup} leaves no measured batch of --iterations {iterations}")
    link = RelayLink()
    if relay_bench is not None:
        try:
            link = RelayLink.from_bench(relay_bench)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
    spec = SweepSpec(model=_check_model(model), gpus=_ints(gpus, "--gpus") if gpus else (), modes=mode_list,
                     workload=_check_workload(workload), repack=repack == "on", iterations=iterations,
                     warmup=warmup, link=link, control_plane=control_plane)
    failures = [parse_failure(f) for f in fail]
    t0 = time.perf_counter()
    if failures:
        rows = [row for mode in mode_list for row in failure_runs(spec, mode, spec.scales()[0], failures)]
        t = Table(title=f"failures ({spec.model}, {spec.scales()[0]} GPUs)")
        for col in ("failure", "mode", "placement", "tokens/s", "with failure", "tokens lost", "= seconds of "
                    "throughput", "restored after (s)"):
            t.add_column(col)
        for r in rows:
            t.add_row(f"{r['failure']}@{r['at_s']:g}", r["mode"], r["placement"], _fmt(r["tokens_per_s"]),
                      _fmt(r["tokens_per_s_with_failure"]), _fmt(r["tokens_lost"]), _fmt(r["seconds_lost"], 1),
                      _fmt(r["restored_after_s"], 1))
        console.print(t)
        report: dict[str, Any] = {"failures": rows, "config": {"model": spec.model, "gpus": spec.scales()[0]}}
    else:
        report = sweep(spec, progress=lambda line: err.print(line, highlight=False))
        console.print(sweep_table(report["rows"]))
        summary = speedup_summary(report["rows"])
        report["speedups"] = summary
        if summary:
            console.print(fig11_table(summary))
        if plot_path is not None:
            plot_sweep(report, plot_path)
            console.print(f"plot: {plot_path}")
    console.print(f"simulated in {time.perf_counter() - t0:.1f} s")
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2, default=str))
        console.print(f"json: {json_path}")


def plan_command(
    model: str = typer.Option("7b", help="Model size: 7b, 32b or 72b."),
    gpus: int = typer.Option(256, min=2, help="GPU budget."),
    workload: str = typer.Option("math", help="math, uniform or tool."),
    modes: str = typer.Option("laminar,sync,one_step,stream,partial_rollout", help="Run modes, comma-separated."),
) -> None:
    """The best trainer/rollout placement per mode at one GPU budget, found by the simulator."""
    from laminar.sim.sweep import plan

    rows = plan(_check_model(model), gpus, _check_workload(workload), _check_modes(_csv(modes)))
    t = Table(title=f"best placement per mode: {model}, {gpus} GPUs, {workload}")
    for col in ("mode", "train/rollout GPUs", "replicas x TP", "paper Table 2", "tokens/s", "iteration s",
                "staleness max", "KV use", "trainer idle"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["mode"], r["placement"], f"{r['replicas']} x {r['tp']}", r["paper_placement"],
                  _fmt(r["tokens_per_s"]), _fmt(r["iteration_s"], 1), str(r["staleness_max"]),
                  f"{r['kv_utilisation']:.0%}", f"{r['trainer_idle_fraction']:.0%}")
    console.print(t)


# tokens: the smallest cache the config accepts at the default workload (prompt 256 + max response 16,384; a smaller
# one could never hold the longest sequence, and a real engine refuses it). 4 groups of 8 long-tailed samples hold
# ~60K tokens at their ends, so the cache binds: growth preempts the newest sequences and admission waits for room.
KV_BINDS_CAPACITY = 16640


def replica_timing():
    """The real replica loop's intervals (services/rollout/timing.py), for the simulator's control plane."""
    from laminar.sim.scenarios import control_timing

    return control_timing()


def simulate_like_bench(cfg, iterations: int, control_plane: str = "off") -> dict[str, Any]:
    """The simulator on one `laminar bench throughput` run config (sim/scenarios.py from_run_config): the replicas'
    intervals and, unless control_plane is off, the workflow's measured costs (sim/scenarios.py control_plane_cost),
    both in the modelled engine's seconds (a wall second is modelled.speedup of them), and the replica loop's time
    outside the engine (sim/params.py REPLICA_LOOP_SHARE, measured on the real stack)."""
    from laminar.bench.throughput import warmup_steps
    from laminar.sim import params as P
    from laminar.sim.core import simulate
    from laminar.sim.scenarios import control_plane_cost, from_run_config, with_replica_loop

    speedup = cfg.modelled.speedup
    sim_cfg = from_run_config(cfg, iterations=iterations, warmup=warmup_steps(iterations))
    cost = control_plane_cost(control_plane)
    res = simulate(replace(sim_cfg, control=replica_timing().scaled(speedup),
                           costs=with_replica_loop(sim_cfg.costs, P.REPLICA_LOOP_SHARE),
                           control_plane=None if cost is None else cost.scaled(speedup)))
    return {"tokens_per_s": res.tokens_per_s, "staleness_max": res.staleness_max, "kv_utilisation": res.kv_utilisation,
            "trainer_idle_fraction": res.trainer_idle_fraction, "complete": res.complete, "repacks": res.repacks}


def _progress_printer():
    """A bench progress callback that prints a run's notes and each new step once."""
    last: dict[str, Any] = {}

    def progress(label: str, status: Any, note: str) -> None:
        line = note or (f"step {status.step}/{status.total_steps}" if status is not None else "")
        if line and last.get(label) != line:
            last[label] = line
            err.print(f"[dim]{label}: {line}[/dim]", highlight=False)
    return progress


def validate_command(modes: tuple[str, ...], workloads: tuple[str, ...], replicas: int, iterations: int,
                     kv_binds: bool, json_path: Path | None, control_plane: str = "off") -> None:
    """Simulator and real stack (bench/throughput.py run_bench, the modelled engine) on the same configs."""
    from laminar.bench.throughput import WORKLOADS, BenchSpec, run_bench
    from laminar.cli.bench import launch_bench_workers
    from laminar.client.exit import stop_like_ctrl_c
    from laminar.sim import params as P

    bad = [w for w in workloads if w not in WORKLOADS]
    if bad or not workloads:
        raise typer.BadParameter(f"--workloads {','.join(workloads)!r}: use a subset of {','.join(WORKLOADS)}")
    settings = [("default", ())]
    if kv_binds:
        settings.append(("kv binds", (f"modelled.kv_capacity_tokens={KV_BINDS_CAPACITY}",)))
    rows: list[dict[str, Any]] = []
    stop_like_ctrl_c()  # SIGTERM too: its runs are ended, its workers stopped (bench/throughput.py)
    for label, extra in settings:
        spec = BenchSpec(modes=modes, workloads=workloads, replicas=replicas, engine="modelled",
                         iterations=iterations, extra_overrides=extra, owner="laminar simulate --validate")
        try:
            report = run_bench(spec, _progress_printer(), launch_bench_workers)
        except KeyboardInterrupt:
            console.print("interrupted: the validation's runs were ended and its workers stopped")
            raise typer.Exit(130) from None
        for real in report["results"]:
            cfg = spec.run_config(real["mode"], real["workload"], "sim", real.get("repack", True))
            sim = simulate_like_bench(cfg, iterations, control_plane)
            ratio = sim["tokens_per_s"] / real["tokens_per_s"] if real.get("tokens_per_s") else None
            rows.append({"setting": label, "workload": real["workload"], "mode": real["mode"],
                         "real_tokens_per_s": real.get("tokens_per_s"), "sim_tokens_per_s": round(sim["tokens_per_s"], 1),
                         "sim_over_real": None if ratio is None else round(ratio, 3),
                         "within_15pct": ratio is not None and abs(ratio - 1) <= 0.15,
                         "real_staleness_max": real.get("staleness_max"), "sim_staleness_max": sim["staleness_max"]})
    t = Table(title=f"simulator vs real stack ({replicas} replicas, {iterations} global batches, modelled engine, "
                    f"control plane {control_plane}, replica loop {P.REPLICA_LOOP_SHARE:.1%} outside the engine)")
    for col in ("setting", "workload", "mode", "real tokens/s", "sim tokens/s", "sim / real", "within 15 %",
                "staleness max real / sim"):
        t.add_column(col)
    for r in rows:
        t.add_row(r["setting"], r["workload"], r["mode"], _fmt(r["real_tokens_per_s"]), _fmt(r["sim_tokens_per_s"]),
                  "-" if r["sim_over_real"] is None else f"{r['sim_over_real']:.2f}",
                  "yes" if r["within_15pct"] else "NO", f"{r['real_staleness_max']} / {r['sim_staleness_max']}")
    console.print(t)
    if json_path is not None:
        json_path.write_text(json.dumps({"control_plane": control_plane, "replica_loop_share": P.REPLICA_LOOP_SHARE,
                                         "validation": rows}, indent=2, default=str))
        console.print(f"json: {json_path}")
    if not all(r["within_15pct"] for r in rows):
        raise typer.Exit(1)

