"""Rollout activity: `run_rollout_replica`, one long-running activity per replica.

A sync activity (generation is CPU/GPU work and must never run on the worker's event loop). It reaches
the workflow through updates sent on the worker's client, bridged onto the worker's event loop.
"""

from __future__ import annotations

import asyncio

from temporalio import activity
from temporalio.client import Client

from laminar.config import RunConfig
from laminar.messages import (
    AddExperienceInput,
    AddExperienceResult,
    ClaimPromptsInput,
    ClaimPromptsResult,
    RolloutReplicaInput,
    RolloutReplicaResult,
)
from services.rollout import RolloutReplica
from storage.objects import ObjectStore

UPDATE_TIMEOUT_S = 60.0


class _TemporalControl:
    """ControlPort over Temporal updates, called from the activity's thread."""

    def __init__(self, client: Client, loop: asyncio.AbstractEventLoop, workflow_id: str) -> None:
        self.handle = client.get_workflow_handle(workflow_id)
        self.loop = loop

    def _update(self, name: str, arg, result_type):
        coro = self.handle.execute_update(name, arg, result_type=result_type)
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=UPDATE_TIMEOUT_S)

    def claim(self, inp: ClaimPromptsInput) -> ClaimPromptsResult:
        return self._update("claim_prompts", inp, ClaimPromptsResult)

    def add_experience(self, inp: AddExperienceInput) -> AddExperienceResult:
        return self._update("add_experience", inp, AddExperienceResult)

    def heartbeat(self, details: dict) -> None:
        activity.heartbeat(details)

    def cancelled(self) -> bool:
        return activity.is_cancelled() or activity.is_worker_shutdown()


class RolloutActivities:
    def __init__(self, client: Client, loop: asyncio.AbstractEventLoop, store: ObjectStore, host_id: str) -> None:
        self.client = client
        self.loop = loop
        self.store = store
        self.host_id = host_id

    @activity.defn(name="run_rollout_replica", no_thread_cancel_exception=True)
    def run_rollout_replica(self, inp: RolloutReplicaInput) -> RolloutReplicaResult:
        info = activity.info()
        replica = RolloutReplica(
            run_id=inp.run_id,
            replica_id=inp.replica_id,
            host_id=self.host_id,
            segment_prefix=f"{info.workflow_run_id[:8]}-a{info.attempt}",
            cfg=RunConfig.from_json(inp.config),
            store=self.store,
            control=_TemporalControl(self.client, self.loop, inp.workflow_id),
        )
        return replica.run()
