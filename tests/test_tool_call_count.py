"""reporting/tool_calls.py counts calls run twice from real log files: each written by a real process with the
project's logger (laminar.logs, console and JSON formats), as a run's replicas write theirs."""

from __future__ import annotations

import subprocess
import sys

from laminar.reporting.tool_calls import ToolCallCount, count_tool_calls

_WRITER = """
import sys
from laminar.logs import configure_logging, get_logger
configure_logging(sys.argv[1], "info", open(sys.argv[2], "w"))
log = get_logger("laminar.services.rollout.batch")
for group, sample, turn, sha in {events!r}:
    if group == "RETRY":
        log.warning("group_retried", group_id=sample, reason="sandbox", attempt=1)
    else:
        log.info("tool_executed", group_id=group, sample=sample, turn=turn, tool="calc", ok=True, latency_s=1e-05,
                 call_sha=sha)
log.info("pool_flushed", groups=3)
"""


def _write(path, fmt, events):
    subprocess.run([sys.executable, "-c", _WRITER.format(events=events), fmt, str(path)], check=True)


def test_calls_run_twice_are_counted_across_processes_and_formats(tmp_path):
    logs = tmp_path / "logs" / "run-1"
    logs.mkdir(parents=True)
    # replica 0 (console): g1/0/0 once; g2/1/0 once; g3/0/0 once, then its group is retried after a failure
    _write(logs / "rollout-0.log", "console", [("run-1/g1", 0, 0, "aaa"), ("run-1/g2", 1, 0, "bbb"),
                                                ("run-1/g3", 0, 0, "ccc"), ("RETRY", "run-1/g3", 0, "")])
    # its next incarnation or another replica (JSON): g2/1/0 again (a rerun), g3/0/0 again (the failure's
    # retry), g2/1/1 (a new turn: a different key), g1/0/0 with another call text (a different key)
    _write(logs / "rollout-1.log", "json", [("run-1/g2", 1, 0, "bbb"), ("run-1/g3", 0, 0, "ccc"),
                                             ("run-1/g2", 1, 1, "ddd"), ("run-1/g1", 0, 0, "eee")])
    # 3 + 4 = 7 executions of 5 keys (aaa, bbb, ccc, ddd, eee): bbb twice (1 rerun), ccc twice after its
    # group was retried (1 after a failure)
    assert count_tool_calls(tmp_path / "logs" / "run-1") == ToolCallCount(7, 5, 1, 1)


def test_a_run_without_tool_calls_counts_nothing(tmp_path):
    _write(tmp_path / "trainer.log", "console", [])
    assert count_tool_calls(tmp_path) == ToolCallCount(0, 0, 0, 0)
