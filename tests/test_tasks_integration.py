"""A user task, named as "package.module:Class" with a JSONL prompt file, run end to end on the real stack (dev
server, worker processes, torch engine, relays, local store). Four of its twelve prompt rows make the async
reward fail (raise, hang past task.reward_timeout_s, NaN, a string): each such group is retried, then dropped
and counted, with its reason and prompt id logged, while the run goes on; no failed group is ever written to
an experience segment, so none is trained on."""

from __future__ import annotations

import math
import re

import pytest

from laminar.client.run_control import start_workflow
from laminar.contract import RunStatus
from laminar.envs.tasks.prompt_file import FilePrompts
from laminar.storage import keys
from laminar.storage.trajectories import _from_parquet
from tests.fixtures.stack import small_config
from tests.fixtures.user_task import PROMPTS, REASON, TASK_NAME

RETRIES = 1  # each failing group: 2 tries, then dropped


@pytest.mark.parametrize("mode", ["laminar", "sync"])
async def test_a_user_task_with_a_prompt_file_runs_and_failed_groups_are_dropped_not_trained(stack, mode):
    steps = 8
    cfg = small_config(f"task.name={TASK_NAME}", f"task.prompts={PROMPTS}", "task.reward_timeout_s=0.5",
                       f"task.max_group_retries={RETRIES}", 'task.params={"hang_s": 20.0}', f"run.steps={steps}",
                       f"run.mode={mode}")
    b = cfg.trainer.groups_per_step
    source = FilePrompts(PROMPTS, seed=cfg.run.seed)  # the task's prompt order
    handle = await start_workflow(stack.client, cfg)
    final: RunStatus = await handle.result(rpc_timeout=None)

    # the run went on: every step ran, on complete groups only
    assert final.phase == "finished" and final.step == steps and final.groups_consumed_twice == 0
    if mode == "laminar":  # the oldest ready groups: 16 good ones (the first two passes over the 8 good rows,
        # so every failing row of the first pass was leased and dropped long before the end)
        assert final.groups_consumed == steps * b
    else:  # sync trains exactly batch k = prompts 2k, 2k+1, short of its failed groups: with seed 0, prompts
        # 4, 6, 10, 11 and 15 of 0..15 are failing rows, so 16 - 5 = 11 groups (step 5's batch is empty)
        assert final.groups_consumed == sum("fail" not in source.row(p).metadata for p in range(steps * b)) == 11
    # each failure mode ended as a failed group with its reason, after 1 + RETRIES tries
    assert {f.reason for f in final.failures} == set(REASON.values())
    assert final.groups_failed == len(final.failures) >= 4  # <= 20 failures: the status keeps them all
    assert all(f.attempts == 1 + RETRIES for f in final.failures)
    assert all(REASON[source.row(f.prompt_id).metadata["fail"]] == f.reason for f in final.failures)
    assert all(source.row(f.prompt_id).id == f.source_id for f in final.failures)
    # every prompt leased is accounted for: generated, failed, or still leased
    assert final.prompts_issued == (final.groups_generated + final.groups_failed + final.open_leases
                                    + final.returned_leases)

    # no failed group was ever written as experience (so none was trained on as zero), and every reward is a number
    rows = [t for key in stack.store.list(keys.experience_prefix(cfg.run.run_id))
            for t in _from_parquet(stack.store.get(key), key)]
    assert rows and {t.group_id for t in rows}.isdisjoint({f.group_id for f in final.failures})
    assert all("fail" not in source.row(t.prompt_id).metadata for t in rows)
    assert all(math.isfinite(t.reward) and 0.0 <= t.reward <= 1.0 for t in rows)

    # the rollout workers logged each drop with its reason and prompt id (console lines: key=value)
    dropped = set()
    for path in (stack.home / "logs").glob("rollout-*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if " group_failed " in line and f"run_id={cfg.run.run_id}" in line:
                field = dict(re.findall(r"(group_id|reason|prompt_id)=(\S+)", line))
                dropped.add((field["group_id"], field["reason"], int(field["prompt_id"])))
    assert dropped == {(f.group_id, f.reason, f.prompt_id) for f in final.failures}
