"""The watchdog end to end: a run starved on purpose (its rollout workers stopped with SIGSTOP) shows what it
waits for in `laminar status` within run.stall_warn_s of going silent; resumed, the line clears, the run steps on,
and stopped, it ends with no group lost and none consumed twice.

Real parts only: the session's Temporal dev server and worker processes (tests/fixtures/stack.py), the status
query through client/run_control.py, and the real `laminar status` command as a subprocess.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from laminar.client.run_control import query_status, start_workflow
from laminar.contract import RunStatus
from laminar.drills.rules import groups_lost
from laminar.watchdog import stall_line
from tests.fixtures.stack import small_config
from tests.fixtures.waiting import async_wait_until

WARN_S = 5.0
# The status query is polled every 0.2 s and answers in well under a second; 3 s covers a loaded 2-core machine.
SLACK_S = 3.0
RUN_TIMEOUT_S = 300


def _rollout_pids(stack) -> list[int]:
    pids = [p.pid for name, p in stack.launcher.processes.items() if name.startswith("rollout-") and p.pid]
    assert pids, f"no rollout worker among {sorted(stack.launcher.processes)}"
    return pids


async def test_a_starved_run_shows_what_it_waits_for_and_clears_when_fed(stack):
    # Steps on the test stack take tens of milliseconds: a run of 12 steps finished before the test, polling for its
    # first step every 0.5 s, stopped the replicas (a clean-clone CI run), and no stall could follow. A long run,
    # stopped once fed again: rollout.max_ready_groups=6 lets the trainer take at most 3 more steps on groups
    # already complete once the replicas stop (and a step or two in flight), so it cannot end while they are stopped.
    cfg = small_config("run.steps=1000", f"run.stall_warn_s={WARN_S}")
    handle = await start_workflow(stack.client, cfg)
    run_id = cfg.run.run_id

    async def status() -> RunStatus:
        return await query_status(stack.settings, run_id)

    await async_wait_until(lambda: _stepped(status), RUN_TIMEOUT_S, "the first step", interval_s=0.5)
    pids = _rollout_pids(stack)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        async def stalled() -> tuple[RunStatus, str, float] | None:
            st = await status()
            line = stall_line(st, time.time())
            return (st, line, time.time()) if line else None

        st, line, seen_at = await async_wait_until(stalled, RUN_TIMEOUT_S, "the watchdog's line", interval_s=0.2)
        # silent since the later of: the replicas stopping, the last step (on groups already complete)
        silent_from = max(stopped_at, st.last_step_at or 0.0)
        print(f"watchdog line after {seen_at - silent_from:.2f}s of silence (step {st.step}): {line}")
        assert line.startswith("waits for replicas: "), line
        assert f"0 of {cfg.rollout.replicas} replicas reported in the last {WARN_S:g}s" in line
        assert seen_at - silent_from <= WARN_S + SLACK_S, (seen_at, silent_from, line)
        assert st.phase == "running" and st.step < cfg.run.steps
        # the workflow notices it too, at its next watchdog tick (every stall_warn_s / 2): one `stall` event
        async def noticed() -> RunStatus | None:
            st = await status()
            return st if any(e.kind == "stall" and e.subject == "replicas" for e in st.events) else None

        st = await async_wait_until(noticed, WARN_S / 2 + SLACK_S, "the workflow's stall event", interval_s=0.2)
        print(f"stall event after {time.time() - silent_from:.2f}s of silence")
        # the real command prints it too (the table wraps long cells, so compare without whitespace)
        env = {**os.environ, "LAMINAR_HOME": str(stack.home), "LAMINAR_TEMPORAL_ADDRESS": stack.settings.temporal_address,
               "LAMINAR_STORE": stack.settings.store_url, "PYTHONPATH": os.getcwd(), "COLUMNS": "300"}
        out = subprocess.run([sys.executable, "-m", "laminar.cli.main", "status", run_id], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        printed = "".join(out.stdout.split())
        assert "watchdog" in printed and "waitsforreplicas:" in printed and "replicasreportedinthelast" in printed, \
            out.stdout
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)

    async def cleared() -> RunStatus | None:
        st = await status()
        return st if stall_line(st, time.time()) is None else None

    fed = await async_wait_until(cleared, RUN_TIMEOUT_S, "the watchdog's line to clear", interval_s=0.5)
    await async_wait_until(lambda: _stepped(status, fed.step + 2), RUN_TIMEOUT_S, "steps after the stall",
                           interval_s=0.2)
    assert await handle.execute_update("stop", result_type=str) == "stopping"
    final: RunStatus = await handle.result(rpc_timeout=None)
    assert final.phase == "finished" and fed.step + 2 <= final.step < cfg.run.steps
    assert groups_lost(final) == 0 and final.groups_consumed_twice == 0
    # the workflow noticed the stall itself (one `stall` event per stall: the subject names what it waited for)
    stalls = [e for e in final.events if e.kind == "stall"]
    print(f"stall events: {stalls}; resumed and stopped: step {final.step}, lost {groups_lost(final)}")
    assert any(e.subject == "replicas" for e in stalls), final.events


async def _stepped(status, step: int = 1) -> bool:
    return (await status()).step >= step
