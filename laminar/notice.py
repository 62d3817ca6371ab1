"""Leave on notice: the process-wide flag a worker sets when it is told it will go away (SIGTERM from a spot
machine's preemption warning, a cluster's drain, `laminar drain WORKER`, or a `preempt` drill fault).

Contract (every role reads the same flag, so a notice means the same thing for all of them):
- `NOTICE.give(within_s, reason)` is called once per process, by the worker's signal handler; the first call
  wins, later ones change nothing. From then on `NOTICE.given` is True and `NOTICE.remaining_s()` counts down
  to the deadline.
- The worker stops polling for new work at once (temporalio's graceful shutdown) and lets running activities
  finish for at most `within_s`; then it cancels what is left and exits 0.
- Each running activity looks at the flag between units of work and leaves cleanly: a rollout replica hands
  its unfinished groups over (services/rollout/replica.py), the trainer finishes its step and writes a
  deadline checkpoint, a relay leaves the chain. None waits for a heartbeat timeout to be noticed as gone.

The flag is a threading.Event, so activity threads and the worker's event loop see it alike; tests make their
own `Notice()` instead of touching the process's.
"""

from __future__ import annotations

import threading
import time


class Notice:
    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self.reason = ""
        self.deadline = float("inf")  # time.monotonic() by which the process is gone

    @property
    def given(self) -> bool:
        return self._event.is_set()

    def give(self, within_s: float, reason: str) -> bool:
        """Set the notice; False when one was already given (the first deadline stands)."""
        if within_s <= 0:
            raise ValueError(f"notice: within_s={within_s} must be > 0 (seconds until the process is gone)")
        with self._lock:
            if self._event.is_set():
                return False
            self.reason, self.deadline = reason, time.monotonic() + within_s
            self._event.set()
            return True

    def remaining_s(self) -> float:
        """Seconds left before the deadline (inf without a notice, never below 0)."""
        return max(0.0, self.deadline - time.monotonic()) if self.given else float("inf")


NOTICE = Notice()  # this process's notice
