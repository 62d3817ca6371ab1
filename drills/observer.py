"""Drill-runner activities, served by the `laminar drill` process itself while a drill runs: they wait
for the run to reach the injection step, resolve the target, interrupt the store, and watch recovery.
They run outside the processes a drill kills, so the observation survives every fault."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict

from temporalio import activity
from temporalio.client import Client

from laminar import contract
from laminar.contract import (
    DrillInput,
    DrillPlan,
    DrillReport,
    InjectFaultResult,
    ObserveInput,
    RunStatus,
    workflow_id_for,
)
from laminar.drills import rules
from laminar.errors import StoreError
from laminar.storage import keys
from laminar.storage.objects import ObjectStore

POLL_S = 0.5
SETTLE_STEPS = 1  # steps to watch after recovery so that the accounting has settled
STATUS_TIMEOUT_S = 4.0  # a status query unanswered this long counts as no answer (well inside the 10 s heartbeat)
THROUGHPUT_WATCH_S = 60.0  # after recovery, watch this long more for the throughput to come back


class DrillActivities:
    def __init__(self, client: Client, store: ObjectStore, interrupt_store=None) -> None:
        self.client = client
        self.store = store
        self._interrupt = interrupt_store  # callable(outage_s) -> (stopped_at, back_at), blocking

    async def _status(self, run_id: str) -> RunStatus:
        handle = self.client.get_workflow_handle(workflow_id_for(run_id))
        return await handle.query(contract.STATUS, result_type=RunStatus)

    async def _try_status(self, run_id: str) -> RunStatus | None:
        """None while the run cannot answer. Bounded: with the control worker down a query waits for the server's
        own timeout, longer than this activity's heartbeat timeout (a control drill's observer was retried so)."""
        try:
            return await asyncio.wait_for(self._status(run_id), STATUS_TIMEOUT_S)
        except Exception:  # the control worker may be down: that is what some drills do
            return None

    @activity.defn(name=contract.PLAN_DRILL)
    async def plan_drill(self, inp: DrillInput) -> DrillPlan:
        while True:
            st = await self._try_status(inp.run_id)
            if (st is not None and st.step >= inp.at_step and st.phase == "running" and st.replicas
                    and (inp.during != "migration" or st.migrating)):
                target, process = rules.resolve_target(inp.fault, inp.target, st, inp.during)
                return DrillPlan(fault=inp.fault, target=target, process=process, baseline=st)
            activity.heartbeat(st.step if st else None)
            await asyncio.sleep(POLL_S)

    @activity.defn(name=contract.INTERRUPT_STORE)
    async def interrupt_store(self, inp: DrillInput) -> InjectFaultResult:
        if self._interrupt is None:
            raise RuntimeError("this drill runner cannot interrupt the store: run it where `laminar dev up --s3` runs")
        task = asyncio.ensure_future(asyncio.to_thread(self._interrupt, inp.outage_s))
        while not task.done():
            activity.heartbeat("store down")
            await asyncio.wait({task}, timeout=1.0)
        stopped_at, _back_at = task.result()
        return InjectFaultResult(process="s3", pid=0, injected_at=stopped_at)

    @activity.defn(name=contract.OBSERVE_RECOVERY)
    async def observe_recovery(self, inp: ObserveInput) -> DrillReport:
        plan, injected_at, run_id = inp.plan, inp.injected.injected_at, inp.drill.run_id
        deadline = time.time() + inp.drill.timeout_s
        detected = recovered = throughput_at = None
        final = plan.baseline
        kind = rules.rule_kind(plan.fault, plan.process)
        steps = StepClock(self.store, run_id, plan.baseline.step)
        while time.time() < deadline:
            activity.heartbeat(detected, recovered)
            # the baseline's records, a few per round (a loaded store must not hold up the heartbeat)
            await asyncio.to_thread(steps.read_before, injected_at - rules.THROUGHPUT_BEFORE_S)
            st = await self._try_status(run_id)
            if st is not None:
                final = st
                times = await asyncio.to_thread(steps.times_until, st.step)
                detected = detected or rules.detected_at(kind, plan.target, injected_at, st,
                                                         await self._activities(run_id))
                recovered = rules.recovered_at(kind, plan.target, injected_at, detected, st,
                                               steps.recovery_candidates(plan.fault, injected_at),
                                               len(plan.baseline.relays))
                throughput_at = (rules.throughput_restored_at(steps.tokens(), injected_at, time.time())
                                 if steps.baseline_read else None)
                settled = recovered is not None and sum(t > recovered for t in times) >= SETTLE_STEPS
                # the throughput figure needs a window after the fault: watch on for it, a bounded while (not at all
                # without a baseline: a run that stepped too briefly before the fault has none)
                no_baseline = steps.baseline_read and rules.baseline_tokens_per_s(steps.tokens(), injected_at) is None
                watched = (throughput_at is not None or no_baseline
                           or time.time() > (recovered or 0.0) + THROUGHPUT_WATCH_S)
                if (settled and watched) or (recovered is not None and st.phase in ("stopping", "finished")):
                    break
            await asyncio.sleep(POLL_S)
        observed_until = min(time.time(), deadline)
        times = await asyncio.to_thread(steps.times_until, final.step)
        throughput_at = rules.throughput_restored_at(steps.tokens(), injected_at, observed_until)
        notes = "" if recovered is not None else f"no recovery observed within {inp.drill.timeout_s:.0f}s"
        young = rules.no_baseline_note(steps.tokens(), injected_at) if steps.baseline_read else ""
        notes = "; ".join(x for x in (notes, young) if x)
        if inp.drill.during == "migration":
            notes = "; ".join(x for x in (f"during migration {', '.join(plan.baseline.migrating)}", notes) if x)
        report = rules.build_report(inp.drill.drill_id, plan.fault, plan.target, injected_at, plan.baseline,
                                    final, detected, recovered, times, observed_until, notes, throughput_at)
        self.store.put(keys.drill_report(inp.drill.run_id, inp.drill.drill_id),
                       json.dumps(asdict(report), indent=2).encode())
        return report

    async def _activities(self, run_id: str) -> list[rules.ActivityView]:
        try:
            desc = await self.client.get_workflow_handle(workflow_id_for(run_id)).describe()
        except Exception:
            return []
        out = []
        for a in desc.raw_description.pending_activities:
            complete = a.last_attempt_complete_time.ToDatetime().timestamp() if a.HasField(
                "last_attempt_complete_time") else None
            out.append(rules.ActivityView(a.activity_id, a.activity_type.name, a.attempt, complete))
        return out


class StepClock:
    """Completion times of a run's steps after `after_step`, read once each from the per-step metric
    records the trainer writes (durable, one per step: right at any step rate and across any number of
    continue-as-new segments)."""

    def __init__(self, store: ObjectStore, run_id: str, after_step: int) -> None:
        self.store, self.run_id = store, run_id
        self.next_step = after_step + 1
        self.times: dict[int, float] = {}
        self.scheduled: dict[int, float | None] = {}  # when the workflow scheduled each step
        self.step_tokens: dict[int, int] = {}  # tokens each step trained on (throughput_restored_at)
        self.before: dict[int, tuple[float, int]] = {}  # steps up to after_step: (completion time, tokens)
        self._before_from, self._before_done = after_step, False  # the next older step to read; reached `since`

    def read_before(self, since: float, limit: int = 20) -> None:
        """Up to `limit` more records of the steps up to after_step, newest first, until one completed at or
        before `since` or step 1 is read (the throughput baseline: the minute before the fault)."""
        for _ in range(limit):
            if self._before_from < 1 or self._before_done:
                return
            try:
                record = json.loads(self.store.get(keys.step_metrics(self.run_id, self._before_from)))
            except StoreError:  # the store is down (a store drill): next round
                return
            self.before[self._before_from] = (float(record["time"]), int(record.get("tokens", 0)))
            self._before_done = self.before[self._before_from][0] <= since
            self._before_from -= 1

    @property
    def baseline_read(self) -> bool:
        return self._before_done or self._before_from < 1

    def tokens(self) -> list[tuple[float, int]]:
        """(completion time, tokens) of every step read, before and after after_step."""
        return list(self.before.values()) + [(t, self.step_tokens.get(n, 0)) for n, t in self.times.items()]

    def times_until(self, step: int) -> list[float]:
        while self.next_step <= step:
            try:
                record = json.loads(self.store.get(keys.step_metrics(self.run_id, self.next_step)))
            except StoreError:  # not written yet (the status moved first), or the store is down: next time
                break
            self.times[self.next_step] = float(record["time"])
            self.scheduled[self.next_step] = record.get("scheduled_at")
            self.step_tokens[self.next_step] = int(record.get("tokens", 0))
            self.next_step += 1
        return list(self.times.values())

    def recovery_candidates(self, fault: str, injected_at: float) -> list[float]:
        """Completion times of the steps that can show recovery. For the control worker only steps the
        workflow scheduled after the fault count: a step already running completes without it."""
        if fault != "control":
            return list(self.times.values())
        return [t for n, t in self.times.items() if (self.scheduled.get(n) or 0.0) > injected_at]
