"""The repairer on a real training run: the wedge's failure injected into a run of the real stack (control,
trainer, relays and rollout workers as OS processes, a Temporal dev server of the test's own, a local store).

The server is the test's own so that its control worker, which carries tests.wedge's DivergeOnce interceptor, is the
only one that runs the workflow: on the session's server an earlier test's stack polls the same queues, and the run's
updates could go to a control worker without it. Once the test drops the marker file, the live run issues a timer at
one update that no replay issues. The test then kills the control worker by pid; its supervisor starts a new one,
whose cold replay fails on every workflow task with `[TMPRL1100]`, as the chaos run's did. The new control worker's
repairer resets the run; the run finishes every step with no group lost and none consumed twice, and its status,
events and store say what happened."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from laminar.client.run_control import query_status, start_workflow
from laminar.client.settings import Settings
from laminar.contract import RunStatus
from laminar.drills.rules import groups_lost
from laminar.errors import LaminarError
from laminar.storage import keys
from laminar.storage.objects import open_store
from laminar.workers.launcher import LocalLauncher, plan_processes
from tests import wedge
from tests.fixtures.stack import small_config
from tests.fixtures.temporal import temporal_address
from tests.fixtures.waiting import async_wait_until

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 600


@pytest.mark.slow
async def test_a_training_run_wedged_like_the_chaos_run_is_reset_and_finishes(own_temporal_env, tmp_path):
    home = tmp_path / "home"
    marker = tmp_path / "diverge"
    settings = Settings.from_env({
        "LAMINAR_HOME": str(home), "LAMINAR_TEMPORAL_ADDRESS": temporal_address(own_temporal_env.client),
        "LAMINAR_STORE": (home / "store").as_uri(),
    })
    cfg = small_config("run.steps=100")  # long enough to go on past the divergence and the kill (steps take ~50 ms)
    procs = plan_processes(cfg, settings, home / "logs")
    for p in procs:
        p.env = {**p.env, "PYTHONPATH": str(ROOT)}
        if p.name == "control":
            p.env.update({"LAMINAR_WORKER_INTERCEPTORS": "tests.wedge:DivergeOnce", wedge.DIVERGE_FILE: str(marker),
                          "LAMINAR_REPAIR_SWEEP_S": "2"})
    launcher = LocalLauncher(procs)
    launcher.start_all()
    launcher.start_supervision()
    try:
        await start_workflow(own_temporal_env.client, cfg)
        run_id = cfg.run.run_id

        async def status() -> RunStatus:
            return await query_status(settings, run_id)

        async def at_step(n: int):
            st = await status()
            return st if st.step >= n else None

        await async_wait_until(lambda: at_step(4), RUN_TIMEOUT_S, "step 4", interval_s=0.5)
        marker.write_text("")
        await async_wait_until(lambda: not marker.exists(), 60, "the live run's divergent update")
        await async_wait_until(lambda: at_step(6), RUN_TIMEOUT_S, "step 6 after the divergence", interval_s=0.5)
        control = launcher.processes["control"]
        old_pid = control.pid
        os.kill(old_pid, signal.SIGKILL)  # its replacement replays the history cold: every task fails
        killed_at = time.time()

        async def reset_seen():
            try:
                st = await status()
            except LaminarError:  # wedged: the control worker cannot replay the run to answer
                return None
            return st if st.workflow_resets else None

        st = await async_wait_until(reset_seen, RUN_TIMEOUT_S, "the repairer's reset", interval_s=1.0)
        reset = st.workflow_resets[-1]
        print(f"reset {time.time() - killed_at:.1f}s after the kill: {reset}")
        assert "TMPRL1100" in reset.error and reset.reset_to < reset.bad_event_id
        assert reset.step_before >= reset.step_after > 0  # the trainer had gone past the point reset to
        assert any(e.kind == "workflow_reset" for e in st.events)

        final = await async_wait_until(lambda: _finished(status), RUN_TIMEOUT_S, "the run to finish", interval_s=1.0)
        assert final.step == cfg.run.steps
        assert final.groups_consumed_twice == 0
        assert groups_lost(final) == 0
        assert len(final.workflow_resets) == 1  # one wedge, one reset: the repair held
        store = open_store(settings.store_url)
        records = [json.loads(store.get(k)) for k in store.list(keys.workflow_resets_prefix(run_id))]
        assert [r["new_run_id"] for r in records] == [reset.new_run_id]
        log = (home / "logs" / "control.log").read_text()
        assert "workflow_reset" in log
        print(f"finished: step {final.step}, consumed {final.groups_consumed}, twice {final.groups_consumed_twice}, "
              f"steps redone {reset.step_before - reset.step_after}, steps_redone (trainer) {final.steps_redone}")
    finally:
        launcher.stop_all()


async def _finished(status) -> RunStatus | None:
    st = await status()
    return st if st.phase == "finished" else None
