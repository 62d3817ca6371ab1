"""Record the golden histories that tests/test_replay_golden.py replays, from real runs with the current code.

    python -m tests.histories.record stream              # one scenario
    python -m tests.histories.record stream repack       # several, one stack
    python -m tests.histories.record all                 # every scenario
    python -m tests.histories.record --list

Starts its own dev stack (a SQLite-backed Temporal dev server and an S3 server, `laminar dev up --s3` without the
UI) on free ports in a fresh home, the worker processes a drill test uses (control, trainer, 2 relays, 2 rollout
workers with spare slots, faults allowed, supervised), runs each scenario as a small, fast run (the integration
tests' tiny config), checks the history shows what the scenario is for (the patch, activity or event it must
exercise), and writes it as JSON (the client's fetch_history, the format `temporal workflow show -o json`
writes) to tests/histories/. Only the servers and processes it started are stopped, by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle, WorkflowHistory

from laminar import contract
from laminar.client.connect import connect, store_for
from laminar.client.converter import DATA_CONVERTER
from laminar.client.run_control import ensure_pool, start_workflow
from laminar.client.settings import Settings
from laminar.config import RunConfig
from laminar.contract import (
    AddExperienceInput,
    ClaimPromptsInput,
    DrillInput,
    PoolStatus,
    RunStatus,
    ScaleInput,
    ScaleResult,
    SlotReport,
)
from laminar.devstack.stack import DevStack, free_port
from laminar.drills.command import run_drill
from laminar.workers.launcher import LocalLauncher, plan_processes
from tests.fixtures.stack import TEST_OVERRIDES, quiet_status
from tests.fixtures.waiting import async_wait_until
from tests.histories import (
    HISTORIES,
    MAX_FILE_BYTES,
    activity_types,
    count,
    event_name,
    patch_ids,
    update_names,
)

RUN_TIMEOUT_S = 300.0

# The stack's shape: 4 replicas on 2 hosts (repack's run), each rollout worker 2 + 1 spare slots so a drill's
# killed worker leaves its replicas somewhere to go (as tests/test_drills.py).
STACK_OVERRIDES = ["rollout.replicas=4"]
SPARE_SLOTS = 1
STREAM_MAX_STEPS = 40  # a stream run that has not bundled minibatch steps by then ends, and its recording fails
# The modelled engine with a long tail and the throughput benchmark's batch shape: several replicas drain the same
# version at once while newer ones exist, so repack pairs them up (tests/test_drills.py REPACK_OVERRIDES).
REPACK_OVERRIDES = ["rollout.engine=modelled", "trainer.engine=modelled", "modelled.response_p50_tokens=128",
                    "modelled.max_response_tokens=2048", "rollout.group_size=8", "rollout.max_inflight_groups=4",
                    "trainer.groups_per_step=16", "rollout.max_ready_groups=32", "rollout.repack=true",
                    "rollout.replicas=4", "run.steps=1000"]


# -- reading a history ------------------------------------------------------------------------------------------


def update_inputs(history: WorkflowHistory, name: str, cls: type) -> list:
    """The decoded inputs of every `name` update a history accepted."""
    found = []
    for e in history.events:
        req = e.workflow_execution_update_accepted_event_attributes.accepted_request
        if e.HasField("workflow_execution_update_accepted_event_attributes") and req.input.name == name:
            found += DATA_CONVERTER.payload_converter.from_payloads(list(req.input.args.payloads), [cls])
    return found


def require(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"recording failed: {what}; nothing written for this scenario (rerun it)")


# -- the recorder ------------------------------------------------------------------------------------------------


@dataclass
class Recorder:
    client: Client
    settings: Settings
    out: Path

    def config(self, name: str, *extra: str) -> RunConfig:
        return RunConfig.load(None, [*TEST_OVERRIDES, *extra]).with_run_id(f"golden-{name}")

    async def chain(self, handle: WorkflowHandle) -> list[WorkflowHistory]:
        """Every segment of a run, oldest first, following the continue-as-new events (no visibility lag)."""
        histories, run_id = [], handle.first_execution_run_id or handle.result_run_id
        while run_id:
            h = await self.client.get_workflow_handle(handle.id, run_id=run_id).fetch_history()
            histories.append(h)
            last = h.events[-1]
            run_id = (last.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
                      if last.HasField("workflow_execution_continued_as_new_event_attributes") else "")
        return histories

    def write(self, stem: str, history: WorkflowHistory) -> Path:
        events = json.loads(history.to_json())["events"]  # one event a line: small, and still greppable
        text = '{"events": [\n' + ",\n".join(json.dumps(e, separators=(",", ":")) for e in events) + "\n]}\n"
        require(len(text) <= MAX_FILE_BYTES, f"{stem}: {len(text)} bytes exceeds {MAX_FILE_BYTES}; make the run smaller")
        path = self.out / f"{stem}.json"
        path.write_text(text)
        print(f"wrote {path} ({len(history.events)} events, {len(text) // 1024} KB, "
              f"patches {sorted(patch_ids(history))})", flush=True)
        return path

    async def status(self, handle: WorkflowHandle) -> RunStatus:
        return await handle.query(contract.STATUS, result_type=RunStatus)

    async def wait_step(self, handle: WorkflowHandle, n: int) -> RunStatus:
        async def at_least() -> RunStatus | None:
            st = await self.status(handle)
            return st if st.step >= n else None
        return await async_wait_until(at_least, RUN_TIMEOUT_S, f"{handle.id} to reach step {n}", interval_s=0.2)

    async def stop(self, handle: WorkflowHandle) -> RunStatus:
        """Stop the run (unless it has finished already) and return its final status."""
        if (await handle.describe()).status == WorkflowExecutionStatus.RUNNING:
            await handle.execute_update(contract.STOP, result_type=str)
        return await asyncio.wait_for(handle.result(), RUN_TIMEOUT_S)


# -- the scenarios -----------------------------------------------------------------------------------------------


async def stream(rec: Recorder) -> list[Path]:
    """Stream mode, a batch of 4 groups in 4 minibatch steps, stopped once minibatch steps whose groups were all
    complete ran back to back in one train_steps activity (patch train-steps)."""
    cfg = rec.config("stream", "run.mode=stream", "trainer.groups_per_step=4", "trainer.minibatches=4",
                     "rollout.max_ready_groups=8", f"run.steps={STREAM_MAX_STEPS}")
    handle = await start_workflow(rec.client, cfg)

    async def bundled_or_closed() -> bool:  # the trainer ran behind generation at least once, or the run ended
        closed = (await handle.describe()).status != WorkflowExecutionStatus.RUNNING
        return closed or contract.TRAIN_STEPS in activity_types(await handle.fetch_history())
    await async_wait_until(bundled_or_closed, RUN_TIMEOUT_S, "a train_steps activity", interval_s=0.5)
    (h,) = await rec.chain(handle)
    require(contract.TRAIN_STEPS in activity_types(h), f"no train_steps activity in {STREAM_MAX_STEPS} steps")
    final = await rec.stop(handle)
    (h,) = await rec.chain(handle)
    require(final.phase == "finished", f"stream run ended {final.phase} at step {final.step}")
    require("train-steps" in patch_ids(h), "no train-steps patch marker")
    return [rec.write("training_run_stream", h)]


async def repack(rec: Recorder) -> list[Path]:
    """Laminar mode with rollout.repack on, stopped once a migration has been carried out (patch repack)."""
    cfg = rec.config("repack", *REPACK_OVERRIDES)
    handle = await start_workflow(rec.client, cfg)

    async def migrated() -> RunStatus | None:
        st = await rec.status(handle)
        return st if st.repacks > 0 else None
    await async_wait_until(migrated, RUN_TIMEOUT_S, "a repack migration", interval_s=0.2)
    final = await rec.stop(handle)
    (h,) = await rec.chain(handle)
    require(final.repacks > 0 and "repack" in patch_ids(h), f"repacks={final.repacks}, patches {patch_ids(h)}")
    # the migration travels in the replicas' claim_prompts updates: a source's hand-off, a destination's take
    claims = update_inputs(h, contract.CLAIM_PROMPTS, ClaimPromptsInput)
    require(any(c.handoff is not None for c in claims) and any(c.taken for c in claims),
            "no claim_prompts update carries a migration's hand-off and take")
    return [rec.write("training_run_repack", h)]


async def _continued_run(rec: Recorder, cfg) -> list[WorkflowHistory]:
    """Run cfg to its end and return every segment; it must have continued as new at least once."""
    handle = await start_workflow(rec.client, cfg)
    final: RunStatus = await asyncio.wait_for(handle.result(), RUN_TIMEOUT_S)
    histories = await rec.chain(handle)
    require(final.continued_as_new >= 1 and len(histories) == final.continued_as_new + 1,
            f"continued_as_new={final.continued_as_new}, {len(histories)} segments")
    require(event_name(histories[0].events[-1]) == "WORKFLOW_EXECUTION_CONTINUED_AS_NEW", "no ContinueAsNew")
    return histories


async def continue_as_new(rec: Recorder) -> list[Path]:
    """run.continue_as_new_every=2 in a 4-step run: the first segment ends in ContinueAsNew at step 2 (or a
    little later, as the trainer keeps stepping during the hand-over), the next one finishes the run."""
    cfg = rec.config("continue-as-new", "run.steps=4", "run.continue_as_new_every=2")
    histories = await _continued_run(rec, cfg)
    return [rec.write(f"training_run_continue_as_new_{i + 1}", h) for i, h in enumerate(histories)]


def activity_results(history: WorkflowHistory, cls: type) -> list:
    """The decoded results of every activity the history saw complete, as `cls` (those that decode as it)."""
    found = []
    for e in history.events:
        if e.HasField("activity_task_completed_event_attributes"):
            payloads = list(e.activity_task_completed_event_attributes.result.payloads)
            try:
                found += DATA_CONVERTER.payload_converter.from_payloads(payloads, [cls])
            except Exception:  # noqa: BLE001 - another activity's result
                continue
    return found


async def handover_keep(rec: Recorder) -> list[Path]:
    """As continue_as_new, with run.handover_keep=true: at the hand-over the replicas park
    with their groups in flight (nothing written out) and the next segment's first claims re-attach them; the state
    goes over as compact lease columns (patch `compact-state`, workflows/carry.py)."""
    from laminar.contract import RolloutReplicaResult

    cfg = rec.config("handover-keep", "run.steps=4", "run.continue_as_new_every=2", "run.handover_keep=true")
    histories = await _continued_run(rec, cfg)
    require({"compact-state", "handover-keep"} <= patch_ids(histories[0]), "no compact-state or handover-keep marker")
    parked = [r for r in activity_results(histories[0], RolloutReplicaResult) if r.kept >= 0]
    require(len(parked) >= 1, "no replica parked at the hand-over")
    resumed = [c for c in update_inputs(histories[1], contract.CLAIM_PROMPTS, ClaimPromptsInput) if c.first_claim]
    require(bool(resumed), "no first claim in the continued segment")
    return [rec.write(f"training_run_handover_keep_{i + 1}", h) for i, h in enumerate(histories[:2])]


async def handover_cap(rec: Recorder) -> list[Path]:
    """As handover_keep, recorded since the wait for the trainer ends at the run's update budget (patch
    `handover-cap`, workflows/timeouts.py updates_budget): the segment that hands over."""
    cfg = rec.config("handover-cap", "run.steps=4", "run.continue_as_new_every=2", "run.handover_keep=true")
    histories = await _continued_run(rec, cfg)
    require("handover-cap" in patch_ids(histories[0]), "no handover-cap marker in the segment that hands over")
    return [rec.write("training_run_handover_cap", histories[0])]


async def handover_route(rec: Recorder) -> list[Path]:
    """As handover_keep, with the rollout workers' own queues: each replica parked at the hand-over names its process's
    queue in its result, and the continued segment starts it there (patch `handover-route`), where it is adopted."""
    from laminar.contract import ROLLOUT_QUEUE, RolloutReplicaResult

    cfg = rec.config("handover-route", "run.steps=4", "run.continue_as_new_every=2", "run.handover_keep=true")
    histories = await _continued_run(rec, cfg)
    parked = [r for r in activity_results(histories[0], RolloutReplicaResult) if r.kept >= 0]
    require(bool(parked) and all(r.queue.startswith(f"{ROLLOUT_QUEUE}@") for r in parked),
            f"no replica parked naming its process's queue: {parked}")
    require("handover-route" in patch_ids(histories[1]), "no handover-route marker in the continued segment")
    queues = [e.activity_task_scheduled_event_attributes.task_queue.name for e in histories[1].events
              if e.HasField("activity_task_scheduled_event_attributes")
              and e.activity_task_scheduled_event_attributes.activity_type.name == contract.RUN_ROLLOUT_REPLICA]
    require(sorted(queues) == sorted(r.queue for r in parked), f"routed {queues}, parked on {[r.queue for r in parked]}")
    return [rec.write("training_run_handover_route", histories[1])]


async def search_attributes(rec: Recorder) -> list[Path]:
    """A run started with the search attributes (the dev stack registers them; patch search-attributes) that goes
    through every phase: starting, running, paused (pause update), running (resume), stopping (stop), finished."""
    cfg = rec.config("search-attributes", "run.steps=1000")
    handle = await start_workflow(rec.client, cfg)
    await rec.wait_step(handle, 1)
    assert await handle.execute_update(contract.PAUSE, result_type=str) == "paused"
    await async_wait_until(lambda: quiet_status(handle), RUN_TIMEOUT_S, "the run to be quiet after pause")
    assert await handle.execute_update(contract.RESUME, result_type=str) == "running"
    paused_at = (await rec.status(handle)).step
    await rec.wait_step(handle, paused_at + 1)
    await rec.stop(handle)
    (h,) = await rec.chain(handle)
    require("search-attributes" in patch_ids(h), "no search-attributes patch marker")
    require(count(h, "UPSERT_WORKFLOW_SEARCH_ATTRIBUTES") >= 4, "fewer than 4 search attribute upserts")
    require({contract.PAUSE, contract.RESUME, contract.STOP} <= set(update_names(h)),
            f"updates {sorted(set(update_names(h)))}")
    return [rec.write("training_run_search_attributes", h)]


async def _drill(rec: Recorder, name: str, fault: str) -> list[Path]:
    cfg = rec.config(name, "run.steps=1000", "trainer.heartbeat_timeout_s=5", "trainer.checkpoint_every=4")
    handle = await start_workflow(rec.client, cfg)
    st = await rec.wait_step(handle, 1)
    inp = DrillInput(run_id=cfg.run.run_id, drill_id=fault, fault=fault, at_step=st.step + 1, timeout_s=180.0)
    report = await run_drill(rec.settings, inp)
    await rec.stop(handle)
    require(report.recovered and report.groups_lost == 0, f"the drill did not recover: {report}")
    drill = await rec.client.get_workflow_handle(f"drill/{cfg.run.run_id}/{fault}").fetch_history()
    require(event_name(drill.events[-1]) == "WORKFLOW_EXECUTION_COMPLETED", "the drill workflow did not complete")
    return [rec.write(f"recovery_drill_{fault}", drill)]


async def drill_rollout(rec: Recorder) -> list[Path]:
    """RecoveryDrillWorkflow, rollout fault: plan, inject_fault on the rollout worker's fault queue, observe."""
    return await _drill(rec, "drill-rollout", "rollout")


