"""`laminar dev up|down|status`: the embedded dev stack from the command line (mounted as `dev`)."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from laminar.cli.options import exit_codes
from laminar.client.settings import Settings
from laminar.devstack.stack import DevStack, DevStackInfo
from laminar.logs import configure_logging

dev_app = typer.Typer(help="Run a local dev stack: Temporal dev server (SQLite) and optionally an S3 server.",
                      no_args_is_help=True)  # fmt: skip
console = Console()
NOT_RUNNING = "dev stack is not running; start it with `laminar dev up`"


def _stack() -> DevStack:
    settings = Settings.from_env()  # a ConfigError exits 2 through exit_codes
    configure_logging(settings.log_format, settings.log_level)
    return DevStack(settings.home)


def _print_info(info: DevStackInfo) -> None:
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("Temporal address", f"{info.temporal_address}  (pid {info.temporal_pid})")
    table.add_row("Namespace", info.namespace)
    table.add_row("Web UI", info.ui_url or "off (started with --no-ui)")
    table.add_row("Store URL", info.store_url)
    if info.s3_endpoint is not None:
        table.add_row("S3 endpoint", f"{info.s3_endpoint}  (bucket {info.s3_bucket}, pid {info.s3_pid})")
    else:
        table.add_row("S3 endpoint", "off (start with `laminar dev up --s3`)")
    table.add_row("State", f"{info.db_file}  (logs in {info.home}/logs)")
    console.print(table, highlight=False)


@dev_app.command()
def up(
    s3: bool = typer.Option(False, "--s3", help="Also start an S3 server (moto) with bucket `laminar`."),
    port: int | None = typer.Option(
        None, "--port", help="Temporal gRPC port (default 7233, else a free one)."
    ),
    ui: bool = typer.Option(True, "--ui/--no-ui", help="Serve the Temporal Web UI on port + 1000."),
) -> None:
    """Start the dev stack, or show the running one."""
    with exit_codes():
        info, started = _stack().ensure_up(s3=s3, port=port, ui=ui)
    console.print("dev stack started" if started else "dev stack already running", highlight=False)
    _print_info(info)


@dev_app.command()
def down() -> None:
    """Stop the processes `laminar dev up` started; keep the Temporal SQLite state."""
    with exit_codes():
        stopped = _stack().down()
    if stopped:
        console.print(f"stopped {', '.join(stopped)}", highlight=False)
    else:
        console.print("dev stack was not running", highlight=False)


@dev_app.command()
def status() -> None:
    """Print the dev stack's endpoints; exit 1 when it is not running."""
    with exit_codes():
        info = _stack().status()
    if info is None:
        console.print(NOT_RUNNING, highlight=False, markup=False)
        raise typer.Exit(1)
    console.print("dev stack running", highlight=False)
    _print_info(info)
