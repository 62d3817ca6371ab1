"""One call at a time on the trainer's policy, the waiting steps of a run in step order.

The workflow schedules up to two trainer activities behind the running one (workflows/trainer.py, train-ahead), and
the trainer's worker runs all three at once (workers/processes.py `TRAINER_SLOTS`): each reads its segments, then
waits here for its turn. A plain lock wakes its waiters in no set order, so step k+2 could take the policy before
step k+1; the trainer would then train k+1's batch first from k+2's replay (TrainerService._catch_up) and hand k+1's
activity the kept result, correct but late: the workflow commits in step order, so k+1's return, and with it the next
scheduling, waits for k+2. `Turns` hands the policy to the lowest step of a run among those waiting. It orders only
the waiters that are here: a step whose predecessor has not reached this process (a retry on another trainer, the
task queue's order) does not wait for it. Calls without a step (an init, a republish, the deadline checkpoint) take a
free turn when one comes, as with a lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Turns:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._held = False
        self._waiting: list[tuple[str, int]] = []  # (run_id, step) of the steps waiting for a turn

    def acquire(self, step: tuple[str, int] | None = None, timeout: float | None = None,
                on_wait: Callable[[], None] = lambda: None, every_s: float = 1.0) -> tuple[bool, bool]:
        """Wait for the turn: until it is free and, for `step`, no lower step of its run waits. Calls on_wait every
        every_s while waiting (an activity's heartbeat). Returns (got it, had to wait); (False, True) only after
        `timeout` seconds."""
        now = time.monotonic()
        deadline, beat_at = (None if timeout is None else now + timeout), now + every_s
        with self._cv:
            if step is not None:
                self._waiting.append(step)
            waited = False
            try:
                while not self._mine(step):
                    waited, now = True, time.monotonic()
                    if deadline is not None and now >= deadline:
                        return False, True
                    if now >= beat_at:  # on the clock, not per wake-up: other calls' comings and goings notify too
                        on_wait()
                        beat_at = now + every_s
                    self._cv.wait((beat_at if deadline is None else min(beat_at, deadline)) - now)
                self._held = True
                return True, waited
            finally:
                if step is not None:
                    self._waiting.remove(step)
                    self._cv.notify_all()  # a lower step leaving (taking its turn, or giving up) lets the next look

    def release(self) -> None:
        with self._cv:
            self._held = False
            self._cv.notify_all()

    def _mine(self, step: tuple[str, int] | None) -> bool:
        if self._held:
            return False
        if step is None:
            return True
        run_id, n = step
        return all(s >= n for r, s in self._waiting if r == run_id)