async def drill_store(rec: Recorder) -> list[Path]:
    """RecoveryDrillWorkflow, store fault: plan, interrupt_store on the drill's own queue, observe."""
    return await _drill(rec, "drill-store", "store")


async def failed_groups(rec: Recorder) -> list[Path]:
    """Sync mode, a user task (package.module:Class, JSONL prompts) whose failing rows end as failed groups: the
    add_experience updates carry them, and a batch whose groups all failed trains as an empty step."""
    from tests.fixtures.user_task import PROMPTS, TASK_NAME

    cfg = rec.config("failed-groups", "run.mode=sync", f"task.name={TASK_NAME}", f"task.prompts={PROMPTS}",
                     "task.reward_timeout_s=0.5", "task.max_group_retries=1", 'task.params={"hang_s": 20.0}',
                     "run.steps=6")
    handle = await start_workflow(rec.client, cfg)
    final: RunStatus = await asyncio.wait_for(handle.result(), RUN_TIMEOUT_S)
    (h,) = await rec.chain(handle)
    reports = update_inputs(h, contract.ADD_EXPERIENCE, AddExperienceInput)
    require(final.phase == "finished" and final.groups_failed >= 4, f"{final.phase}, groups_failed={final.groups_failed}")
    require(any(r.failed and not r.segment.group_ids for r in reports), "no add_experience with failed groups only")
    return [rec.write("training_run_failed_groups", h)]


