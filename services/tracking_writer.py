"""One writer thread per experiment tracker, for the life of a run in a process (docs/decisions/trackers-full-disk.md).

The trainer only appends to a bounded queue; the writer opens the tracker once, writes each item in order, and on a
failure keeps the item at the head, backs off (doubling, capped) and tries it again, so what was missed during an
outage is written once the tracker answers. One warning per outage (`tracker_write_failed`), one info line when it
recovers (`tracker_recovered`, with the count of failed tries). A full queue drops the new item; a permanent error
skips the item; both are counted and their steps listed as missing (`stats()`).
"""

from __future__ import annotations

import errno as errno_names
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from laminar.logs import get_logger

log = get_logger(__name__)

RETRY_FIRST_S = 0.25  # the first back-off after a failure; it doubles up to tracking.retry_max_s
# MLflow error codes that say the item itself is refused: retrying it cannot succeed
PERMANENT_MLFLOW_CODES = {"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "INVALID_STATE", "RESOURCE_DOES_NOT_EXIST",
                          "PERMISSION_DENIED", "UNAUTHENTICATED"}


@dataclass
class Item:
    """One call for a tracker: a step's scalars (`resume`: steps >= step are written again) or an event."""

    kind: str  # "step" | "event"
    step: int
    scalars: dict[str, float] = field(default_factory=dict)
    resume: bool = False
    event: str = ""
    detail: str = ""
    time_ms: int = field(default_factory=lambda: int(time.time() * 1000))  # a retry writes the same timestamp


