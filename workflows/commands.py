"""The training run's thin Temporal side: every activity it schedules and every signal it sends, with their options,
and the primitives (workflow time, timers, conditions, tasks) its deciding classes wait and log with.

The deciding classes (workflows/relay_chain.py, trainer.py, replica_set.py, grants.py, status.py) call Temporal only
through what they are given: a `Runtime` and, for the commands of their own, one of the functions below, so a test
drives them with a fake runtime and fake commands (tests/fixtures/fake_runtime.py). Nothing here decides anything:
the order in which the workflow calls these is the order of its commands (tests/test_replay_golden.py replays the
recorded ones).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutType
from temporalio.exceptions import TimeoutError as ActivityTimeoutError

from laminar import contract
from laminar.config import RunConfig
from laminar.contract import (
    ROLLOUT_QUEUE,
    TRAINER_QUEUE,
    PoolAsk,
    RecordEvalInput,
    RepublishInput,
    RolloutReplicaInput,
    RolloutReplicaResult,
    RunRelayInput,
    TrainerInitInput,
    TrainerInitResult,
    TrainStepInput,
    TrainStepResult,
    TrainStepsInput,
    relay_queue,
)
from laminar.errors import REPLICA_NOT_PARKED
from laminar.refs import CheckpointRef
from laminar.workflows import timeouts


class Runtime:
    """The workflow's clock, timers, conditions and tasks. Tests pass an object with the same methods and a logger
    (tests/fixtures/fake_runtime.py)."""

    logger: logging.LoggerAdapter = workflow.logger

    def now(self) -> float:
        return workflow.time()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        return asyncio.create_task(coro)

    async def sleep(self, seconds: float) -> None:
        await workflow.sleep(timedelta(seconds=seconds))

    async def wait(self, condition: Callable[[], bool], timeout: timedelta | None = None) -> None:
        """Until condition() holds; TimeoutError after timeout (a timer command) when one is given."""
        await workflow.wait_condition(condition, timeout=timeout)


def fail_run_if_permanent(e: ActivityError, what: str) -> None:
    """A trainer activity retries without limit, so its failure reaching the workflow is permanent (a
    non-retryable ApplicationError: bad model path, no checkpoint that verifies, ...). Fail the run with
    that error's own type and message, not the generic "Activity task failed"; a cancellation passes."""
    cause = e.cause
    if isinstance(cause, ApplicationError) and cause.non_retryable:
        raise ApplicationError(f"{what} failed: {cause.message}", type=cause.type, non_retryable=True) from e


# -- relays ----------------------------------------------------------------------------------

async def run_relay(run_id: str, cfg: RunConfig, relay_id: str, generation: int) -> None:
    """One `run_relay` activity, until it returns or fails: its heartbeat timeout is the relay's failure detector,
    and the server never retries it (the watcher takes the relay out of the chain first)."""
    await workflow.execute_activity(
        contract.RUN_RELAY,
        RunRelayInput(run_id=run_id, workflow_id=workflow.info().workflow_id, relay_id=relay_id),
        task_queue=relay_queue(relay_id),
        start_to_close_timeout=timeouts.SEGMENT_ACTIVITY,
        heartbeat_timeout=timedelta(seconds=cfg.relay.heartbeat_timeout_s),
        retry_policy=timeouts.RELAY_ONE_ATTEMPT,
        activity_id=f"relay-{relay_id}-{generation}",
        summary=f"relay {relay_id} (incarnation {generation})",  # shown in the Web UI
    )


# -- trainer ---------------------------------------------------------------------------------

async def init_trainer(run_id: str, cfg: RunConfig, checkpoint: CheckpointRef | None, step: int,
                       relay_chain: list[str]) -> TrainerInitResult:
    try:
        return await workflow.execute_activity(
            contract.INIT_TRAINER,
            TrainerInitInput(run_id=run_id, config=cfg.to_json(), checkpoint=checkpoint, relay_chain=relay_chain),
            result_type=TrainerInitResult,
            task_queue=TRAINER_QUEUE,
            start_to_close_timeout=timeouts.TRAINER_ATTEMPT,
            heartbeat_timeout=timedelta(seconds=cfg.trainer.heartbeat_timeout_s),
            retry_policy=timeouts.RETRY_UNTIL_REPLACED,
            summary=f"init trainer at step {step}",
        )
    except ActivityError as e:
        fail_run_if_permanent(e, contract.INIT_TRAINER)
        raise


async def republish(run_id: str, step: int, relay_chain: list[str]) -> None:
    """Have the trainer push its current version again; best effort: a failure is logged, never fatal."""
    try:
        await workflow.execute_activity(
            contract.REPUBLISH,
            RepublishInput(run_id=run_id, step=step, relay_chain=relay_chain),
            result_type=int,
            task_queue=TRAINER_QUEUE,
            # bounded even with no trainer polling (it is restarting): stop and continue-as-new wait on this
            schedule_to_close_timeout=timeouts.REPUBLISH_IN_ALL,
            start_to_close_timeout=timeouts.REPUBLISH_ATTEMPT,
            retry_policy=timeouts.REPUBLISH_RETRY,
            summary=f"republish the version of step {step}",
        )
    except ActivityError as e:
        workflow.logger.warning("republish_failed", extra={"error": str(e)})


