"""Watching a run from a client: its `status` query every few seconds while waiting for its result, through
Temporal outages and control-worker restarts, until the run ends. `laminar run`, `laminar bench throughput` and
examples/start_and_watch.py watch their runs with it. Imports only temporalio and laminar/, so any layer may."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import timedelta

from temporalio.client import WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

from laminar import contract
from laminar.contract import RunStatus
from laminar.errors import RunLostError

POLL_S = 1.0
QUERY_TIMEOUT_S = 5.0  # a status query the control worker has not answered by then shows as waiting
# After a failed status query, the next waits twice as long as the last, up to this. A query the server dispatches
# while the control worker has no poll open (after a Temporal restart, while its pollers back off) can reach the
# cached run with new events as a query-only task, the SDK window that wedges a run (docs/upstream/wedged-run.md);
# fewer queries in that window make it rarer (not impossible: the repairer handles what is left).
QUERY_BACKOFF_MAX_S = 30.0
# What a Temporal outage looks like to a client call once the SDK's own retries (about 10 s) give up.
OUTAGE_CODES = (RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED,
                RPCStatusCode.UNKNOWN, RPCStatusCode.INTERNAL, RPCStatusCode.RESOURCE_EXHAUSTED)

async def watch_run(handle: WorkflowHandle, on_status: Callable[[RunStatus | None, str], None], poll_s: float = POLL_S,
                    on_cancel_failed: Callable[[RPCError], None] = lambda e: None) -> RunStatus:
    """Hand each status poll to on_status, as (status, "") or (None, why there is none), until the run ends; return
    its final status (a failed run raises WorkflowFailureError). Watching that ends first (an error, Ctrl-C, a
    timeout around the call) cancels the run, so none is left behind; a refused cancel goes to on_cancel_failed."""
    result = asyncio.create_task(_result(handle))
    down_since: float | None = None  # when the first status query of a Temporal outage was sent
    failures = 0  # status queries failed in a row
    try:
        while not result.done():
            asked = time.time()
            try:
                st = await handle.query(contract.STATUS, result_type=RunStatus,
                                        rpc_timeout=timedelta(seconds=QUERY_TIMEOUT_S))
            except Exception as e:  # an outage, or the control worker (re)starting: keep polling, less often
                failures += 1
                if isinstance(e, RPCError) and e.status == RPCStatusCode.UNAVAILABLE:
                    down_since = down_since or asked
                    on_status(None, f"Temporal unreachable for {time.time() - down_since:.0f} s; retrying")
                else:
                    why = e.status.name if isinstance(e, RPCError) and e.status else type(e).__name__
                    on_status(None, f"waiting for control worker ({why})")
            else:
                down_since, failures = None, 0
                on_status(st, "")
            await asyncio.wait({result}, timeout=next_poll_s(poll_s, failures))
        return await result
    finally:
        if not result.done():
            result.cancel()
            try:
                await handle.cancel()
            except RPCError as e:
                on_cancel_failed(e)


def next_poll_s(poll_s: float, failures: int) -> float:
    """The wait before the next status query: poll_s while queries answer, doubling with each failure in a row, at
    most QUERY_BACKOFF_MAX_S (never less than poll_s)."""
    return max(poll_s, min(QUERY_BACKOFF_MAX_S, poll_s * 2.0 ** min(failures, 16)))


async def _result(handle: WorkflowHandle) -> RunStatus:
    """The run's result through outages of any length: each call retries for the SDK's window (about 10 s). A
    server that no longer knows the workflow lost its state of the run: RunLostError (callers add what the store
    keeps: client/run_control.py lost_error)."""
    while True:
        try:
            return await handle.result()
        except RPCError as e:
            if e.status == RPCStatusCode.NOT_FOUND:
                raise RunLostError(f"Temporal no longer has the workflow {handle.id} ({e}): its state of the run "
                                   "was lost") from None
            if e.status not in OUTAGE_CODES:
                raise
            await asyncio.sleep(POLL_S)