def step_ranges(steps: list[int]) -> str:
    """Sorted steps as ranges: [1, 2, 3, 7] -> "1-3,7"."""
    out: list[str] = []
    for s in sorted(set(steps)):
        if out and out[-1].split("-")[-1] == str(s - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{s}"
        else:
            out.append(str(s))
    return ",".join(out)


def error_errno(e: BaseException) -> str | None:
    """The errno name behind an error (its chain, or an MLflow message that quotes one), e.g. "ENOSPC"."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return errno_names.errorcode.get(seen.errno, str(seen.errno))
        seen = seen.__cause__ or seen.__context__
    m = re.search(r"\[Errno (\d+)\]", str(e))
    return errno_names.errorcode.get(int(m.group(1)), m.group(1)) if m else None


def is_permanent(e: BaseException) -> bool:
    """True for an error that refuses the item itself (retrying it cannot help); disk, network and server errors are
    transient."""
    return getattr(e, "error_code", None) in PERMANENT_MLFLOW_CODES


class TrackerWriter:
    """The one writer thread of one tracker: `put` never blocks; `close` drains within a deadline."""

    def __init__(self, name: str, make: Callable[[], Any], *, run_id: str, queue_max: int, retry_max_s: float) -> None:
        self.name, self.run_id, self._make = name, run_id, make
        self.queue_max, self.retry_max_s = queue_max, retry_max_s
        self._items: deque[Item] = deque()
        self._cv = threading.Condition()
        self._closing: bool | None = None  # None: running; else close(finished) was asked
        self._abandoned = False  # close gave up waiting: write nothing more
        self.tracker: Any = None
        self.written = 0  # items written
        self.dropped = 0  # items refused because the queue was full
        self.given_up = 0  # items skipped: a permanent error, or still pending when the writer closed
        self.missing_steps: list[int] = []  # steps whose scalars this tracker never wrote
        self.outages = 0
        self.failing_since: float | None = None
        self.failed_tries = 0
        self.thread = threading.Thread(target=self._run, name=f"tracker-{name}", daemon=True)
        self.thread.start()

    # -- the trainer's side ----------------------------------------------------------------------------------------

    def put(self, item: Item) -> bool:
        """Queue one item; False (counted) if the queue is full or the writer is closing."""
        with self._cv:
            if self._closing is None and len(self._items) < self.queue_max:
                self._items.append(item)
                self._cv.notify()
                return True
            self.dropped += 1
            self._lost(item)
            return False

    def close(self, finished: bool, deadline: float) -> None:
        """Write what is queued (one more try at once if failing), close the tracker, and return by `deadline`
        (time.monotonic()); items still pending then are counted as given up."""
        with self._cv:
            if self._closing is None:
                self._closing = finished
            self._cv.notify()
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            with self._cv:
                self._abandoned = True
                self._give_up_all("the writer did not finish within tracking.close_timeout_s")

    @property
    def closed(self) -> bool:
        return self._closing is not None

    def stats(self) -> dict[str, Any]:
        with self._cv:
            return {"written": self.written, "dropped": self.dropped, "given_up": self.given_up,
                    "pending": len(self._items), "outages": self.outages, "failing": self.failing_since is not None,
                    "missing_steps": step_ranges(self.missing_steps)}

    # -- the writer thread -----------------------------------------------------------------------------------------

    def _lost(self, item: Item) -> None:
        if item.kind == "step":
            self.missing_steps.append(item.step)

    def _give_up_all(self, why: str) -> None:
        if not self._items:
            return
        steps = [i.step for i in self._items if i.kind == "step"]
        self.given_up += len(self._items)
        for item in self._items:
            self._lost(item)
        self._items.clear()
        log.warning("tracker_points_missing", tracker=self.name, run_id=self.run_id, items=self.given_up,
                    steps=step_ranges(steps), why=why)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    self._cv.wait_for(lambda: self._items or self._closing is not None)
                    if self._abandoned or not self._items:
                        return
                    item = self._items[0]
                error = self._attempt(item)
                with self._cv:
                    if self._abandoned:
                        return
                    if error is None or is_permanent(error):
                        self._items.popleft()
                        if error is not None:
                            self.given_up += 1
                            self._lost(item)
                        continue
                    if self._closing is not None:  # closing and the tracker still fails: keep nothing
                        self._give_up_all(f"{type(error).__name__}: {error}"[:300])
                        return
                    delay = min(self.retry_max_s, RETRY_FIRST_S * 2 ** (self.failed_tries - 1))
                    self._cv.wait_for(lambda: self._closing is not None, timeout=delay)
        finally:
            self._close_tracker()

    def _attempt(self, item: Item) -> BaseException | None:
        """Write one item (opening the tracker first if needed); the error, or None."""
        try:
            if self.tracker is None:
                self.tracker = self._make()
            if item.kind == "step":
                if item.resume:
                    self.tracker.resume_at(item.step)
                self.tracker.log(item.step, item.scalars, item.time_ms)
            else:
                self.tracker.event(item.step, item.event, item.detail, item.time_ms)
        except Exception as e:  # a tracker never stops training: back off, retry, count
            self._failed(e, item)
            return e
        with self._cv:
            self.written += 1
        if self.failing_since is not None:
            log.info("tracker_recovered", tracker=self.name, run_id=self.run_id, failed_tries=self.failed_tries,
                     outage_s=round(time.monotonic() - self.failing_since, 1), pending=len(self._items) - 1)
            self.failing_since, self.failed_tries = None, 0
        return None

    def _failed(self, e: BaseException, item: Item) -> None:
        self.failed_tries += 1
        if self.failing_since is None:
            self.failing_since = time.monotonic()
            self.outages += 1
            log.warning("tracker_write_failed", tracker=self.name, run_id=self.run_id,
                        what=f"{item.kind} {item.event or item.step}", errno=error_errno(e),
                        error=f"{type(e).__name__}: {e}"[:300],
                        then="retried with back-off until it answers; points are kept (up to tracking.queue_max) "
                        "and written then; one line when it recovers")

    def _close_tracker(self) -> None:
        if self.tracker is None or self._closing is None:
            return
        try:
            self.tracker.close(self._closing)
        except Exception as e:
            log.warning("tracker_close_failed", tracker=self.name, run_id=self.run_id,
                        error=f"{type(e).__name__}: {e}"[:300])
