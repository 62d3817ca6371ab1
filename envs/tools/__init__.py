"""Tools for multi-turn episodes: what a tool is, how a model turn calls one, and each sample's episode state.

A tool is any object with `name`, `tag` and `run(text) -> str | ToolResult` (the `Tool` protocol): the model
calls it by ending a turn with `<tag>text</tag>` (then <eos>); `run` gets the text between the tags. An
answer the tool gives about bad input (a malformed expression, a division by zero) is output like any other:
the model reads it and goes on. A tool that cannot run (it raises, or returns `ToolResult(ok=False)`: a
crashed or timed-out sandbox) fails the episode: the replica fails the group with reason "sandbox" (its
retry-then-drop path, envs/tasks/__init__.py).

Built in: `envs.tools.calculator.Calculator` (`<calc>`). A Python sandbox tool (`<python>`) plugs in the same way.

The environment loop that drives tools lives in the rollout replica (services/rollout/batch.py); what it keeps
per sample is an `Episode` here: the tool-output mask over the response so far, and one `ToolCall` per
completed call. A task opts in by having `tools` (a list of tools) and `max_turns` (model turns per episode,
>= 2 for any tool call to be answered), plus `turn_text(ids)` and `tool_output_ids(text)` (envs/tasks/tool_use.py).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class ToolResult:
    """What a tool returns: its output text, or ok=False with `detail` when the tool itself failed."""

    output: str
    ok: bool = True
    detail: str = ""


class ToolFailure(Exception):
    """A tool could not run (not a wrong input: that is output). Raised by `run` or by `call`."""


@runtime_checkable
class Tool(Protocol):
    name: str
    tag: str  # called as <tag>text</tag>

    def run(self, text: str) -> str | ToolResult: ...


def parse_call(turn_text: str, tools: Sequence[Tool]) -> tuple[Tool, str] | None:
    """(tool, text) when the turn ENDS with a call `<tag>text</tag>` of one of `tools` (trailing whitespace
    allowed), else None: a call in the middle of a turn is just text, so a final answer is never cut short.

    `"<calc>12+3</calc>"` -> (calculator, "12+3"); `"<calc>1</calc> <answer>1</answer>"` -> None."""
    text = turn_text.rstrip()
    for tool in tools:
        m = re.search(rf"<{re.escape(tool.tag)}>(.*?)</{re.escape(tool.tag)}>$", text, re.DOTALL)
        if m:
            return tool, m.group(1)
    return None


def call(tool: Tool, text: str, clock: Callable[[], float] = time.perf_counter) -> tuple[ToolResult, float]:
    """Run `tool` on `text`: (its result, seconds it took). A tool that raises gives ok=False with the error."""
    t0 = clock()
    try:
        out = tool.run(text)
        result = out if isinstance(out, ToolResult) else ToolResult(str(out))
    except Exception as e:  # noqa: BLE001 - a failing tool fails the episode with what went wrong
        result = ToolResult("", ok=False, detail=f"{tool.name}: {type(e).__name__}: {e}")
    return result, clock() - t0


@dataclass(frozen=True)
class ToolCall:
    """One completed call: its model turn (0-based), the tool, and its latency (s)."""

    turn: int
    tool: str
    latency_s: float


@dataclass
class Episode:
    """One sample's turns so far. `mask[i]` is 1 for a model token and 0 for a tool-output token, over the
    response up to the last tool output (later tokens are the model's: see `full_mask`)."""

    mask: list[int] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)

    @property
    def turns(self) -> int:
        """Model turns completed or under way: one more than the calls answered."""
        return len(self.calls) + 1

    def full_mask(self, response_len: int) -> list[int]:
        """The mask over a response of `response_len` tokens; [] when no tool answered (every token is the
        model's, which is what an empty Trajectory.tool_mask means)."""
        if not self.calls:
            return []
        return self.mask + [1] * (response_len - len(self.mask))

    def extra(self) -> dict[str, str]:
        """The Trajectory.extra entries of this episode: turns, tool_calls, tool_latency_s (comma-separated)."""
        if not self.calls:
            return {}
        return {"turns": str(self.turns), "tool_calls": str(len(self.calls)),
                "tool_names": ",".join(c.tool for c in self.calls),
                "tool_latency_s": ",".join(f"{c.latency_s:.6f}" for c in self.calls)}

    @classmethod
    def from_row(cls, tool_mask: list[int], extra: dict[str, str]) -> Episode:
        """The episode a recorded trajectory (a partial-pool row) carries: its mask and completed calls."""
        n = int(extra.get("tool_calls", "0") or 0)
        names = (extra.get("tool_names") or "").split(",")
        lat = [float(x) for x in (extra.get("tool_latency_s") or "").split(",") if x]
        calls = [ToolCall(i, names[i] if i < len(names) else "", lat[i] if i < len(lat) else 0.0) for i in range(n)]
        mask = list(tool_mask)
        while mask and mask[-1] == 1:  # model tokens after the last tool output are the current turn's
            mask.pop()
        return cls(mask=mask, calls=calls)


def recorded_calls(response_ids: list[int], tool_mask: list[int], turn_text: Callable[[list[int]], str],
                   tools: Sequence[Tool]) -> list[tuple[str, list[int]]]:
    """The completed calls of a recorded response, in turn order: (the call's text, the output tokens the tool
    gave). A model turn is a run of mask 1, its answer the run of mask 0 after it; the last turn (no answer yet)
    is left out. `turn_text` decodes one turn (the task's)."""
    out, i, n = [], 0, len(tool_mask)
    while i < n:
        j = i
        while j < n and tool_mask[j] == 1:
            j += 1
        k = j
        while k < n and tool_mask[k] == 0:
            k += 1
        if k == j:
            break
        found = parse_call(turn_text(list(response_ids[i:j])), tools)
        out.append((found[1] if found else "", list(response_ids[j:k])))
        i = k
    return out


def turn_counts(extra: dict[str, str]) -> tuple[int, int, list[float]]:
    """(turns, tool calls, latencies) of a trajectory from its extra (1, 0, [] for a single-turn one)."""
    lat = [float(x) for x in (extra.get("tool_latency_s") or "").split(",") if x]
    return int(extra.get("turns", "1") or 1), int(extra.get("tool_calls", "0") or 0), lat


__all__ = ["Episode", "Tool", "ToolCall", "ToolFailure", "ToolResult", "call", "parse_call", "recorded_calls",
           "turn_counts"]
