"""`laminar chaos`: the command line of a chaos run (chaos/command.py does the work)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from laminar.chaos.schedule import KINDS, parse_kinds
from laminar.cli.options import CONFIG_HELP, DURATION_HELP, config_and_overrides, exit_codes, parse_duration

console = Console()


def chaos_command(
    ctx: typer.Context,
    config: Path | None = typer.Argument(None, help=CONFIG_HELP, show_default=False),
    duration: str = typer.Option("", help=f"How long the faults go on ({DURATION_HELP}; e.g. 30m); required "
                                 "without --replay."),
    seed: int = typer.Option(0, help="Seed of the fault schedule: the same seed gives the same schedule."),
    faults: str = typer.Option("", help=f"Fault kinds, comma-separated, among {','.join(KINDS)} (default: "
                               "all; one this machine cannot inject is reported as skipped)."),
    rate: float = typer.Option(4.0, help="Faults per minute (at least one of each kind)."),
    overlaps: int = typer.Option(2, help="At least this many faults overlap an earlier one."),
    replay: Path | None = typer.Option(None, help="Run this saved schedule (schedule.json of an earlier run)."),
    out: Path | None = typer.Option(None, help="Output folder (default: <LAMINAR_HOME>/chaos/<run_id>)."),
    run_id: str | None = typer.Option(None, "--run-id", help="Run id (default: generated)."),
    judge: Path | None = typer.Option(None, "--judge", help="Judge a finished chaos run again from its output "
                                      "folder (its records are read again; nothing is run)."),
) -> None:
    """Run CONFIG under a seeded schedule of overlapping faults that all heal; check its records at the end.

    Extra `--section.key=value` arguments override config values."""
    from laminar.chaos.checker import format_verdict
    from laminar.chaos.command import rejudge, run_chaos

    with exit_codes():
        if judge is not None:
            verdict, folder = rejudge(judge), judge
        else:
            path, overrides = config_and_overrides(config, ctx.args)
            verdict, folder = run_chaos(path, overrides,
                                        parse_duration(duration, "--duration") if duration else None, seed,
                                        parse_kinds(faults) if faults else None, rate, overlaps, replay, out, run_id)
    console.print(format_verdict(verdict), highlight=False, soft_wrap=True)
    console.print(f"written: {folder}/verdict.json, report.md, schedule.json, faults.json", highlight=False)
    raise typer.Exit(0 if verdict.green else 1)
