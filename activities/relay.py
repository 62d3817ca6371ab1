"""Relay activity: one long-running activity per relay, on its host's queue.

The relay's data plane (relay.server.RelayServer) runs in the worker process; this activity only
announces the relay's address to the run (signal `relay_joined`) and heartbeats, so that the
workflow notices a dead relay by heartbeat timeout.
"""

from __future__ import annotations

import asyncio

from temporalio import activity

from laminar import names
from laminar.logs import get_logger
from laminar.messages import RelayInfo, RunRelayInput

log = get_logger(__name__)

HEARTBEAT_EVERY_S = 1.0


class RelayActivities:
    def __init__(self, relay_id: str, host_id: str, address: str) -> None:
        self.relay_id = relay_id
        self.host_id = host_id
        self.address = address

    @activity.defn(name=names.RUN_RELAY)
    async def run_relay(self, inp: RunRelayInput) -> str:
        if inp.relay_id != self.relay_id:
            raise RuntimeError(
                f"relay worker {self.relay_id} received the activity of relay {inp.relay_id}; "
                f"each relay worker must poll only its own queue"
            )
        handle = activity.client().get_workflow_handle(inp.workflow_id)
        info = RelayInfo(relay_id=self.relay_id, host_id=self.host_id, address=self.address)
        await handle.signal(names.RELAY_JOINED, info)
        log.info("relay_joined", relay_id=self.relay_id, address=self.address, run_id=inp.run_id)
        try:
            while True:
                activity.heartbeat(self.address)
                await asyncio.sleep(HEARTBEAT_EVERY_S)
        except asyncio.CancelledError:
            log.info("relay_released", relay_id=self.relay_id, run_id=inp.run_id)
            raise
