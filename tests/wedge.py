"""A small reproduction of the wedge the 30-minute chaos run hit (tests/test_chaos_history.py): a cached workflow
run applies a workflow task in memory, the task's completion never lands (the worker is SIGSTOPped past the
workflow task timeout), and the next task runs on the advanced instance. The history it leaves does not replay.

The workflow has the training run's shape, cut down to what matters: a signal (a relay lost) makes the main loop
empty a list and start a backoff timer; an update (a replica's claim) returns that list. In one activation the
SDK runs signal and update jobs before the main loop resumes, so on a cold replay of the merged task the update's
acceptance comes before the timer, while the live, cached run emitted the timer first.

The worker runs in its own process (`python -m tests.wedge worker ADDRESS QUEUE`), so the test can stop it by
pid. Two ways to hold it past the task timeout (tests/test_wedge_window.py):
- `stall` (provoke_stall): the workflow's thread sleeps inside the signal's activation, once per run and process,
  only when not replaying, while the SDK's core threads keep polling; updates arrive meanwhile.
- `random` (provoke_random): the test SIGSTOPs the worker at random moments while signals and updates keep
  arriving, for a random hold around the task timeout.
Neither reproduces the wedge (the SDK evicts the run when a completion fails). `query` (provoke_query) does: a
query-only task that carries new events advances the cached run without reporting it.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.client import Client, WorkflowHandle
from temporalio.worker import (
    HandleUpdateInput,
    Interceptor,
    UnsandboxedWorkflowRunner,
    Worker,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
)

WORKFLOW = "WedgeRepro"
BACKOFF_S = 2.0
_STOPPED_ONCE: set[str] = set()  # per worker process: a fresh instance of the run (a retry) must not stop again


@workflow.defn(name=WORKFLOW)
class WedgeRepro:
    def __init__(self) -> None:
        self.relays = ["r0", "r1"]
        self.losses = 0
        self.stall_s = 0.0
        self.done = False
        self.poisoned = False

    @workflow.run
    async def run(self, stall_s: float) -> int:
        self.stall_s = stall_s
        handled = 0
        while not self.done:
            await workflow.wait_condition(lambda seen=handled: self.losses > seen or self.done or self.poisoned)
            if self.poisoned:  # a bug in the workflow's code: every attempt of this task fails, and a reset
                raise RuntimeError("poisoned: this workflow task fails on every attempt")  # reapplies the signal
            if self.done:
                break
            handled += 1
            self.relays = []  # as RelayChain.lose: the chain is empty until the backoff ends
            run_id = workflow.info().run_id
            with workflow.unsafe.sandbox_unrestricted():  # a sandboxed replayer (the repairer's) runs this too
                stalls = not os.environ.get("WEDGE_NO_STALL")  # a worker started to replace a stalled one does not
            if stalls and self.stall_s and not workflow.unsafe.is_replaying() and run_id not in _STOPPED_ONCE:
                _STOPPED_ONCE.add(run_id)  # once per run and process
                # the window: applied in memory, completion not yet sent. The workflow's thread stalls as a
                # starved control worker's does; the SDK's core threads keep polling.
                time.sleep(self.stall_s)
            await workflow.sleep(BACKOFF_S)
            self.relays = ["r0", "r1"]
        return handled

    @workflow.signal
    def lose(self) -> None:
        self.losses += 1

    @workflow.signal
    def poison(self) -> None:
        self.poisoned = True

    @workflow.update
    def claim(self) -> list[str]:
        return list(self.relays)

    @workflow.query
    def status(self) -> list[str]:  # as the run's status query, which `laminar chaos` and `laminar run` poll
        return list(self.relays)

    @workflow.update
    def finish(self) -> int:
        self.done = True
        return self.losses


DIVERGE_FILE = "LAMINAR_TEST_DIVERGE_FILE"  # the marker file DivergeOnce waits for


class DivergeOnce(Interceptor):
    """A worker interceptor (`LAMINAR_WORKER_INTERCEPTORS=tests.wedge:DivergeOnce`) that injects the wedge's
    failure into any workflow: at the first update after the file named by LAMINAR_TEST_DIVERGE_FILE appears
    (the file is then removed), a live run starts a timer that a replay of the same history does not start. The
    run goes on while it stays cached; its next cold replay (a restarted control worker) fails with the same
    `[TMPRL1100]` nondeterminism error the chaos run hit, on every workflow task, until it is reset."""

    def workflow_interceptor_class(self, input: WorkflowInterceptorClassInput) -> type[WorkflowInboundInterceptor]:
        return _DivergeOnceInbound


def _marker_taken() -> bool:
    with workflow.unsafe.sandbox_unrestricted():
        path = os.environ.get(DIVERGE_FILE, "")
        if not path or not os.path.exists(path):
            return False
        try:
            os.remove(path)
        except FileNotFoundError:
            return False
        return True


class _DivergeOnceInbound(WorkflowInboundInterceptor):
    async def handle_update_handler(self, input: HandleUpdateInput) -> Any:
        if not workflow.unsafe.is_replaying() and _marker_taken():
            asyncio.create_task(workflow.sleep(3600))  # a command only the live run issues
        return await super().handle_update_handler(input)


def worker_process(address: str, queue: str) -> list[str]:
    """argv of a worker process serving WedgeRepro on `queue`."""
    return [sys.executable, "-m", "tests.wedge", "worker", address, queue]


async def _serve(address: str, queue: str) -> None:
    runtime = None
    if os.environ.get("WEDGE_CORE_DEBUG"):  # the SDK core's own debug log on stderr: which task it applies, and how
        from temporalio.runtime import LoggingConfig, Runtime, TelemetryConfig, TelemetryFilter

        runtime = Runtime(telemetry=TelemetryConfig(logging=LoggingConfig(
            filter=TelemetryFilter(core_level="DEBUG", other_level="WARN"))))
    client = await Client.connect(address, runtime=runtime) if runtime else await Client.connect(address)
    # unsandboxed: the aligned mode's os.kill; the cache is the SDK's default (what the control worker uses)
    # debug_mode: no deadlock detector, so a stalled activation stays stalled instead of failing its task
    from laminar.workers.processes import worker_interceptors

    async with Worker(client, task_queue=queue, workflows=[WedgeRepro], workflow_runner=UnsandboxedWorkflowRunner(),
                      debug_mode=True, interceptors=worker_interceptors()):
        await asyncio.Event().wait()


@dataclass
class Attempt:
    """One provocation: how it went and whether the history it left replays."""

    workflow_id: str
    mode: str
    replays: bool
    failure: str = ""


async def start(client: Client, queue: str, workflow_id: str, stall_s: float,
                task_timeout_s: float) -> WorkflowHandle:
    return await client.start_workflow(WORKFLOW, stall_s, id=workflow_id, task_queue=queue,
                                       task_timeout=timedelta(seconds=task_timeout_s))


async def provoke_stall(handle: WorkflowHandle, stall_s: float, claims: int = 3) -> None:
    """Signal a loss: the workflow's activation stalls for stall_s (started with that stall), past the task
    timeout; claims arrive meanwhile and go to the task's retry."""
    await handle.execute_update(WedgeRepro.claim)  # the run is cached on the worker, as a long run is
    await handle.signal(WedgeRepro.lose)
    await asyncio.sleep(min(1.0, stall_s / 4))
    pending = [asyncio.create_task(handle.execute_update(WedgeRepro.claim)) for _ in range(claims)]
    await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), timeout=stall_s + 60)


