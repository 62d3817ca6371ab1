"""The throughput changes on the real stack (issue 16): complete groups are reported as they complete,
and every process writes its time breakdown for the run summary."""

from __future__ import annotations

import asyncio

from laminar import contract
from laminar.client.run_control import start_workflow
from laminar.contract import RunStatus
from laminar.reporting.summary import build_profile
from laminar.services.rollout import HEARTBEAT_EVERY_S
from tests.fixtures.stack import small_config

RESULT_TIMEOUT_S = 240


async def test_groups_are_reported_as_they_complete_and_every_process_profiles_the_run(stack):
    cfg = small_config("rollout.flush_interval_s=600")
    handle = await start_workflow(stack.client, cfg)
    final: RunStatus = await asyncio.wait_for(handle.result(rpc_timeout=None), RESULT_TIMEOUT_S)
    assert final.phase == "finished" and final.step == cfg.run.steps
    assert final.groups_consumed_twice == 0
    # flush_interval_s=600: a replica that reported complete groups only every flush interval (the first at
    # once, the next after 600 s) kept claiming and generating without reporting, until a hand-over made it
    # report everything (measured: 496 groups in one segment). Reported as they complete, groups queue behind
    # back-pressure instead: leases stop once max_ready_groups (6) are ready, so at most 6 + the groups
    # in flight when that happened (2 replicas x 2) are ready at the end; none is left over from a stall.
    bound = cfg.rollout.max_ready_groups + cfg.rollout.replicas * cfg.rollout.max_inflight_groups
    assert final.groups_generated == final.groups_consumed + final.ready_groups
    assert final.ready_groups <= bound, f"{final.ready_groups} groups ready at the end (at most {bound})"

    profile = build_profile(stack.store, cfg.run.run_id, {"trainer": 1.0})
    # both replicas wrote a breakdown when they returned (more with retries or hand-overs)
    assert profile["rollout_incarnations"] >= cfg.rollout.replicas
    rollout = profile["rollout"]
    # every consumed group was generated and reported: 6 steps x 2 groups x 4 samples, at least 1 token each,
    # generated while admitting or while draining for a version load
    tokens = sum(rollout["buckets"].get(b, {"n": 0})["n"] for b in ("generate", "drain"))
    assert tokens >= cfg.run.steps * cfg.trainer.groups_per_step * cfg.rollout.group_size
    assert rollout["latency"]["report"]["n"] >= 1 and rollout["latency"]["claim"]["n"] >= 1
    # the loop heartbeats at most every HEARTBEAT_EVERY_S: over W seconds of replica wall time (summed over
    # the incarnations) at most W / 0.2 beats plus one at each incarnation's start (and one for clock
    # rounding); a beat on every engine step (milliseconds each) would be many times more
    beats_max = rollout["wall_s"] / HEARTBEAT_EVERY_S + 2 * profile["rollout_incarnations"]
    assert rollout["buckets"]["heartbeat"]["n"] <= beats_max
    # the trainer process profiles this run only (it served other runs in this session): one compute per step
    assert profile["trainer"]["buckets"]["compute"]["n"] == cfg.run.steps
    # one queue wait per train activity: a TRAIN_STEPS activity runs several steps after a single wait (train-ahead
    # batches the steps that are ready), so count the activities the workflow scheduled, not the steps
    history = await handle.fetch_history()
    train_activities = sum(1 for e in history.events
                           if e.HasField("activity_task_scheduled_event_attributes")
                           and e.activity_task_scheduled_event_attributes.activity_type.name
                           in (contract.TRAIN_STEP, contract.TRAIN_STEPS))
    assert 1 <= train_activities <= cfg.run.steps
    assert profile["trainer"]["latency"]["train_step_schedule_to_start"]["n"] == train_activities
    assert profile["cpu_s"] == {"trainer": 1.0}