async def watchdog(rec: Recorder) -> list[Path]:
    """A 4-step run with run.stall_warn_s=2: the watchdog's timer (patch `watchdog`) fires every second."""
    cfg = rec.config("watchdog", "run.steps=4", "run.stall_warn_s=2")
    handle = await start_workflow(rec.client, cfg)
    final: RunStatus = await asyncio.wait_for(handle.result(), RUN_TIMEOUT_S)
    (h,) = await rec.chain(handle)
    require(final.phase == "finished", f"{final.phase}")
    require("watchdog" in patch_ids(h), "no watchdog patch marker")
    require(count(h, "TIMER_FIRED") >= 1, "no watchdog timer fired")
    return [rec.write("training_run_watchdog", h)]


async def scale(rec: Recorder) -> list[Path]:
    """`laminar scale` 2 -> 4 -> 2 replicas while the run trains (patch scale): the new replicas claim and report,
    the removed ones are answered with a hand-over, return, and their unfinished groups go back to the pool."""
    cfg = rec.config("scale", "rollout.replicas=2", "run.steps=1000")
    handle = await start_workflow(rec.client, cfg)
    for target in (4, 2):
        st = await rec.wait_step(handle, 1)
        res = await handle.execute_update(contract.SCALE, ScaleInput(replicas=target), result_type=ScaleResult)
        require(res.replicas_target == target, f"scale to {target} answered {res}")

        async def settled(target: int = target, after: int = st.step) -> RunStatus | None:
            now = await rec.status(handle)
            return now if now.replicas_running == target and now.step > after else None
        await async_wait_until(settled, RUN_TIMEOUT_S, f"{target} replicas running and a step", interval_s=0.2)
    final = await rec.stop(handle)
    (h,) = await rec.chain(handle)
    require("scale" in patch_ids(h), "no scale patch marker")
    require(contract.SCALE in update_names(h), f"updates {sorted(set(update_names(h)))}")
    require(final.groups_consumed_twice == 0, f"groups_consumed_twice={final.groups_consumed_twice}")
    return [rec.write("training_run_scale", h)]


