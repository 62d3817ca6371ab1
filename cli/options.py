"""What every `laminar` command shares: how a duration is written, old flag spellings, the default config.

Durations are written one way on the whole command line: `30s`, `5m`, `1h`, or a plain number of seconds (`45`,
`2.5`). `parse_duration` is the one parser. A flag that used to take seconds under another name (`--timeout-s N`,
`drain --wait N`) is still accepted, hidden from --help, with a deprecation warning on stderr (`duration`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

import typer
from rich.console import Console

from laminar.errors import ConfigError, LaminarError

EXTRA_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}  # `--section.key=value` overrides
UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
DURATION_HELP = "30s, 5m, 1h or plain seconds"
DEFAULT_CONFIG_NAME = "tiny.toml"  # laminar/defaults/: the same content as examples/tiny.toml (a test keeps them equal)
CONFIG_HELP = ("Run config (TOML); default: the packaged tiny config (laminar/defaults/tiny.toml, the same as "
               "examples/tiny.toml).")


def parse_duration(text: str | float, flag: str = "duration", allow_zero: bool = False) -> float:
    """`30s`, `5m`, `1h`, `45` or `2.5` (seconds) -> seconds, > 0 (>= 0 with allow_zero: a point in time);
    ConfigError naming the flag otherwise."""
    t = str(text).strip().lower()
    unit = UNITS.get(t[-1:])
    try:
        value = float(t[:-1] if unit else t) * (unit or 1.0)
    except ValueError:
        value = -1.0
    if not (value >= 0 if allow_zero else value > 0) or value == float("inf"):
        raise ConfigError(f"{flag} {text!r}: give a positive time such as 30s, 5m or 1h (a plain number is seconds)")
    return value


def deprecated(old: str, new: str) -> None:
    """The warning an old spelling prints on stderr (the command goes on)."""
    print(f"warning: {old} is deprecated; use {new} (durations: {DURATION_HELP})", file=sys.stderr)


def duration(value: str | None, flag: str, old_value: float | None = None, old_flag: str = "",
             default: str | None = None) -> float | None:
    """The seconds a duration flag gives: `value` (written as parse_duration reads it), else the old spelling's
    seconds (with a deprecation warning), else `default` (None: no default). Both given: ConfigError."""
    if value is not None and old_value is not None:
        raise ConfigError(f"{flag} and {old_flag} say the same thing; give only {flag}")
    if old_value is not None:
        deprecated(f"{old_flag} {old_value:g}", f"{flag} {old_value:g}s")
        return parse_duration(old_value, old_flag)
    if value is not None:
        return parse_duration(value, flag)
    return None if default is None else parse_duration(default, flag)


def old_seconds_option(flag: str) -> float | None:
    """A hidden option for an old seconds-only spelling (`--timeout-s`), kept working."""
    return typer.Option(None, flag, hidden=True, help="Deprecated: seconds; use the duration flag instead.")


def default_config() -> Path:
    """The packaged default config (laminar/defaults/tiny.toml): found from any directory after `pip install`."""
    return Path(str(resources.files("laminar").joinpath("defaults", DEFAULT_CONFIG_NAME)))


def config_or_default(config: Path | None) -> Path:
    return config if config is not None else default_config()


def config_and_overrides(config: Path | None, extra: list[str]) -> tuple[Path, list[str]]:
    """The config file and the `--section.key=value` overrides of a command whose CONFIG argument is optional: an
    override given first lands in CONFIG (click hands unknown options to the arguments), so it moves back."""
    if config is not None and str(config).startswith("--"):
        return default_config(), [str(config), *extra]
    return config_or_default(config), list(extra)


_err = Console(stderr=True)


def fail(e: Exception, code: int) -> typer.Exit:
    """The one-line error every command prints, and the exit it raises."""
    _err.print(f"[red]error:[/red] {e}", markup=True, highlight=False)
    return typer.Exit(code)


@contextmanager
def exit_codes() -> Iterator[None]:
    """Our errors become a one-line message and an exit code: 2 for invalid input, 1 for failures."""
    try:
        yield
    except ConfigError as e:
        raise fail(e, 2) from None
    except LaminarError as e:
        raise fail(e, 1) from None
