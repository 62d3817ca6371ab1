"""How a command ends: a process that used a Temporal client, and one that started processes (SIGTERM as Ctrl-C)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn


def run_then_exit(program: Callable[[], object]) -> NoReturn:
    """Run a program that used a Temporal client (a click/typer app), then leave without interpreter finalisation.

    The SDK's native runtime threads can abort a finalising interpreter (`Fatal Python error: PyGILState_Release`,
    SIGABRT; temporalio/sdk-python issue 300), which turns a finished program's exit status into a crash: seen in
    CI on examples/start_and_watch.py after its run had finished. The program's SystemExit code is kept (a
    non-int code is printed, exit 1); stdout and stderr are flushed first. atexit handlers do not run, so it
    is for programs that register none that matter (the CLI and the example client)."""
    code = 0
    try:
        program()
    except SystemExit as e:
        if isinstance(e.code, int):
            code = e.code
        elif e.code is not None:
            print(e.code, file=sys.stderr)
            code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stop_like_ctrl_c() -> None:
    """SIGTERM / SIGHUP stop the command like Ctrl-C: nothing it started may outlive it."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler)
