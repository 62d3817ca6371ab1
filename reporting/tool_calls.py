"""Tool calls run twice, counted from a run's process logs (the `tool_executed` events of every replica and
incarnation, services/rollout/batch.py): the measure behind the drill report's `tool_calls_rerun`.

A call is keyed (group, sample, turn, call_sha). `count_tool_calls(log_dir)` reads every `*.log` file under the
run's log directory (`$LAMINAR_HOME/logs/<run_id>/`, the local launcher's; console or JSON lines) and returns
`ToolCallCount`: `executions`, distinct `keys`, `rerun` (second and later runs of a key whose group was never
retried after a failed reward or tool) and `rerun_after_failure` (those of groups that were: the failure's
retry regenerates the group from its prompt on purpose, docs/guides/tools.md). With `run_id`, only that run's
events count (workers shared by several runs write one log; events of logs older than the field count too). The
count covers what is in
the logs when it is taken; a run on Ray keeps its logs on its nodes, so it is not counted there.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_FIELD = re.compile(r"(\w+)=('[^']*'|\"[^\"]*\"|\S+)")


@dataclass(frozen=True)
class ToolCallCount:
    """Calls in a run's logs: `executions` of `keys` distinct calls; runs beyond the first, split by cause."""

    executions: int
    keys: int
    rerun: int
    rerun_after_failure: int


def count_tool_calls(log_dir: str | Path, run_id: str | None = None) -> ToolCallCount:
    """Count the `tool_executed` events under `log_dir`, of run `run_id` if given (module docstring)."""
    runs: Counter[tuple[str, str, str, str]] = Counter()
    retried: set[str] = set()
    for path in sorted(Path(log_dir).rglob("*.log")):
        with open(path, errors="replace") as f:
            for line in f:
                if "tool_executed" not in line and "group_retried" not in line:
                    continue
                event = _parse(line)
                if run_id is not None and event.get("run_id", run_id) != run_id:
                    continue
                if event.get("event") == "tool_executed":
                    runs[(event.get("group_id", ""), event.get("sample", ""), event.get("turn", ""),
                          event.get("call_sha", ""))] += 1
                elif event.get("event") == "group_retried":
                    retried.add(event.get("group_id", ""))
    again = {key: n - 1 for key, n in runs.items() if n > 1}
    after_failure = sum(n for key, n in again.items() if key[0] in retried)
    return ToolCallCount(sum(runs.values()), len(runs), sum(again.values()) - after_failure, after_failure)


def _parse(line: str) -> dict[str, str]:
    """One log line as {field: text}: a JSON line, or structlog's console line (`... [info ] event k=v ...`)."""
    line = line.strip()
    if line.startswith("{"):
        try:
            return {k: str(v) for k, v in json.loads(line).items()}
        except ValueError:
            return {}
    head, _, rest = line.partition("] ")
    words = rest.split(None, 1)
    if not words:
        return {}
    fields = {k: v.strip("'\"") for k, v in _FIELD.findall(words[1] if len(words) > 1 else "")}
    return {"event": words[0], **fields}
