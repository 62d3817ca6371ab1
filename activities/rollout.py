"""Rollout activity: `run_rollout_replica`, one long-running activity per replica.

A sync activity (generation is CPU/GPU work and must never run on the worker's event loop). It reaches
the workflow through updates sent on the worker's client, bridged onto the worker's event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

from temporalio import activity
from temporalio.client import Client, RPCTimeoutOrCancelledError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.errors import permanent_errors
from laminar import names
from laminar.config import RunConfig
from laminar.logs import get_logger
from laminar.messages import (
    AddExperienceInput,
    AddExperienceResult,
    ClaimPromptsInput,
    ClaimPromptsResult,
    RolloutReplicaInput,
    RolloutReplicaResult,
)
from laminar.metrics import CONTROL_UPDATE_RETRIES
from laminar.notice import NOTICE
from services.rollout import RolloutReplica
from storage.objects import ObjectStore

log = get_logger(__name__)

UPDATE_POLL_S = 2.0  # while an update waits (control worker or server down), keep heartbeating


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
                    time.sleep(UPDATE_POLL_S)
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
        return self._update(names.CLAIM_PROMPTS, inp, ClaimPromptsResult)

    def add_experience(self, inp: AddExperienceInput) -> AddExperienceResult:
        return self._update(names.ADD_EXPERIENCE, inp, AddExperienceResult)

    def heartbeat(self, details: dict) -> None:
        activity.heartbeat(details)

    def cancelled(self) -> bool:
        """Cancelled, or its worker shuts down. On a notice (laminar/notice.py) the worker shuts down too, but
        the replica has until the notice's deadline to leave (then the worker cancels it)."""
        return activity.is_cancelled() or (activity.is_worker_shutdown() and not NOTICE.given)


class RolloutActivities:
    def __init__(self, client: Client, loop: asyncio.AbstractEventLoop, store: ObjectStore, host_id: str,
                 relay_token: str | None = None) -> None:
        self.relay_token = relay_token
        self.client = client
        self.loop = loop
        self.store = store
        self.host_id = host_id

    @activity.defn(name=names.RUN_ROLLOUT_REPLICA, no_thread_cancel_exception=True)
    @permanent_errors()  # a ConfigError (bad run config) fails the replica for good, not retried forever
    def run_rollout_replica(self, inp: RolloutReplicaInput) -> RolloutReplicaResult:
        info = activity.info()
        replica = RolloutReplica(
            run_id=inp.run_id,
            replica_id=inp.replica_id,
            host_id=self.host_id,
            segment_prefix=f"{info.workflow_run_id.replace('-', '')[-12:]}-a{info.attempt}",
            attempt=info.attempt,
            generation=inp.generation,
            previous_heartbeat=_last_details(info.heartbeat_details),
            relay_token=self.relay_token,
            cfg=RunConfig.from_json(inp.config),
            store=self.store,
            control=_TemporalControl(self.client, self.loop, inp.workflow_id),
        )
        result = replica.run()
        if result.departed == "notice":
            # its groups are with other replicas already: this attempt ends so that Temporal places the replica
            # on another worker at once (this one polls no more), as it does after a crash, minus the timeout
            raise ApplicationError(f"replica {inp.replica_id} left its worker on notice ({NOTICE.reason}); "
                                   "it continues on another worker", type="ReplicaLeftOnNotice")
        return result


def _last_details(details) -> dict:
    """The failed attempt's last heartbeat details (a dict), or {} on a first attempt."""
    last = details[-1] if details else None
    return last if isinstance(last, dict) else {}
