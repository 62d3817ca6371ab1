"""SlotPoolWorkflow: shares one rollout queue's slots between the live runs (docs/architecture/handover.md, 'One worker set,
several runs').

One per rollout task queue (`pool/laminar-rollout`), on `laminar-control`, started idempotently by `laminar workers`
(signal-with-start of its slot report) and by `laminar start` (before the run). It knows:
- the slots: each worker set reports its count and the engines its workers serve (`pool_slots`), and reports 0
  when it stops;
- the live runs' asks: a run started with `laminar start` states its ask at the start of each history segment and
  after each `laminar scale` (`pool_ask`), and leaves when it finishes (`pool_leave`).
When either changes it allocates (workflows/fairshare.py, pure) and signals each run whose grant or reason changed
(`replica_grant`); the run keeps min(ask, grant) replica activities. A run that no longer exists (it failed, or
was terminated without `laminar stop --force` telling the pool) fails that signal and leaves the pool; while any
run is short of its ask, the pool looks every SWEEP_S so such a run's slots never stay held.

Deterministic: no I/O; the state is small (one entry per run and per worker set) and carried across
continue-as-new.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import FailureError

with workflow.unsafe.imports_passed_through():
    from laminar import contract
    from laminar.contract import PoolAsk, PoolInput, PoolRun, PoolState, PoolStatus, ReplicaGrant, SlotReport
    from laminar.workflows.fairshare import MAX_SLOTS, Ask, allocate

SWEEP_S = 30.0  # while a run is short of its ask: re-signal every run, so a closed one's slots are freed
HISTORY_EVENTS_PER_SEGMENT = 2_000  # continue-as-new past this many events (each signal in or out is 1-3)


@workflow.defn(name=contract.SLOT_POOL_WORKFLOW)
class SlotPoolWorkflow:
    @workflow.init
    def __init__(self, inp: PoolInput | None = None) -> None:
        self.state = (inp.state if inp is not None else None) or PoolState()
        self._dirty = True

    @workflow.run
    async def run(self, inp: PoolInput | None = None) -> None:
        while True:
            try:
                await workflow.wait_condition(lambda: self._dirty or self._segment_full(),
                                              timeout=timedelta(seconds=SWEEP_S) if self._someone_short() else None)
            except TimeoutError:
                self.state.sent = {}  # sweep: signal every run again; a closed one fails and leaves
            if self._segment_full():
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(PoolInput(state=self.state))
            self._dirty = False
            await self._signal_grants()

    # -- signals in --------------------------------------------------------------------------

    @workflow.signal(name=contract.POOL_SLOTS)
    def pool_slots(self, report: SlotReport) -> None:
        slots = max(0, min(report.slots, MAX_SLOTS))
        if slots:
            self.state.reports[report.reporter] = dataclasses.replace(report, slots=slots)
        else:
            self.state.reports.pop(report.reporter, None)
        self._dirty = True

    @workflow.signal(name=contract.POOL_ASK)
    def pool_ask(self, ask: PoolAsk) -> None:
        if ask.replicas < 0 or ask.quota < 0 or not ask.run_id:  # never from a run; a hand-sent one must not wedge
            workflow.logger.warning("pool_ask_ignored", extra={"ask": str(ask)})  # the pool (allocate would raise)
            return
        if ask.run_id not in self.state.seq:
            self.state.seq[ask.run_id] = self.state.next_seq
            self.state.next_seq += 1
        self.state.asks[ask.run_id] = ask
        self.state.sent.pop(ask.run_id, None)  # a run that (re)states its ask is told its grant again
        self._dirty = True

    @workflow.signal(name=contract.POOL_LEAVE)
    def pool_leave(self, run_id: str) -> None:
        self._forget(run_id)

    @workflow.query(name=contract.POOL_STATUS)
    def pool_status(self) -> PoolStatus:
        grants = self._grants()
        return PoolStatus(
            slots=self._slots() or 0, reporters={r: x.slots for r, x in sorted(self.state.reports.items())},
            engines=sorted(self._engines() or []),
            runs=[PoolRun(run_id=r, asked=a.replicas, quota=a.quota, granted=grants[r].granted, note=grants[r].note)
                  for r, a in sorted(self.state.asks.items(), key=lambda kv: self.state.seq[kv[0]])])

    # -- allocating and telling the runs -----------------------------------------------------

    def _slots(self) -> int | None:
        """The slots the worker sets reported; None when none has (not limited: workflows/fairshare.py)."""
        if not self.state.reports:
            return None
        return min(MAX_SLOTS, sum(r.slots for r in self.state.reports.values()))

    def _engines(self) -> frozenset[str] | None:
        """Engines every reporting worker set serves (a run's replica may land on any of them); None: no reports."""
        sets = [frozenset(r.engines) for r in self.state.reports.values() if r.engines]
        return frozenset.intersection(*sets) if sets else None

    def _grants(self) -> dict[str, ReplicaGrant]:
        asks = [Ask(run_id=a.run_id, replicas=a.replicas, quota=min(a.quota, a.replicas), seq=self.state.seq[r],
                    engine=a.engine) for r, a in self.state.asks.items()]
        return {r: ReplicaGrant(granted=g.granted, note=g.note)
                for r, g in allocate(self._slots(), asks, self._engines()).items()}

    def _someone_short(self) -> bool:
        return any(g.granted < self.state.asks[r].replicas for r, g in self.state.sent.items() if r in self.state.asks)

    async def _signal_grants(self) -> None:
        for run_id, grant in sorted(self._grants().items(), key=lambda kv: self.state.seq[kv[0]]):
            ask = self.state.asks.get(run_id)
            if ask is None or self.state.sent.get(run_id) == grant:
                continue  # it left while an earlier signal was in flight, or it knows its grant already
            try:
                await workflow.get_external_workflow_handle(ask.workflow_id).signal(contract.REPLICA_GRANT, grant)
            except FailureError as e:  # the run's workflow is closed or gone: its slots go to the others
                workflow.logger.info("pool_run_gone", extra={"run_id": run_id, "error": str(e)})
                self._forget(run_id)
                continue
            if run_id in self.state.asks:
                self.state.sent[run_id] = grant

    def _forget(self, run_id: str) -> None:
        if self.state.asks.pop(run_id, None) is not None:
            self._dirty = True
        self.state.seq.pop(run_id, None)
        self.state.sent.pop(run_id, None)

    def _segment_full(self) -> bool:
        info = workflow.info()
        return info.get_current_history_length() >= HISTORY_EVENTS_PER_SEGMENT or info.is_continue_as_new_suggested()