async def pool(rec: Recorder) -> list[Path]:
    """Two runs asking 2 replicas each on a slot pool of 3 slots (patch slot-pool): the first is granted 2, the second
    1; the first stops and leaves, the second is granted 2 and starts its second replica; a `scale` to 1 lowers its
    ask and retires one; stopped. Records the second run and the pool (still running: it outlives its runs)."""
    pool_id = await ensure_pool(rec.client, SlotReport("golden", 3, ["modelled", "torch"]))

    def granted(handle: WorkflowHandle, n: int, running: int, step: int = 1) -> Callable[[], Awaitable[RunStatus | None]]:
        async def check() -> RunStatus | None:
            st = await rec.status(handle)
            return st if (st.replicas_granted, st.replicas_running) == (n, running) and st.step >= step else None
        return check
    a = await start_workflow(rec.client, rec.config("pool-a", "rollout.replicas=2", "run.steps=1000"), pool_id)
    await async_wait_until(granted(a, 2, 2, 0), RUN_TIMEOUT_S, "run a granted 2 (alone)", interval_s=0.2)
    b = await start_workflow(rec.client, rec.config("pool-b", "rollout.replicas=2", "run.steps=1000"), pool_id)
    await async_wait_until(granted(a, 2, 2), RUN_TIMEOUT_S, "run a granted 2 and a step", interval_s=0.2)
    st = await async_wait_until(granted(b, 1, 1), RUN_TIMEOUT_S, "run b granted 1 and a step", interval_s=0.2)
    require(st.grant_note == "granted 1 of 2 asked: 2 runs share 3 slots", f"grant note {st.grant_note!r}")
    await rec.stop(a)
    await async_wait_until(granted(b, 2, 2, st.step + 1), RUN_TIMEOUT_S, "run b granted 2 and a step", interval_s=0.2)
    res = await b.execute_update(contract.SCALE, ScaleInput(replicas=1), result_type=ScaleResult)
    require(res.replicas_target == 1 and len(res.removed) == 1, f"scale to 1 answered {res}")
    final = await rec.stop(b)
    (h,) = await rec.chain(b)
    require("slot-pool" in patch_ids(h), "no slot-pool patch marker")
    require(count(h, "WORKFLOW_EXECUTION_SIGNALED") >= 2, "fewer than two grants signalled")
    require(final.groups_consumed_twice == 0, f"groups_consumed_twice={final.groups_consumed_twice}")
    handle = rec.client.get_workflow_handle(pool_id)

    async def both_left() -> PoolStatus | None:
        p = await handle.query(contract.POOL_STATUS, result_type=PoolStatus)
        return p if not p.runs else None
    await async_wait_until(both_left, RUN_TIMEOUT_S, "both runs to leave the pool", interval_s=0.2)
    ph = await handle.fetch_history()
    await handle.terminate(reason="recorded")
    return [rec.write("training_run_pool", h), rec.write("slot_pool", ph)]


