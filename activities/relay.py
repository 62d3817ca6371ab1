"""Relay activity: one long-running activity per relay, on its host's queue.

The relay's data plane (relay.server.RelayServer) runs in the worker process; this activity only
announces the relay's address to the run (signal `relay_joined`) and heartbeats, so that the
workflow notices a dead relay by heartbeat timeout.

On notice (laminar/notice.py: SIGTERM, a drain, a preemption warning) the relay leaves the chain cleanly: it tells
the workflow (update `relay_leaving`), which drops it from the chain at once and has the trainer push the current
version again to the chain without it; the relay keeps serving until nothing is in flight through it (at least
LEAVE_MIN_LINGER_S, so that a replica or trainer that had not heard yet finishes its call, and at most until the
notice's deadline less LEAVE_MARGIN_S), then the activity returns and the worker exits 0.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from temporalio import activity

from laminar import contract
from laminar.contract import RelayInfo, RunRelayInput
from laminar.logs import get_logger
from laminar.notice import NOTICE, Notice

log = get_logger(__name__)

HEARTBEAT_EVERY_S = 1.0
NOTICE_CHECK_S = 0.1  # how often the activity looks at the notice between heartbeats
LEAVE_MIN_LINGER_S = 1.0  # after leaving the chain, serve at least this long (calls begun on the old chain)
LEAVE_MARGIN_S = 1.0  # stop lingering this long before the notice's deadline (the server still has to stop)


class RelayActivities:
    def __init__(self, relay_id: str, host_id: str, address: str, busy: Callable[[], bool] = lambda: False,
                 notice: Notice = NOTICE) -> None:
        self.relay_id = relay_id
        self.host_id = host_id
        self.address = address
        self._busy = busy  # RelayServer.busy: something is in flight through the relay
        self._notice = notice

    @activity.defn(name=contract.RUN_RELAY)
    async def run_relay(self, inp: RunRelayInput) -> str:
        if inp.relay_id != self.relay_id:
            raise RuntimeError(
                f"relay worker {self.relay_id} received the activity of relay {inp.relay_id}; "
                f"each relay worker must poll only its own queue"
            )
        handle = activity.client().get_workflow_handle(inp.workflow_id)
        info = RelayInfo(relay_id=self.relay_id, host_id=self.host_id, address=self.address)
        if not self._notice.given:
            await handle.signal(contract.RELAY_JOINED, info)
            log.info("relay_joined", relay_id=self.relay_id, address=self.address, run_id=inp.run_id)
        try:
            beat_at = 0.0
            while not self._notice.given:
                if time.monotonic() - beat_at >= HEARTBEAT_EVERY_S:
                    activity.heartbeat(self.address)
                    beat_at = time.monotonic()
                await asyncio.sleep(NOTICE_CHECK_S)
            return await self._leave(handle, info, inp)
        except asyncio.CancelledError:
            log.info("relay_released", relay_id=self.relay_id, run_id=inp.run_id)
            raise

    async def _leave(self, handle, info: RelayInfo, inp: RunRelayInput) -> str:
        """Leave the chain on notice, then serve until nothing is in flight (bounded by the notice)."""
        t0 = time.monotonic()
        try:
            # bounded: a control plane that is away must not hold the relay past its notice
            dropped = await asyncio.wait_for(handle.execute_update(contract.RELAY_LEAVING, info, result_type=bool),
                                             timeout=max(0.5, self._notice.remaining_s() / 2))
        except Exception as e:  # noqa: BLE001 - the run ended, or its control plane is away: leave all the same
            log.warning("relay_leaving_not_acknowledged", relay_id=self.relay_id, run_id=inp.run_id, error=str(e))
            dropped = False
        log.info("relay_leaving", relay_id=self.relay_id, run_id=inp.run_id, dropped=dropped,
                 notice=self._notice.reason, update_s=round(time.monotonic() - t0, 3))
        linger_until = time.monotonic() + LEAVE_MIN_LINGER_S
        while time.monotonic() < linger_until or self._busy():
            if self._notice.remaining_s() <= LEAVE_MARGIN_S:
                break
            activity.heartbeat(self.address)
            await asyncio.sleep(NOTICE_CHECK_S)
        log.info("relay_left", relay_id=self.relay_id, run_id=inp.run_id,
                 spent_s=round(time.monotonic() - t0, 3), busy=self._busy())
        return "left on notice"
