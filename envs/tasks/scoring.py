"""Reward calls, with the failure semantics of envs/tasks/__init__.py: a number in hand, or `RewardFailure`.

A `RewardRunner` calls the reward on its own daemon thread (an async reward runs on that thread's event loop)
and waits at most `timeout_s`. A call that overruns is abandoned, not killed (Python cannot stop a thread):
the runner then starts a new thread and loop for the next call, and a reward that can hang should do its work
in a subprocess or sandbox of its own. After any failure the caller calls `fresh()`, so the group's retry
runs in a fresh call context. The value must be an int or float (not bool), finite; anything else is a
failure with its reason. The thread is kept between calls: a call costs a queue round trip, not a thread start.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import queue
import threading
from typing import Any

from laminar.envs.tasks import Prompt, RewardFailure

REASONS = ("raised", "timeout", "nan", "wrong_type", "sandbox", "generation", "malformed")


class _Job:
    def __init__(self, task: Any, prompt: Prompt, response_ids: list[int]) -> None:
        self.args, self.done = (task, prompt, response_ids), threading.Event()
        self.value: Any = None
        self.failure: RewardFailure | None = None


class RewardRunner:
    """Reward calls on one kept daemon thread (with its event loop), each within timeout_s. Daemon: a stuck
    reward never keeps the worker process from exiting."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._inbox: queue.SimpleQueue[_Job | None] | None = None

    def score(self, task: Any, prompt: Prompt, response_ids: list[int]) -> float:
        """task.reward(prompt, response_ids), sync or async; raises RewardFailure."""
        if self._inbox is None:
            self._inbox = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(self._inbox,), name="reward", daemon=True).start()
        job = _Job(task, prompt, response_ids)
        self._inbox.put(job)
        if not job.done.wait(self.timeout_s):
            self.fresh()  # abandon the stuck thread (it exits after its call); the next call gets a new one
            raise RewardFailure("timeout", f"no reward after {self.timeout_s:g} s")
        if job.failure is not None:
            raise job.failure
        return check_value(job.value)

    def fresh(self) -> None:
        """Retire the thread and its event loop: the next call starts in a fresh context."""
        if self._inbox is not None:
            self._inbox.put(None)
        self._inbox = None


def _serve(inbox: queue.SimpleQueue) -> None:
    loop: asyncio.AbstractEventLoop | None = None
    try:
        while (job := inbox.get()) is not None:
            try:
                value = job.args[0].reward(*job.args[1:])
                if inspect.isawaitable(value):
                    loop = loop or asyncio.new_event_loop()
                    value = loop.run_until_complete(_awaited(value))
                job.value = value
            except RewardFailure as e:
                job.failure = e
            except BaseException as e:  # noqa: BLE001 - whatever the reward raised is the failure's detail
                job.failure = RewardFailure("raised", f"{type(e).__name__}: {e}")
            job.done.set()
    finally:
        if loop is not None:
            loop.close()


def score(task: Any, prompt: Prompt, response_ids: list[int], timeout_s: float) -> float:
    """One reward call in a fresh context (RewardRunner.score)."""
    runner = RewardRunner(timeout_s)
    try:
        return runner.score(task, prompt, response_ids)
    finally:
        runner.fresh()


async def _awaited(value: Any) -> Any:
    return await value


def check_value(value: Any) -> float:
    """The reward as a float, or RewardFailure: NaN and infinities are `nan`, a non-number (bool included) is
    `wrong_type`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardFailure("wrong_type", f"reward returned {type(value).__name__} {value!r:.80}, not a number")
    if not math.isfinite(value):
        raise RewardFailure("nan", f"reward returned {value!r}")
    return float(value)