def _most_in_flight(h) -> int:
    """The most train_step activities in flight at once in a history."""
    in_flight: set[int] = set()
    most = 0
    for e in h.events:
        if e.HasField("activity_task_scheduled_event_attributes") and \
                e.activity_task_scheduled_event_attributes.activity_type.name == contract.TRAIN_STEP:
            in_flight.add(e.event_id)
            most = max(most, len(in_flight))
        elif e.HasField("activity_task_completed_event_attributes"):
            in_flight.discard(e.activity_task_completed_event_attributes.scheduled_event_id)
    return most


async def train_ahead(rec: Recorder) -> list[Path]:
    """A 10-step laminar run (patch train-ahead): a trainer step scheduled while the one before it ran, and reports
    that carry the replica's next claim (add_experience with `claim`)."""
    cfg = rec.config("train_ahead", "run.steps=10")
    handle = await start_workflow(rec.client, cfg)
    final: RunStatus = await asyncio.wait_for(handle.result(), RUN_TIMEOUT_S)
    (h,) = await rec.chain(handle)
    require(final.phase == "finished" and final.groups_consumed_twice == 0, f"{final.phase}")
    require("train-ahead" in patch_ids(h), "no train-ahead patch marker")
    require(_most_in_flight(h) >= 2, "no train_step scheduled while another was in flight")
    reports = update_inputs(h, contract.ADD_EXPERIENCE, AddExperienceInput)
    require(any(r.claim is not None for r in reports), "no add_experience that carries a claim")
    return [rec.write("training_run_train_ahead", h)]


