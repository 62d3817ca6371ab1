"""Rollout activity: `run_rollout_replica`, one long-running activity per replica.

A sync activity (generation is CPU/GPU work and must never run on the worker's event loop). It reaches
the workflow through updates sent on the worker's client, bridged onto the worker's event loop.

One attempt at a time: an attempt that misses its heartbeat timeout is retried by the server while it still runs
until its next heartbeat is refused (it then sees itself cancelled). Two attempts of one replica at once generate
the same groups, and a late first claim of the old one hands the new one's leases back to the pool, so other
replicas generate them again: their tool calls run twice. Hence the start-up (engine build, pool read, first
claim, resume), which has no loop to beat from, heartbeats from a background thread, and a first claim is sent only
by the replica's current attempt (`_TemporalControl.claim`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import random
import time

from temporalio import activity
from temporalio.client import Client, RPCTimeoutOrCancelledError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from laminar import contract
from laminar.activities.errors import permanent_errors
from laminar.activities.heartbeat import background_heartbeat
from laminar.config import RunConfig
from laminar.contract import (
    ROLLOUT_QUEUE,
    AddExperienceInput,
    AddExperienceResult,
    ClaimPromptsInput,
    ClaimPromptsResult,
    RolloutReplicaInput,
    RolloutReplicaResult,
)
from laminar.errors import REPLICA_NOT_PARKED
from laminar.logs import get_logger
from laminar.metrics import CONTROL_UPDATE_RETRIES
from laminar.notice import NOTICE
from laminar.rl.factory import engine_traits
from laminar.services.rollout import RolloutReplica
from laminar.services.rollout.attach import PARKING
from laminar.services.rollout.timing import TIMING
from laminar.storage.objects import ObjectStore

log = get_logger(__name__)

UPDATE_POLL_S = 2.0  # while an update waits (control worker or server down), keep heartbeating
_JITTER = random.Random()  # the retry delays' draws (not the run's seeded sampling)
# the start-up heartbeats at least this often (a third of the heartbeat timeout when that is shorter); a start-up
# that takes longer than STARTUP_LIMIT_S is taken for hung: its beats stop and the heartbeat timeout retries it
STARTUP_BEAT_S, STARTUP_LIMIT_S = 1.0, 900.0


class _TemporalControl:
    """ControlPort over Temporal updates, called from the activity's thread."""

    def __init__(self, client: Client, loop: asyncio.AbstractEventLoop, workflow_id: str) -> None:
        self.handle = client.get_workflow_handle(workflow_id)
        self.loop = loop

    def _update(self, name: str, arg, result_type):
        """Send an update and wait for its result; retry while the control plane is unreachable.

        Both updates are idempotent (claims by request id, reports by group id), so a retry after a lost
        response never leases or records anything twice. While waiting, the activity keeps heartbeating:
        a control-plane outage pauses the replica, it does not kill it.
        """
        retries = 0
        while True:
            coro = self.handle.execute_update(name, arg, result_type=result_type)
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
            while True:
                try:
                    return future.result(timeout=UPDATE_POLL_S)
                except concurrent.futures.TimeoutError:
                    activity.heartbeat({"waiting_for": name})
                    if self.cancelled():
                        future.cancel()
                        raise InterruptedError(f"{name}: cancelled while waiting for the control plane") from None
                except (RPCError, RPCTimeoutOrCancelledError) as e:  # server or control worker unreachable
                    if isinstance(e, RPCError) and e.status == RPCStatusCode.NOT_FOUND and self._lost():
                        raise ApplicationError(self._lost_message(e), type="RunLost", non_retryable=True) from None
                    log.warning("control_update_failed", update=name, error=str(e))
                    CONTROL_UPDATE_RETRIES.labels(name).inc()
                    activity.heartbeat({"waiting_for": name})
                    if self.cancelled():
                        raise
                    # refused (updates in flight at the server's limit, a failed workflow task) or aborted (a
                    # continue-as-new): again after a short jittered delay, doubling up to UPDATE_POLL_S
                    time.sleep(TIMING.update_retry_s(retries, _JITTER.random()))
                    retries += 1
                    break

    def _lost(self) -> bool:
        """The server has no workflow by this id at all (not a closed one): its state of the run was lost."""
        try:
            asyncio.run_coroutine_threadsafe(self.handle.describe(), self.loop).result(timeout=30)
        except RPCError as e:
            return e.status == RPCStatusCode.NOT_FOUND
        except Exception:  # noqa: BLE001 - cannot tell: keep retrying as for an outage
            return False
        return False

    def _lost_message(self, e: RPCError) -> str:
        run_id = self.handle.id.removeprefix("run/")
        message = (f"run {run_id}: Temporal no longer has its workflow {self.handle.id} ({e}): the server's state of "
                   f"the run was lost (its database was reset or replaced); this replica stops. The run's records "
                   f"stay in the store as they are: `laminar fork {run_id}` continues it from its newest checkpoint")
        log.error("run_lost", run_id=run_id, workflow_id=self.handle.id, error=message)
        return message

    def claim(self, inp: ClaimPromptsInput) -> ClaimPromptsResult:
        if inp.first_claim:
            self._check_current_attempt()
        return self._update(contract.CLAIM_PROMPTS, inp, ClaimPromptsResult)

    def _check_current_attempt(self) -> None:
        """Before a first claim: this attempt must be the replica activity's current one in the workflow's current
        run. A first claim releases every lease of the replica it does not resume (the retry's view of a lost
        incarnation), so a superseded attempt's late first claim would take its successor's groups away and have
        them generated again, tool calls included. The server retries an attempt once its heartbeat timeout passes
        and tells the old one only at its next heartbeat; the pending activity's attempt number says it at once.
        Check then act: a successor that starts and claims between this look and the claim (an attempt that
        stalls past its heartbeat timeout right here) is not caught; the workflow could refuse such a claim.
        Where the look itself fails (control plane unreachable), the claim goes ahead as before."""
        info = activity.info()
        try:
            desc = asyncio.run_coroutine_threadsafe(self.handle.describe(), self.loop).result(timeout=30)
        except Exception as e:  # noqa: BLE001 - cannot tell: claim as before (the update itself waits out an outage)
            log.warning("attempt_check_failed", activity_id=info.activity_id, attempt=info.attempt, error=str(e)[:200])
            return
        current = next((a for a in desc.raw_description.pending_activities if a.activity_id == info.activity_id),
                       None)
        if desc.run_id != info.workflow_run_id or current is None or current.attempt != info.attempt:
            now = "none" if current is None or desc.run_id != info.workflow_run_id else f"attempt {current.attempt}"
            log.warning("replica_attempt_superseded", activity_id=info.activity_id, attempt=info.attempt, current=now)
            raise InterruptedError(f"{info.activity_id} attempt {info.attempt} superseded ({now} is current): "
                                   "no first claim")

    def add_experience(self, inp: AddExperienceInput) -> AddExperienceResult:
        return self._update(contract.ADD_EXPERIENCE, inp, AddExperienceResult)

    def heartbeat(self, details: dict) -> None:
        activity.heartbeat(details)

    def cancelled(self) -> bool:
        """Cancelled, or its worker shuts down. On a notice (laminar/notice.py) the worker shuts down too, but
        the replica has until the notice's deadline to leave (then the worker cancels it)."""
        return activity.is_cancelled() or (activity.is_worker_shutdown() and not NOTICE.given)