def start_train(cfg: RunConfig, inputs: list[TrainStepInput]) -> Any:
    """One trainer activity for inputs: `train_step` for one step, `train_steps` for several back to back (their
    results, a list). Returns its handle."""
    first = inputs[0]
    options: dict[str, Any] = dict(
        task_queue=TRAINER_QUEUE,
        start_to_close_timeout=timeouts.TRAINER_ATTEMPT,
        heartbeat_timeout=timedelta(seconds=cfg.trainer.heartbeat_timeout_s),
        retry_policy=timeouts.RETRY_UNTIL_REPLACED,
        cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
    )
    if len(inputs) == 1:
        return workflow.start_activity(
            contract.TRAIN_STEP, first, result_type=TrainStepResult,
            summary=f"train step {first.step + 1}: {sum(len(p.group_ids) for p in first.batch)} groups", **options)
    return workflow.start_activity(
        contract.TRAIN_STEPS, TrainStepsInput(first=first, then=[i.batch for i in inputs[1:]]),
        result_type=list[TrainStepResult],
        summary=f"train steps {first.step + 1}-{inputs[-1].step + 1}: "
                f"{sum(len(p.group_ids) for i in inputs for p in i.batch)} groups", **options)


# -- held-out evaluation -----------------------------------------------------------------------

async def record_eval(inp: RecordEvalInput) -> bool:
    """Store a closed eval round's record (the control worker's `record_eval`); False, logged, when it failed on
    every try: the run goes on, the round's figures stay in its status."""
    try:
        await workflow.execute_activity(
            contract.RECORD_EVAL, inp, task_queue=contract.CONTROL_QUEUE,
            start_to_close_timeout=timeouts.RECORD_EVAL_ATTEMPT, retry_policy=timeouts.RECORD_EVAL_RETRY,
            summary=f"record the eval of policy version {inp.policy_version}")
        return True
    except ActivityError as e:
        workflow.logger.warning("record_eval_failed", extra={"policy_version": inp.policy_version, "error": str(e)})
        return False


# -- rollout replicas and the slot pool ------------------------------------------------------

def start_replica(run_id: str, cfg: RunConfig, replica_id: str, segment: int, queue: str = ROLLOUT_QUEUE,
                  to_start: timedelta | None = None, attempt_base: int = 0) -> Any:
    """One `run_rollout_replica` activity for this history segment (it retries until replaced). Returns its handle.
    On a process's own queue (a kept replica), `to_start` bounds each attempt's wait for that process."""
    return workflow.start_activity(
        contract.RUN_ROLLOUT_REPLICA,
        RolloutReplicaInput(run_id=run_id, workflow_id=workflow.info().workflow_id, replica_id=replica_id,
                            config=cfg.to_json(), generation=segment, attempt_base=attempt_base),
        result_type=RolloutReplicaResult,
        task_queue=queue,
        schedule_to_start_timeout=to_start,
        start_to_close_timeout=timeouts.SEGMENT_ACTIVITY,
        heartbeat_timeout=timedelta(seconds=cfg.rollout.heartbeat_timeout_s),
        retry_policy=timeouts.RETRY_UNTIL_REPLACED,
        activity_id=f"rollout-{replica_id}",
        summary=f"rollout {replica_id} (segment {segment})" + ("" if queue == ROLLOUT_QUEUE else f" on {queue}"),
    )


def not_adopted(e: ActivityError) -> bool:
    """A kept replica's activity on its process's own queue ended without it: no worker took it within the
    schedule-to-start timeout (the process is gone; the server does not retry that timeout), or the process answered
    that it no longer holds the replica (REPLICA_NOT_PARKED). Any other failure is the replica's own."""
    cause = e.cause
    if isinstance(cause, ActivityTimeoutError):
        return cause.type == TimeoutType.SCHEDULE_TO_START
    return isinstance(cause, ApplicationError) and cause.type == REPLICA_NOT_PARKED


async def run_kept_replica(run_id: str, cfg: RunConfig, replica_id: str, segment: int, queue: str,
                           not_found: Callable[[str], None]) -> RolloutReplicaResult:
    """A replica parked at the last continue-as-new (patch `handover-route`): its activity on the queue of the process
    that holds it, where it is adopted; when that process is gone or no longer holds it, `not_found(replica_id)` and
    a fresh start on the shared queue, as after a crash (it resumes from its partial pool; the leases it does not
    resume go back to be leased again). The fresh start fences its pool above any attempt of the routed one."""
    try:
        return await start_replica(run_id, cfg, replica_id, segment, queue=queue, to_start=timeouts.KEPT_START)
    except ActivityError as e:
        if not not_adopted(e):
            raise
        workflow.logger.warning("replica_not_adopted", extra={"replica_id": replica_id, "queue": queue,
                                                               "error": str(e.cause)})
        not_found(replica_id)
    return await start_replica(run_id, cfg, replica_id, segment, attempt_base=timeouts.KEPT_FALLBACK_ATTEMPTS)


async def signal_pool(pool: str, signal: str, arg: PoolAsk | str) -> None:
    """A signal to the run's slot pool workflow (its ask, or its leaving); FailureError when the pool is not running."""
    await workflow.get_external_workflow_handle(pool).signal(signal, arg)