async def train_ahead_2(rec: Recorder) -> list[Path]:
    """An 8-step laminar run, 4 replicas (patch train-ahead-2): train_step activities scheduled while two others were
    in flight (the running step and one behind it)."""
    cfg = rec.config("train_ahead_2", "run.steps=8", "rollout.replicas=4")
    handle = await start_workflow(rec.client, cfg)
    final: RunStatus = await asyncio.wait_for(handle.result(), RUN_TIMEOUT_S)
    (h,) = await rec.chain(handle)
    require(final.phase == "finished" and final.groups_consumed_twice == 0, f"{final.phase}")
    require("train-ahead-2" in patch_ids(h), "no train-ahead-2 patch marker")
    require(_most_in_flight(h) == 3, f"at most {_most_in_flight(h)} train_step activities in flight at once")
    return [rec.write("training_run_train_ahead_2", h)]


async def eval_rounds(rec: Recorder) -> list[Path]:
    """A 4-step math run with eval.at_start and eval.at_end (patch eval-rounds): claims that carry eval leases and
    results, two rounds closed and recorded by `record_eval` activities, the end waiting for the last round."""
    cfg = rec.config("eval_rounds", "run.steps=4", "task.name=math", "rollout.max_new_tokens=8", "eval.size=6",
                     "eval.at_start=true", "eval.at_end=true")
    handle = await start_workflow(rec.client, cfg)
    final: RunStatus = await asyncio.wait_for(handle.result(), RUN_TIMEOUT_S)
    (h,) = await rec.chain(handle)
    require(final.phase == "finished" and [s.policy_version for s in final.eval_done] == [0, 4]
            and all(s.recorded for s in final.eval_done), f"{final.phase} {final.eval_done}")
    require("eval-rounds" in patch_ids(h), "no eval-rounds patch marker")
    records = [e for e in h.events if e.HasField("activity_task_scheduled_event_attributes")
               and e.activity_task_scheduled_event_attributes.activity_type.name == contract.RECORD_EVAL]
    require(len(records) == 2, f"{len(records)} record_eval activities")
    return [rec.write("training_run_eval_rounds", h)]


