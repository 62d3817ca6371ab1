"""`laminar chaos`: the command line of a chaos run (chaos/command.py does the work)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from chaos.schedule import KINDS, parse_duration, parse_kinds
from laminar.errors import ConfigError, LaminarError

console = Console()
err = Console(stderr=True)


def register(app: typer.Typer) -> None:
    """Add `chaos` to the `laminar` command line (workers/cli.py)."""

    @app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def chaos(
        ctx: typer.Context,
        config: Path = typer.Argument(Path("examples/tiny.toml"), help="Run config (TOML)."),
        duration: str = typer.Option("", help="How long the faults go on, e.g. 30m, 150s (required without --replay)."),
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
        from chaos.checker import format_verdict
        from chaos.command import rejudge, run_chaos

        try:
            if judge is not None:
                verdict, folder = rejudge(judge), judge
            else:
                verdict, folder = run_chaos(config, list(ctx.args), parse_duration(duration) if duration else None,
                                            seed, parse_kinds(faults) if faults else None, rate, overlaps, replay,
                                            out, run_id)
        except ConfigError as e:
            err.print(f"[red]error:[/red] {e}", markup=True, highlight=False)
            raise typer.Exit(2) from None
        except LaminarError as e:
            err.print(f"[red]error:[/red] {e}", markup=True, highlight=False)
            raise typer.Exit(1) from None
        console.print(format_verdict(verdict), highlight=False, soft_wrap=True)
        console.print(f"written: {folder}/verdict.json, report.md, schedule.json, faults.json", highlight=False)
        raise typer.Exit(0 if verdict.green else 1)