async def provoke_random(client: Client, handle: WorkflowHandle, pid: int, task_timeout_s: float,
                         rng: random.Random, seconds: float) -> None:
    """Keep signals and claims flowing; SIGSTOP the worker at random moments for a hold around the task
    timeout (0.5x..2x), then SIGCONT."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds

    async def traffic() -> None:
        while loop.time() < deadline:
            await handle.signal(WedgeRepro.lose)
            await asyncio.gather(*(asyncio.wait_for(handle.execute_update(WedgeRepro.claim), 60)
                                   for _ in range(2)), return_exceptions=True)
            await asyncio.sleep(rng.uniform(0.0, 0.3))

    async def nemesis() -> None:
        while loop.time() < deadline:
            await asyncio.sleep(rng.uniform(0.5, 3.0))
            os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(rng.uniform(0.5, 2.0) * task_timeout_s)
            finally:
                os.kill(pid, signal.SIGCONT)

    await asyncio.gather(traffic(), nemesis())


async def provoke_query(client: Client, stack: Any, handle: WorkflowHandle, pid: int, queries: int = 8) -> None:
    """The window the 30-minute chaos run hit, opened on purpose (docs/upstream/wedged-run.md): a status query is
    dispatched to the worker as a query-only task while no workflow task is pending, and that task carries events
    the cached run has not applied; the SDK applies them for the query, keeps the commands they produce unsent, and
    the next workflow task's completion sends them ahead of its own.

    The worker is SIGSTOPped and the Temporal server (`stack`, a devstack.stack.DevStack) restarted, so the worker
    holds no poll on the new server (as after the chaos run's restart, when its pollers were backing off); the
    queries then wait in matching for a poller. A signal appends an event (as the relays' heartbeat timeouts did);
    on SIGCONT the worker's polls take the queries and the signal's workflow task in matching's order, and a query
    task taken first is built from the history as it is then: with the signal in it. Claims (updates) follow."""
    from temporalio.api.workflowservice.v1 import GetSystemInfoRequest

    loop = asyncio.get_running_loop()
    await handle.execute_update(WedgeRepro.claim)  # the run is cached on the worker
    os.kill(pid, signal.SIGSTOP)
    try:
        await loop.run_in_executor(None, lambda: stack.restart_temporal(0.5))
        await client.workflow_service.get_system_info(GetSystemInfoRequest())  # this client is connected again
        pending = [asyncio.create_task(handle.query(WedgeRepro.status, rpc_timeout=timedelta(seconds=40)))
                   for _ in range(queries)]
        await asyncio.sleep(1.5)  # the queries are dispatched (no workflow task pending) and wait for a poller
        await handle.signal(WedgeRepro.lose)
        await asyncio.sleep(0.2)
    finally:
        os.kill(pid, signal.SIGCONT)
    await asyncio.sleep(0.3)
    pending += [asyncio.create_task(asyncio.wait_for(handle.execute_update(WedgeRepro.claim), 60)) for _ in range(3)]
    await asyncio.gather(*pending, return_exceptions=True)


async def finish(handle: WorkflowHandle) -> None:
    """End the run when it still takes tasks (a wedged run never completes the update: bounded)."""
    try:
        await asyncio.wait_for(handle.execute_update(WedgeRepro.finish), timeout=20)
        await asyncio.wait_for(handle.result(), timeout=20)
    except Exception:  # wedged: the history is what is judged, then the run is terminated
        await handle.terminate("wedge reproduction: wedged")


async def replay_failure(handle: WorkflowHandle) -> str:
    """'' when the run's history replays from scratch, else the replayer's error."""
    from temporalio.worker import Replayer

    history = await handle.fetch_history()
    result = await Replayer(workflows=[WedgeRepro], workflow_runner=UnsandboxedWorkflowRunner()).replay_workflow(
        history, raise_on_replay_failure=False)
    return "" if result.replay_failure is None else str(result.replay_failure)


if __name__ == "__main__":
    if sys.argv[1:2] != ["worker"] or len(sys.argv) != 4:
        raise SystemExit("usage: python -m tests.wedge worker ADDRESS QUEUE")
    asyncio.run(_serve(sys.argv[2], sys.argv[3]))
