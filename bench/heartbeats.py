"""What heartbeats cost the Temporal server (`laminar bench heartbeats`).

N long-running activities heartbeat through one worker with the 1 s throttle the rollout and relay workers
use, against a fresh dev server (in memory); the RecordActivityTaskHeartbeat RPCs come from the server's
Prometheus metrics, and the server's CPU seconds from the OS, both over the same window.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from datetime import timedelta
from pathlib import Path

import psutil
from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from laminar.activities.heartbeat import HEARTBEAT_THROTTLE
from laminar.devstack.stack import free_port

SETTLE_S = 10.0  # every activity started and heartbeating before the window opens


@activity.defn(name="bench_heartbeat")
async def _beat() -> None:
    while True:
        activity.heartbeat()  # as often as a replica's loop does; the SDK sends one per throttle interval
        await asyncio.sleep(0.05)


@workflow.defn(name="BenchHeartbeats")
class _Beats:
    @workflow.run
    async def run(self, n: int) -> None:
        await asyncio.gather(*[workflow.start_activity(_beat, start_to_close_timeout=timedelta(hours=1),
                                                       heartbeat_timeout=timedelta(seconds=3)) for _ in range(n)])


def _heartbeat_rpcs(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    pattern = r'^service_requests\{[^}]*operation="RecordActivityTaskHeartbeat"[^}]*\} (\S+)$'
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.M))


async def measure(replicas: int, window_s: float) -> dict[str, float]:
    binary = str(Path(sys.executable).parent / "temporal")
    port, metrics_port = free_port(), free_port()
    server = subprocess.Popen([binary, "server", "start-dev", "--headless", "--port", str(port),
                               "--metrics-port", str(metrics_port), "--log-level", "error"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = await _connect(f"127.0.0.1:{port}")
        queue = f"bench-heartbeats-{uuid.uuid4().hex[:6]}"
        async with Worker(client, task_queue=queue, workflows=[_Beats], activities=[_beat],
                          max_concurrent_activities=max(1, replicas), workflow_runner=UnsandboxedWorkflowRunner(),
                          max_heartbeat_throttle_interval=HEARTBEAT_THROTTLE):
            handle = await client.start_workflow(_Beats.run, replicas, id=queue, task_queue=queue) if replicas else None
            await asyncio.sleep(SETTLE_S)
            proc = psutil.Process(server.pid)
            cpu0, rpcs0, t0 = sum(proc.cpu_times()[:2]), _heartbeat_rpcs(metrics_port), time.monotonic()
            await asyncio.sleep(window_s)
            cpu1, rpcs1, t1 = sum(proc.cpu_times()[:2]), _heartbeat_rpcs(metrics_port), time.monotonic()
            if handle is not None:
                await handle.terminate()
        span = t1 - t0
        return {"replicas": replicas, "window_s": round(span, 1),
                "heartbeat_rpcs_per_s": round((rpcs1 - rpcs0) / span, 1),
                "server_cpu_percent": round((cpu1 - cpu0) / span * 100, 1)}
    finally:
        server.terminate()
        server.wait(timeout=15)


async def _connect(address: str) -> Client:
    deadline = time.monotonic() + 60
    while True:
        try:
            return await Client.connect(address)
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.3)