class RolloutActivities:
    def __init__(self, client: Client, loop: asyncio.AbstractEventLoop, store: ObjectStore, host_id: str,
                 relay_token: str | None = None, own_queue: str = "") -> None:
        self.relay_token = relay_token
        # the queue only this process polls (contract.rollout_process_queue): a replica parked here names it in its
        # result, and the next segment starts it there; "" where none is polled (it then names none)
        self.own_queue = own_queue
        self.client = client
        self.loop = loop
        self.store = store
        self.host_id = host_id

    @activity.defn(name=contract.RUN_ROLLOUT_REPLICA, no_thread_cancel_exception=True)
    @permanent_errors()  # a ConfigError (bad run config) fails the replica for good, not retried forever
    def run_rollout_replica(self, inp: RolloutReplicaInput) -> RolloutReplicaResult:
        info = activity.info()
        cfg = RunConfig.from_json(inp.config)
        beat_s = min(STARTUP_BEAT_S, cfg.rollout.heartbeat_timeout_s / 3)
        self.close_expired()
        # the previous segment's incarnation, parked in this process at its continue-as-new (services/rollout/attach.py)
        replica = PARKING.adopt(inp.workflow_id, inp.replica_id)
        adopted = replica is not None
        if not adopted and info.task_queue != ROLLOUT_QUEUE:  # sent here for a replica this process no longer holds
            log.warning("kept_replica_not_here", replica_id=inp.replica_id, task_queue=info.task_queue)
            raise ApplicationError(f"replica {inp.replica_id} is not parked in this process (task queue "
                                   f"{info.task_queue}): it was closed or expired; the run starts it on "
                                   f"{ROLLOUT_QUEUE} instead", type=REPLICA_NOT_PARKED, non_retryable=True)
        if replica is not None:
            replica.reattach(_TemporalControl(self.client, self.loop, inp.workflow_id), info.attempt + inp.attempt_base,
                             inp.generation)
        else:
            if not engine_traits(cfg).cheap_to_keep:  # a parked engine nobody adopted gives its memory up
                for old in PARKING.take_all():
                    old.close_parked()
            with background_heartbeat(every_s=beat_s, stall_s=STARTUP_LIMIT_S):  # building the engine (docstring)
                replica = self._replica(inp, info, cfg)
        try:
            result = replica.run(starting=background_heartbeat(every_s=beat_s, stall_s=STARTUP_LIMIT_S),
                                 reattach=adopted)
        except InterruptedError:
            log.warning("replica_attempt_cancelled", replica_id=inp.replica_id, attempt=info.attempt,
                        why=_why_cancelled())
            raise
        if result.departed == "notice":
            # its groups are with other replicas already: this attempt ends so that Temporal places the replica
            # on another worker at once (this one polls no more), as it does after a crash, minus the timeout
            raise ApplicationError(f"replica {inp.replica_id} left its worker on notice ({NOTICE.reason}); "
                                   "it continues on another worker", type="ReplicaLeftOnNotice")
        if replica.parked:  # kept across the continue-as-new: the next segment's activity re-attaches it here
            displaced = PARKING.park(inp.workflow_id, inp.replica_id, replica, time.monotonic())
            if displaced is not None:
                displaced.close_parked()
            if self.own_queue:  # the next segment starts it here (workflows/commands.py run_kept_replica)
                result = dataclasses.replace(result, queue=self.own_queue)
        return result

    def close_expired(self) -> None:
        """Close the replicas parked here whose next activity never came (PARK_S): the run was stopped or failed
        meanwhile, or it started them elsewhere. Their slots are free again (workers/rollout_slots.py)."""
        for old in PARKING.expired(time.monotonic()):
            old.close_parked()

    def _replica(self, inp: RolloutReplicaInput, info: activity.Info, cfg: RunConfig) -> RolloutReplica:
        return RolloutReplica(
            run_id=inp.run_id,
            replica_id=inp.replica_id,
            host_id=self.host_id,
            segment_prefix=f"{info.workflow_run_id.replace('-', '')[-12:]}-a{info.attempt + inp.attempt_base}",
            attempt=info.attempt + inp.attempt_base,
            generation=inp.generation,
            previous_heartbeat=_last_details(info.heartbeat_details),
            relay_token=self.relay_token,
            cfg=cfg,
            store=self.store,
            control=_TemporalControl(self.client, self.loop, inp.workflow_id),
        )


def _why_cancelled() -> str:
    """What cancelled this attempt, as the SDK knows it: timed_out (a missed heartbeat: the server retries it),
    not_found, cancel_requested, worker_shutdown, ...; "" when it was not the SDK (the worker's shutdown)."""
    details = activity.cancellation_details()
    return ",".join(k for k, v in vars(details).items() if v) if details is not None else ""


def _last_details(details) -> dict:
    """The failed attempt's last heartbeat details (a dict), or {} on a first attempt."""
    last = details[-1] if details else None
    return last if isinstance(last, dict) else {}