SCENARIOS: dict[str, Callable[[Recorder], Awaitable[list[Path]]]] = {
    "stream": stream, "repack": repack, "continue_as_new": continue_as_new, "search_attributes": search_attributes,
    "handover_keep": handover_keep,
    "handover_cap": handover_cap,
    "handover_route": handover_route,
    "drill_rollout": drill_rollout, "drill_store": drill_store, "failed_groups": failed_groups,
    "watchdog": watchdog,
    "scale": scale,
    "pool": pool,
    "train_ahead": train_ahead,
    "train_ahead_2": train_ahead_2,
    "eval_rounds": eval_rounds,
}


# -- the stack ---------------------------------------------------------------------------------------------------


async def record(names: list[str], out: Path, home: Path) -> list[Path]:
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(var, None)  # the dev stack's S3 server only: never a real account
    dev = DevStack(home)
    dev.up(s3=True, port=free_port(), ui=False)
    launcher = None
    try:
        settings = Settings.from_env({"LAMINAR_HOME": str(home), "LAMINAR_LOG_LEVEL": "info"})
        store_for(settings)  # sets the dev S3 server's credentials, which the worker processes inherit
        stack_cfg = RunConfig.load(None, [*TEST_OVERRIDES, *STACK_OVERRIDES])
        launcher = LocalLauncher(plan_processes(stack_cfg, settings, home / "logs", spare_slots=SPARE_SLOTS,
                                                allow_faults=True))
        launcher.start_all()
        launcher.start_supervision(interval_s=0.2)
        rec = Recorder(await connect(settings), settings, out)
        written = []
        for name in names:
            t0 = time.monotonic()
            print(f"recording {name} ...", flush=True)
            written += await SCENARIOS[name](rec)
            print(f"{name}: {time.monotonic() - t0:.0f} s", flush=True)
        return written
    finally:
        if launcher is not None:
            launcher.stop_all()
        dev.down()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.histories.record", description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help=f"scenarios: {', '.join(SCENARIOS)}, or all")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--out", type=Path, default=HISTORIES, help="where to write the histories (default: %(default)s)")
    p.add_argument("--keep", action="store_true", help="keep the stack's home (logs, SQLite, store) afterwards")
    args = p.parse_args(argv)
    if args.list or not args.names:
        for name, fn in SCENARIOS.items():
            print(f"{name:18} {' '.join((fn.__doc__ or '').split())}")
        return 0
    names = list(SCENARIOS) if args.names == ["all"] else args.names
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {', '.join(unknown)}; one of {', '.join(SCENARIOS)}, or all")
    home = Path(tempfile.mkdtemp(prefix="laminar-record-"))
    try:
        asyncio.run(record(names, args.out, home))
    finally:
        if args.keep:
            print(f"kept {home}", file=sys.stderr)
        else:
            shutil.rmtree(home, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
