"""structlog set-up, once per process: a console renderer locally, JSON lines with `--log-format json`.

Log events are past-tense snake_case facts with key=value context (`checkpoint_saved step=10`).
"""

from __future__ import annotations

import logging
import sys

import structlog

_configured = False


class _Stderr:
    """sys.stderr as it is when a line is written, not when logging was configured: a caller that swaps stderr
    for a while (a test's CliRunner, a redirect) and closes its stream leaves logging writing to the real one."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(fmt: str = "console", level: str = "info", stream=None) -> None:
    """Configure structlog and stdlib logging for this process; later calls are ignored."""
    global _configured
    if _configured:
        return
    if fmt not in ("console", "json"):
        raise ValueError(f"log format {fmt!r} is not one of console, json")
    stream = stream or _Stderr()
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=logging.WARNING, stream=stream, format="%(levelname)s %(name)s: %(message)s")
    _configured = True


def get_logger(name: str | None = None, **context):
    return structlog.get_logger(name).bind(**context) if context else structlog.get_logger(name)
