"""client/watch.py on a real Temporal dev server: watching a run sends no workflow query (a query that reaches a
cached run as a query-only task is the SDK window that wedges a run: docs/upstream/wedged-run.md). The progress it
hands on comes from the server's describe, the search attributes the run upserts; the client's calls are counted
by a client interceptor."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.client import (
    Client,
    DescribeWorkflowInput,
    Interceptor,
    OutboundInterceptor,
    QueryWorkflowInput,
    WorkflowExecutionDescription,
)
from temporalio.worker import Worker

from laminar import search
from laminar.client.watch import RunProgress, watch_run


@workflow.defn(sandboxed=False)
class SteppingRun:
    """Three steps, each upserting phase, step, policy version and reward as TrainingRunWorkflow does."""

    @workflow.run
    async def run(self) -> dict:
        for step in (1, 2, 3):
            await workflow.sleep(timedelta(seconds=1.2))
            workflow.upsert_search_attributes([search.PHASE.value_set("running"), search.STEP.value_set(step),
                                               search.POLICY_VERSION.value_set(step),
                                               search.REWARD.value_set(step / 10)])
        await workflow.sleep(timedelta(seconds=1.2))
        return {"step": 3}

    @workflow.query
    def status(self) -> dict:  # what an old watcher would ask
        return {"step": 0}


class Counting(Interceptor):
    def __init__(self) -> None:
        self.calls: dict[str, int] = {"query": 0, "describe": 0}

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        calls = self.calls

        class Outbound(OutboundInterceptor):
            async def query_workflow(self, input: QueryWorkflowInput) -> Any:
                calls["query"] += 1
                return await super().query_workflow(input)

            async def describe_workflow(self, input: DescribeWorkflowInput) -> WorkflowExecutionDescription:
                calls["describe"] += 1
                return await super().describe_workflow(input)

        return Outbound(next)


async def test_watching_a_run_sends_no_query_and_shows_its_search_attributes(temporal_env):
    await search.register(temporal_env.client, "default")
    counting = Counting()
    client = Client(**{**temporal_env.client.config(), "interceptors": [counting]})
    queue = f"watch-{uuid.uuid4().hex[:8]}"
    seen: list[RunProgress] = []
    async with Worker(client, task_queue=queue, workflows=[SteppingRun]):
        attrs = await search.initial(client, "default", "laminar")
        assert attrs is not None, "the dev server has our search attributes registered"
        handle = await client.start_workflow(SteppingRun.run, id=f"watch-{queue}", task_queue=queue,
                                             search_attributes=attrs)
        final = await asyncio.wait_for(
            watch_run(handle, lambda p, note: seen.append(p) if p is not None else None, poll_s=0.3), timeout=60)
    assert final == {"step": 3}
    assert counting.calls["query"] == 0, counting.calls
    assert counting.calls["describe"] >= 3 and len(seen) == counting.calls["describe"], (counting.calls, len(seen))
    steps = [p.step for p in seen]
    assert steps == sorted(steps) and steps[0] == 0 and 2 in steps, steps  # polled often enough to see step 2
    two = next(p for p in seen if p.step == 2)
    assert (two.phase, two.policy_version, two.reward, two.execution) == ("running", 2, 0.2, "RUNNING"), two
    assert two.history_events > 0
