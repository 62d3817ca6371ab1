"""Fault delivery for recovery drills: every worker process started with --allow-faults polls its own
fault queue, so a fault reaches exactly the process that must die, and a drill can only kill processes
the run's launcher started. A `preempt` fault sends SIGTERM instead: the notice (laminar/notice.py), after
which the process leaves cleanly and exits 0."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from temporalio import activity

from laminar import contract
from laminar.contract import InjectFaultInput, InjectFaultResult
from laminar.logs import get_logger

log = get_logger(__name__)


class FaultActivities:
    def __init__(self, process: str) -> None:
        self.process = process

    @activity.defn(name=contract.INJECT_FAULT)
    async def inject_fault(self, inp: InjectFaultInput) -> InjectFaultResult:
        """Acknowledge, then signal this process after delay_s: SIGKILL (no cleanup: a real crash), or for
        `preempt` SIGTERM (the notice a spot machine gets: the worker leaves within its notice)."""
        pid = os.getpid()
        sig = signal.SIGTERM if inp.fault == "preempt" else signal.SIGKILL
        log.warning("fault_injected", drill_id=inp.drill_id, fault=inp.fault, target=inp.target, pid=pid,
                    process=self.process, delay_s=inp.delay_s, signal=sig.name)
        asyncio.get_running_loop().call_later(inp.delay_s, os.kill, pid, sig)
        return InjectFaultResult(process=self.process, pid=pid, injected_at=time.time() + inp.delay_s)
