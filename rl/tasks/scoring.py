"""One reward call, with the failure semantics of rl/tasks/__init__.py: a number in hand, or `RewardFailure`.

Each call runs in a fresh daemon thread (a fresh call context: an async reward gets its own event loop) and
is waited for at most `timeout_s`. A call that overruns is abandoned, not killed (Python cannot stop a
thread): a reward that can hang should do its work in a subprocess or sandbox of its own. The value must be
an int or float (not bool), finite; anything else is a failure with its reason.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
from typing import Any

from rl.tasks import Prompt, RewardFailure

REASONS = ("raised", "timeout", "nan", "wrong_type", "sandbox", "generation")


def score(task: Any, prompt: Prompt, response_ids: list[int], timeout_s: float) -> float:
    """task.reward(prompt, response_ids), sync or async, within timeout_s; raises RewardFailure."""
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            value = task.reward(prompt, response_ids)
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))
            box["value"] = value
        except RewardFailure as e:
            box["failure"] = e
        except BaseException as e:  # noqa: BLE001 - whatever the reward raised is the failure's detail
            box["failure"] = RewardFailure("raised", f"{type(e).__name__}: {e}")

    thread = threading.Thread(target=call, name="reward", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardFailure("timeout", f"no reward after {timeout_s:g} s")
    if "failure" in box:
        raise box["failure"]
    return check_value(box.get("value"))


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
