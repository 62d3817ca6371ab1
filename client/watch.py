"""Watching a run from a client: what the server's `describe` says of it (its status and the search attributes the
run keeps current: phase, step, policy version, reward) every second while waiting for its result, through
Temporal outages and control-worker restarts, until the run ends. `laminar run`, `laminar bench throughput` and
examples/start_and_watch.py watch their runs with it. No workflow query: a describe is answered by the server alone
and costs the run no workflow task, while a status query that the server dispatches as a query-only task is the
SDK window that wedges a run (docs/upstream/wedged-run.md). Imports only temporalio and laminar/, so any layer may."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

from temporalio.client import WorkflowExecutionDescription, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

from laminar import search
from laminar.contract import RunStatus
from laminar.errors import RunLostError

POLL_S = 1.0
DESCRIBE_TIMEOUT_S = 5.0  # a describe the server has not answered by then shows as waiting
# After a failed describe, the next waits twice as long as the last, up to this (a server that is down or coming
# back is not asked once a second).
BACKOFF_MAX_S = 30.0
# What a Temporal outage looks like to a client call once the SDK's own retries (about 10 s) give up.
OUTAGE_CODES = (RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED,
                RPCStatusCode.UNKNOWN, RPCStatusCode.INTERNAL, RPCStatusCode.RESOURCE_EXHAUSTED)


@dataclass(frozen=True)
class RunProgress:
    """A run as the server describes it. The search attributes are there only for a run started with them (the
    namespace has them registered: laminar/search.py); without them phase is "" and step, policy_version, reward
    are None. `laminar status` (a one-shot query) has the rest."""
    execution: str  # Temporal's status of the run: RUNNING, COMPLETED, FAILED, ...
    phase: str  # starting, running, paused, stopping, finished, failed; "" without search attributes
    step: int | None  # trainer steps committed
    policy_version: int | None
    reward: float | None  # mean reward of the last committed step (None before the first)
    history_events: int  # of the current continue-as-new segment


def progress_of(desc: WorkflowExecutionDescription) -> RunProgress:
    attrs = desc.typed_search_attributes
    return RunProgress(execution=desc.status.name if desc.status is not None else "UNKNOWN",
                       phase=attrs.get(search.PHASE) or "", step=attrs.get(search.STEP),
                       policy_version=attrs.get(search.POLICY_VERSION), reward=attrs.get(search.REWARD),
                       history_events=desc.history_length)


async def watch_run(handle: WorkflowHandle, on_status: Callable[[RunProgress | None, str], None],
                    poll_s: float = POLL_S, on_cancel_failed: Callable[[RPCError], None] = lambda e: None) -> RunStatus:
    """Hand each describe of the run to on_status, as (progress, "") or (None, why there is none), until the run
    ends; return its final status (a failed run raises WorkflowFailureError). Watching that ends first (an error,
    Ctrl-C, a timeout around the call) cancels the run, so none is left behind; a refused cancel goes to
    on_cancel_failed."""
    result = asyncio.create_task(_result(handle))
    down_since: float | None = None  # when the first describe of a Temporal outage was sent
    failures = 0  # describes failed in a row
    try:
        while not result.done():
            asked = time.time()
            try:
                desc = await handle.describe(rpc_timeout=timedelta(seconds=DESCRIBE_TIMEOUT_S))
            except Exception as e:  # an outage: keep watching, less often
                failures += 1
                if isinstance(e, RPCError) and e.status == RPCStatusCode.UNAVAILABLE:
                    down_since = down_since or asked
                    on_status(None, f"Temporal unreachable for {time.time() - down_since:.0f} s; retrying")
                else:
                    why = e.status.name if isinstance(e, RPCError) and e.status else type(e).__name__
                    on_status(None, f"waiting for Temporal ({why})")
            else:
                down_since, failures = None, 0
                on_status(progress_of(desc), "")
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
    """The wait before the next describe: poll_s while they answer, doubling with each failure in a row, at most
    BACKOFF_MAX_S (never less than poll_s)."""
    return max(poll_s, min(BACKOFF_MAX_S, poll_s * 2.0 ** min(failures, 16)))


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
