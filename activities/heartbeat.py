"""Heartbeat from a background thread while a sync activity sits in long native calls (which would
block a heartbeat from the activity's own thread).

The beat is tied to a progress counter: if the work stops making progress for `stall_s`, beats stop,
so a hang still shows up as a missed heartbeat. Work that has no progress to report (loading or
building a model) passes `stall_s=None`: it beats until it returns, bounded by its start-to-close timeout.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from temporalio import activity

# Heartbeats reach the server at least this often (the SDK otherwise waits up to 80 % of the heartbeat
# timeout), so a seconds-long heartbeat timeout detects a dead worker without false alarms. At 64 replicas
# this is 64 heartbeat RPCs per second; heartbeats are not history events (docs/architecture/temporal.md).
HEARTBEAT_THROTTLE = timedelta(seconds=1)


class Progress:
    def __init__(self) -> None:
        self.count = 0
        self.changed_at = time.monotonic()

    def tick(self) -> None:
        self.count += 1
        self.changed_at = time.monotonic()


@contextmanager
def background_heartbeat(every_s: float = 1.0, stall_s: float | None = 600.0) -> Iterator[Progress]:
    progress = Progress()
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every_s):
            if stall_s is None or time.monotonic() - progress.changed_at < stall_s:
                activity.heartbeat(progress.count)

    ctx = contextvars.copy_context()
    thread = threading.Thread(target=ctx.run, args=(beat,), daemon=True, name="heartbeat")
    thread.start()
    try:
        yield progress
    finally:
        stop.set()
        thread.join(timeout=every_s + 1)
