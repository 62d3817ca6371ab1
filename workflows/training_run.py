"""TrainingRunWorkflow: the durable owner of one RL run (docs/architecture.md: 'Parts', the two traces,
'Continue-as-new: the hand-over').

Owns step, policy version, committed checkpoint, prompt leases, the experience index, relay chain and
replica table. Rollout replicas and relays are long-running activities; each trainer step is one
activity on the trainer's queue. Deterministic: no I/O, no torch, activities called by name.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, FailureError

with workflow.unsafe.imports_passed_through():
    from temporalio.converter import value_to_type

    from laminar import contract, search, watchdog
    from laminar.config import RunConfig
    from laminar.contract import (
        CONTROL_QUEUE,
        ROLLOUT_QUEUE,
        TRAINER_QUEUE,
        AddExperienceInput,
        AddExperienceResult,
        ClaimPromptsInput,
        ClaimPromptsResult,
        PoolAsk,
        RelayInfo,
        ReplicaGrant,
        ReplicaReport,
        RepublishInput,
        RolloutReplicaInput,
        RunRelayInput,
        RunStatus,
        ScaleInput,
        ScaleResult,
        TrainerInitInput,
        TrainerInitResult,
        TrainStepInput,
        TrainStepResult,
        TrainStepsInput,
        WorkflowReset,
        relay_queue,
    )
    from laminar.errors import ConfigError
    from laminar.policy import Policy, fresh_lease_room, policy_for, steps_to_publish
    from laminar.refs import CheckpointRef
    from workflows import timeouts
    from workflows.ledger import Ledger
    from workflows.migrations import Migrations
    from workflows.relay_health import RelayHealth
    from workflows.scale import check_target, plan_relays, plan_scale, relay_ids, replica_ids, replica_index
    from workflows.state import RunState

__all__ = ["TrainingRunWorkflow", "CONTROL_QUEUE"]

HANDOVER_STALLS_KEPT = 64  # hand-over stalls kept for the summary's p50 (max and count cover the whole run)
SEARCH_ATTRIBUTES_EVERY_S = 5.0  # step, version and reward are upserted at most this often (a phase change: at once)
TRAIN_AHEAD = 1  # trainer activities scheduled behind the running one (patch train-ahead; the trainer's queue runs
# one at a time, so the next starts as the running one returns, without waiting for a workflow task)


@dataclasses.dataclass
class _TrainFlight:
    """One trainer activity in flight: its steps' inputs, its handle, and when it was scheduled."""

    inputs: list[TrainStepInput]
    handle: Any
    scheduled_at: float


@workflow.defn(name=contract.TRAINING_RUN_WORKFLOW)
class TrainingRunWorkflow:
    @workflow.init
    def __init__(self, inp: Any) -> None:
        self._error: str | None = None
        self._cfg: RunConfig | None = None
        self._policy: Policy | None = None  # the run mode's decisions (laminar/policy.py), from the config
        self._replicas: dict[str, Any] = {}
        self._relay_tasks: dict[str, Any] = {}
        self._handover = False
        self._closing = False  # draining for continue-as-new or finish: relay watchers stop
        self._finished = False
        self._updates = 0  # updates handled in this history segment (the server caps them per run)
        self._rejoined_relays: set[str] = set()  # relays that joined in this segment
        self._relay_health = RelayHealth()  # relays out of the chain for failing data-plane checks (this segment)
        self._training = False  # a train_step activity is in flight
        self._ahead = False  # patch train-ahead: trainer activities are scheduled ahead (_advance_trainer)
        self._trainer_free_at = 0.0  # (train-ahead) when the last trainer activity returned
        self._flights: list[_TrainFlight] = []  # (train-ahead) the trainer activities in flight, in step order
        self._republish_wanted = False  # the chain changed: push the current version again (see _republish)
        self._version_pushed_at = workflow.time()  # the last publish or republish (see _note_version_missing)
        self._search_upserted: tuple[str, float] = ("", 0.0)  # (phase, workflow time) of the last upsert
        self._watchdog_task: Any = None  # _watchdog's timer loop (patch `watchdog`)
        self._replicas_started = False  # run() started the replicas: a grant (slot pool) is applied from then on
        self._ask_unsent = True  # the slot pool has not heard this segment's ask yet (see _tell_pool)
        try:
            self._cfg, state = _parse_input(inp)
            self._policy = policy_for(self._cfg)
            run_id = self._cfg.run.run_id or workflow.info().workflow_id.removeprefix("run/")
            self.state = state or RunState(run_id=run_id, started_at=workflow.time(), pool=_pool_of(inp))
            self._segment_first_step = self.state.step
        except ConfigError as e:
            self._error = str(e)
            self.state = RunState(run_id="invalid")
            self._segment_first_step = 0
        self.ledger = Ledger(self.state)
        self.migrations = Migrations(self.ledger)  # dynamic repack's lease hand-overs (workflows/migrations.py)

    # -- the run, as a table of contents -----------------------------------------------------

    @workflow.run
    async def run(self, inp: Any) -> RunStatus:
        if self._error is not None or self._cfg is None:
            raise ApplicationError(self._error or "invalid input", type="InvalidConfig", non_retryable=True)
        if self.state.pool and workflow.patched("slot-pool"):
            asyncio.create_task(self._tell_pool())  # the pool hears the ask while the trainer starts
        self._start_relays()
        await self._wait_for_relays()
        if not self.state.trainer_ready:
            await self._init_trainer()
        self._start_replicas()
        self._replicas_started = True
        self._apply_grant()  # a pooled run: the replicas its grant allows
        if workflow.patched("watchdog"):
            self._watchdog_task = asyncio.create_task(self._watchdog())
        self._upsert_search_attributes()
        self._ahead = workflow.patched("train-ahead")
        while self.state.step < self._cfg.run.steps and not self.state.stopping:
            if self._should_continue_as_new():
                await self._continue_as_new()
            if not await self._wait_for_batch():
                break
            if self._republish_wanted:
                await self._republish()
            if self._ahead:
                self._advance_trainer()
            elif self._has_batch():
                await self._step()
        return await self._finish()

    async def _step(self) -> None:
        """One trainer step; the first step of a continued segment measures the hand-over stall."""
        self._note_handover_stall()
        self._training = True
        try:
            await self._train_one_step()
        finally:
            self._training = False
        self.state.last_step_at = self._version_pushed_at = workflow.time()
        self._upsert_search_attributes()

    def _note_handover_stall(self) -> None:
        """The first step of a continued segment measures the hand-over stall."""
        if self.state.handover_last_step_at is not None:
            stall = max(0.0, workflow.time() - self.state.handover_last_step_at)
            self.state.handover_stalls = (self.state.handover_stalls + [round(stall, 3)])[-HANDOVER_STALLS_KEPT:]
            self.state.handover_stall_max = max(self.state.handover_stall_max, stall)
            self.state.handover_last_step_at = None

    def _upsert_search_attributes(self) -> None:
        """Keep the run's search attributes (laminar/search.py) current: at once on a phase change, else at most
        every SEARCH_ATTRIBUTES_EVERY_S. Only for a run started with them (the starter sets them where the
        namespace has them registered; an unregistered one would fail the workflow task), behind a patch."""
        phase, now = self._phase(), workflow.time()
        last_phase, last_at = self._search_upserted
        if (workflow.info().typed_search_attributes.get(search.PHASE) is None
                or (phase == last_phase and now - last_at < SEARCH_ATTRIBUTES_EVERY_S)
                or not workflow.patched("search-attributes")):
            return
        self._search_upserted = (phase, now)
        reward = [search.REWARD.value_set(self.state.reward_recent[-1])] if self.state.reward_recent else []
        workflow.upsert_search_attributes([search.PHASE.value_set(phase), search.STEP.value_set(self.state.step),
                                           search.POLICY_VERSION.value_set(self.state.policy_version), *reward])

    # -- relays ------------------------------------------------------------------------------

    def _relay_ids(self) -> list[str]:
        """The relays the run should have: relay.relays of them until a `laminar scale --relays`."""
        assert self._cfg is not None
        return list(self.state.relay_ids) or relay_ids(self._cfg.relay.relays)

    def _start_relays(self) -> None:
        for relay_id in self._relay_ids():
            self._relay_tasks[relay_id] = asyncio.create_task(self._watch_relay(relay_id))
            if relay_id in self.state.relays:  # inherited from the previous segment
                self._relay_tasks[f"{relay_id}/rejoin"] = asyncio.create_task(self._expect_rejoin(relay_id))

    async def _watch_relay(self, relay_id: str) -> None:
        """Keep one `run_relay` activity per relay. Its heartbeat timeout is the relay's failure
        detector: the dead relay leaves the chain at once (a new master is simply the next relay) and a
        new attempt waits on the relay's queue until its worker is back, then rejoins."""
        assert self._cfg is not None
        generation = failures = 0
        while not self._closing:
            generation += 1
            started = workflow.time()
            try:
                await workflow.execute_activity(
                    contract.RUN_RELAY,
                    RunRelayInput(run_id=self.state.run_id, workflow_id=workflow.info().workflow_id, relay_id=relay_id),
                    task_queue=relay_queue(relay_id),
                    start_to_close_timeout=timeouts.SEGMENT_ACTIVITY,
                    heartbeat_timeout=timedelta(seconds=self._cfg.relay.heartbeat_timeout_s),
                    retry_policy=timeouts.RELAY_ONE_ATTEMPT,
                    activity_id=f"relay-{relay_id}-{generation}",
                    summary=f"relay {relay_id} (incarnation {generation})",  # shown in the Web UI
                )
            except ActivityError:
                if self._closing:  # cancelled by _drain
                    return
            except asyncio.CancelledError:
                return
            self._lose_relay(relay_id)
            # back off while the relay keeps failing fast (history grows with failures, never spins)
            failures = failures + 1 if workflow.time() - started < timeouts.RELAY_FAILING_FAST_S else 0
            await workflow.sleep(timedelta(seconds=min(timeouts.RELAY_BACKOFF_MAX_S, 2**failures)))

    def _lose_relay(self, relay_id: str, republish: bool = True) -> None:
        if (lost := self.state.relays.pop(relay_id, None)) is not None:
            self._relay_health.forget(lost.address)
            # the master may have died mid-broadcast (a relay that leaves on notice first forwards what it holds)
            self._republish_wanted = self._republish_wanted or (republish and self.state.trainer_ready)
            self.ledger.note_event("relay_lost", relay_id, workflow.time())
            workflow.logger.warning("relay_lost", extra={"relay_id": relay_id})

    async def _expect_rejoin(self, relay_id: str) -> None:
        """A continued segment keeps the chain it inherited (relay servers outlive the activities that
        watch them), so publishing never waits for relays to re-announce themselves. A relay that does not
        re-join within two heartbeat timeouts is gone: it leaves the chain."""
        assert self._cfg is not None
        wait_s = timeouts.RELAY_REJOIN_HEARTBEATS * self._cfg.relay.heartbeat_timeout_s
        try:
            await workflow.wait_condition(lambda: relay_id in self._rejoined_relays or self._closing,
                                          timeout=timedelta(seconds=wait_s))
        except TimeoutError:
            self._lose_relay(relay_id)

    async def _wait_for_relays(self) -> None:
        """A new run waits (bounded) for every relay before publishing version 0; a continued run needs
        only one (it normally inherits the whole chain), and the others rejoin the chain as they come (a dead
        relay never stalls training)."""
        assert self._cfg is not None
        want = len(self._relay_ids()) if not self.state.trainer_ready else 1
        try:
            await workflow.wait_condition(lambda: len(self.state.relays) >= want, timeout=timeouts.RELAY_JOIN)
        except TimeoutError:
            workflow.logger.warning("relays_missing", extra={"joined": sorted(self.state.relays), "wanted": want})
            await workflow.wait_condition(lambda: len(self.state.relays) >= 1)

    def _joined(self) -> list[str]:
        return [r.address for _, r in sorted(self.state.relays.items())]

    def _chain(self) -> list[str]:
        """The relays that joined, by relay id, less those out for failing data-plane checks (relay_health)."""
        return self._relay_health.chain(self._joined())

    def _note_relay_checks(self, results: list[TrainStepResult]) -> None:
        """The trainer's data-plane checks (workflows/relay_health.py): a relay it could not reach leaves the chain
        even while it heartbeats; one that passes again comes back, and the trainer pushes the current version
        again so that it holds it. No patch: only trainers of this code report checks (a recorded history's results
        carry none), so no recorded history takes these branches."""
        joined = self._joined()
        for res in results:
            if not (res.relays_failed or res.relays_passed):
                continue
            taken, back = self._relay_health.report(joined, res.relays_failed, res.relays_passed, workflow.time())
            for address in taken:
                self.ledger.note_event("relay_out", address, workflow.time())
                workflow.logger.warning("relay_out", extra={"address": address, "reason": "failed data-plane check"})
            for address in back:
                self.ledger.note_event("relay_back", address, workflow.time())
                workflow.logger.info("relay_back", extra={"address": address})
                self._republish_wanted = self.state.trainer_ready

    @workflow.update(name=contract.RELAY_LEAVING)
    def relay_leaving(self, info: RelayInfo) -> bool:
        """A relay on notice (laminar/notice.py) leaves the chain at once instead of by heartbeat timeout; the
        trainer's next push goes to the chain without it. No republish: the relay keeps serving until what it was
        sent has been forwarded, so the chain that remains holds every version it did (a killed relay's leaving
        does ask for one: it may have died mid-broadcast). False: that incarnation had left already. Its run_relay
        activity then returns; the watcher waits for the relay's worker to come back."""
        self._updates += 1
        known = self.state.relays.get(info.relay_id)
        if known is None or known.address != info.address:
            return False
        self._lose_relay(info.relay_id, republish=False)
        self.ledger.note_event("relay_leaving", info.relay_id, workflow.time())
        return True

    @workflow.signal(name=contract.RELAY_JOINED)
    def relay_joined(self, info: RelayInfo) -> None:
        if self._cfg is not None and info.relay_id not in self._relay_ids():
            return  # `laminar scale --relays` removed it: a late join does not put it back in the chain
        known = self.state.relays.get(info.relay_id)
        if known is not None and known.address != info.address:
            # a new incarnation of the relay (its process restarted): the old one is gone
            self._lose_relay(info.relay_id)
        if known is None or known.address != info.address:  # new to the chain (not a hand-over's rejoin)
            self._republish_wanted = self.state.trainer_ready
        self.state.relays[info.relay_id] = info
        self._rejoined_relays.add(info.relay_id)
        self.ledger.note_event("relay_joined", info.relay_id, workflow.time())

    @workflow.signal(name=contract.TRAINER_CHECKPOINTED)
    def trainer_checkpointed(self, ref: CheckpointRef) -> None:
        """The trainer left on notice between steps and wrote a deadline checkpoint (workers/processes.py): the
        ledger commits it if the run is still at its step, so the successor redoes no step. No patch: the
        handler issues no command, and only trainers of this code send the signal, so no recorded history
        holds it."""
        if self._cfg is not None:
            self.ledger.commit_deadline_checkpoint(ref, self._cfg.trainer.keep_last, workflow.time())

    @workflow.signal(name=contract.WORKFLOW_RESET)
    def workflow_reset(self, reset: WorkflowReset) -> None:
        """The repairer (services/repair.py) reset this run's wedged workflow to an earlier workflow task: noted
        for the status and the run's events. No patch: the handler issues no command, and only a repairer of this
        code sends it, so no recorded history holds it."""
        self.ledger.note_reset(reset, workflow.time())

    # -- trainer -----------------------------------------------------------------------------

    async def _init_trainer(self) -> None:
        assert self._cfg is not None
        try:
            res: TrainerInitResult = await workflow.execute_activity(
                contract.INIT_TRAINER,
                TrainerInitInput(
                    run_id=self.state.run_id,
                    config=self._cfg.to_json(),
                    checkpoint=self.state.checkpoint,
                    relay_chain=self._chain(),
                ),
                result_type=TrainerInitResult,
                task_queue=TRAINER_QUEUE,
                start_to_close_timeout=timeouts.TRAINER_ATTEMPT,
                heartbeat_timeout=timedelta(seconds=self._cfg.trainer.heartbeat_timeout_s),
                retry_policy=timeouts.RETRY_UNTIL_REPLACED,
                summary=f"init trainer at step {self.state.step}",
            )
        except ActivityError as e:
            _fail_run_if_permanent(e, contract.INIT_TRAINER)
            raise
        self.state.step, self.state.policy_version, self.state.trainer_ready = res.step, res.policy_version, True
        self._version_pushed_at = workflow.time()
        self.state.trainer_ready_at = workflow.time()

    async def _republish(self) -> None:
        """A relay joined the chain or left it: have the trainer push its current version again. In a barrier
        mode (sync, one_step, stream) the replicas wait for that version, and a master relay that died before
        forwarding it (or a relay that came back empty) would otherwise wedge the run: no step comes to publish
        a newer one. Best effort: a failure is logged, never fatal (a later chain change asks again)."""
        self._republish_wanted = False
        try:
            await workflow.execute_activity(
                contract.REPUBLISH,
                RepublishInput(run_id=self.state.run_id, step=self.state.step, relay_chain=self._chain()),
                result_type=int,
                task_queue=TRAINER_QUEUE,
                # bounded even with no trainer polling (it is restarting): stop and continue-as-new wait on this
                schedule_to_close_timeout=timeouts.REPUBLISH_IN_ALL,
                start_to_close_timeout=timeouts.REPUBLISH_ATTEMPT,
                retry_policy=timeouts.REPUBLISH_RETRY,
                summary=f"republish the version of step {self.state.step}",
            )
        except ActivityError as e:
            workflow.logger.warning("republish_failed", extra={"error": str(e)})
        self._version_pushed_at = workflow.time()

    def _note_version_missing(self, report: ReplicaReport) -> None:
        """A replica needs a version and no relay holds any of this run's (a relay dropped it, or every relay
        restarted while the trainer served another run): push it again, as for a chain change. Replicas poll
        every 0.5 s, so a report within VERSION_MISSING_GRACE_S of a push may predate it and is not acted on.
        No patch: only replicas of this code set version_missing, so no recorded history takes this branch."""
        if (not report.version_missing or not self.state.trainer_ready or self._republish_wanted
                or workflow.time() - self._version_pushed_at < timeouts.VERSION_MISSING_GRACE_S):
            return
        self._republish_wanted = True
        self.ledger.note_event("version_missing", report.replica_id, workflow.time())
        workflow.logger.warning("version_missing", extra={"replica_id": report.replica_id,
                                                          "policy_version": self.state.policy_version})

    def _hints(self, replica_id: str) -> dict[str, Any]:
        """What every answer to a replica carries besides its own result: its repack part and whether the
        trainer is starved."""
        return {"migrate": self.migrations.order_for(replica_id), "incoming": self.migrations.incoming_for(replica_id),
                "hold_version": self.migrations.hold_for(replica_id), "trainer_starved": self._trainer_starved()}

    def _trainer_starved(self) -> bool:
        """The trainer is idle for want of complete groups (so a replica should not hold one back to batch
        its reports: that wait would be the trainer's)."""
        if self._ahead:  # starved as its running step ends: no step is scheduled behind it and no batch is there
            return (self.state.trainer_ready and not self.state.paused and len(self._flights) <= 1
                    and not self._has_batch())
        return self.state.trainer_ready and not self._training and not self.state.paused and not self._has_batch()

    def _has_batch(self) -> bool:
        """The run mode's policy has a batch for the trainer (laminar/policy.py trainer_batch); with train-ahead,
        for the step after those in flight, while the run has that step to take and there is room to schedule it."""
        assert self._policy is not None and self._cfg is not None
        if self.state.paused:
            return False
        if not self._ahead:
            return self.ledger.trainable(self._policy) is not None
        in_flight = self._in_flight_batches()
        return (len(self._flights) <= self._train_ahead() and self.state.step + len(in_flight) < self._cfg.run.steps
                and self.ledger.trainable_after(self._policy, in_flight) is not None)

    def _train_ahead(self) -> int:
        """Trainer activities scheduled behind the running one: TRAIN_AHEAD, or none with trainer.keep_last 1. Two
        activities in flight name restore points at most one commit apart; a trainer that runs the later one
        first (after a crash) deletes checkpoints older than its input's oldest retained one, which holds the
        earlier input's restore point only when the run keeps two or more."""
        assert self._cfg is not None
        return TRAIN_AHEAD if self._cfg.trainer.keep_last >= 2 else 0

    def _in_flight_batches(self) -> list[list[str]]:
        """The group ids of every step in flight, in step order."""
        return [[g for part in inp.batch for g in part.group_ids] for f in self._flights for inp in f.inputs]

    def _trainer_returned(self) -> bool:
        """(train-ahead) the oldest trainer activity in flight has returned: its steps are to commit."""
        return bool(self._flights) and self._flights[0].handle.done()

    async def _wait_for_batch(self) -> bool:
        """Wait until the trainer has a full batch of complete groups, or the history segment is full (a
        paused or starved run still continues as new); False when the run is stopping."""
        t0, idle = workflow.time(), not self._flights
        await workflow.wait_condition(lambda: self.state.stopping or self._has_batch() or self._segment_full()
                                      or self._failed_replica() is not None or self._republish_wanted
                                      or bool(self.state.leaving and self._left_replicas())
                                      or self._trainer_returned())
        if idle:
            self.state.trainer_wait_s += workflow.time() - t0
        if self.state.leaving:
            self._retire_left()
        self._fail_if_a_replica_failed()
        return not self.state.stopping

    def _failed_replica(self) -> str | None:
        """A replica activity that failed: it retries without limit, so only a permanent error (a
        ConfigError in the replica, say) ends it that way."""
        return next((r for r, t in self._replicas.items()
                     if t.done() and not t.cancelled() and t.exception() is not None), None)

    def _fail_if_a_replica_failed(self) -> None:
        replica_id = self._failed_replica()
        if replica_id is not None:
            error = self._replicas[replica_id].exception()
            if isinstance(error, ActivityError):
                _fail_run_if_permanent(error, f"rollout {replica_id}")
            raise ApplicationError(f"rollout {replica_id} failed: {error}", type="ReplicaFailed", non_retryable=True)

    async def _train_one_step(self) -> None:
        """One trainer activity: one step, or (stream) every minibatch step up to the batch's publish whose groups
        are all complete, back to back: the trainer then waits for no workflow round trip between them."""
        assert self._cfg is not None and self._policy is not None
        limit = min(steps_to_publish(self._policy, self.state.step), self._cfg.run.steps - self.state.step)
        inputs = self._with_checks(self.ledger.next_train_inputs(self._cfg, self._chain(), limit))
        first = inputs[0]
        t0 = workflow.time()
        try:
            if len(inputs) == 1:
                results = [await workflow.execute_activity(
                    contract.TRAIN_STEP, first, result_type=TrainStepResult,
                    summary=f"train step {first.step + 1}: {sum(len(p.group_ids) for p in first.batch)} groups",
                    **self._train_options())]
            else:
                results = await workflow.execute_activity(
                    contract.TRAIN_STEPS, TrainStepsInput(first=first, then=[i.batch for i in inputs[1:]]),
                    result_type=list[TrainStepResult],
                    summary=f"train steps {first.step + 1}-{inputs[-1].step + 1}: "
                            f"{sum(len(p.group_ids) for i in inputs for p in i.batch)} groups", **self._train_options())
        except ActivityError as e:
            _fail_run_if_permanent(e, f"train_step {first.step}")
            raise
        self.state.trainer_busy_s += workflow.time() - t0
        self._commit_steps(inputs, results)

    def _with_checks(self, inputs: list[TrainStepInput]) -> list[TrainStepInput]:
        """The relays out of the chain go with each step (the trainer probes them); one step per activity in
        histories from before `train-steps`."""
        if relays_out := self._relay_health.relays_out(self._joined()):
            inputs = [dataclasses.replace(i, relays_out=relays_out) for i in inputs]
        if len(inputs) > 1 and not workflow.patched("train-steps"):
            inputs = inputs[:1]
        return inputs

    def _train_options(self) -> dict[str, Any]:
        assert self._cfg is not None
        return dict(
            task_queue=TRAINER_QUEUE,
            start_to_close_timeout=timeouts.TRAINER_ATTEMPT,
            heartbeat_timeout=timedelta(seconds=self._cfg.trainer.heartbeat_timeout_s),
            retry_policy=timeouts.RETRY_UNTIL_REPLACED,
            cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        )

    def _commit_steps(self, inputs: list[TrainStepInput], results: list[TrainStepResult]) -> None:
        assert self._cfg is not None
        for inp, res in zip(inputs, results, strict=True):
            self.ledger.commit_step(inp, res, keep_last=self._cfg.trainer.keep_last, at=workflow.time())
        self._note_relay_checks(results)
        self._note_history()
        self._maybe_repack(after_step=True)

    # -- train-ahead: the next step is scheduled while one runs ------------------------------

    def _advance_trainer(self) -> None:
        """Commit the oldest trainer activity if it returned, then schedule the next ones whose batches
        are complete, up to TRAIN_AHEAD behind the running one. The trainer's queue runs one activity at a time, so
        the next starts as the running one returns: the step's result is recorded while the next step runs, and
        no step waits for a workflow task. A step scheduled ahead counts against rollout.max_ready_groups (its
        groups stay ready until it commits), and its input is whole on its own (Ledger.train_inputs_after), so a
        trainer that restarts, or runs the two out of order after a crash, rewinds as for any step."""
        if self._trainer_returned():  # one a call: the run loop looks for a continue-as-new between steps
            self._commit_flight(self._flights.pop(0))
        while len(self._flights) <= self._train_ahead() and self._has_batch() and self._schedule_steps():
            pass
        self._training = bool(self._flights)

    def _schedule_steps(self) -> bool:
        """Schedule the next trainer activity (the steps after those in flight); False when there was none."""
        assert self._cfg is not None and self._policy is not None
        in_flight = self._in_flight_batches()
        step = self.state.step + len(in_flight)
        limit = min(steps_to_publish(self._policy, step), self._cfg.run.steps - step)
        inputs = self._with_checks(self.ledger.train_inputs_after(self._cfg, self._chain(), in_flight, limit)
                                   if limit > 0 else [])
        if not inputs:
            return False
        if in_flight:
            inputs[0] = dataclasses.replace(inputs[0], ahead=True)
        self._note_handover_stall()
        first = inputs[0]
        if len(inputs) == 1:
            handle = workflow.start_activity(
                contract.TRAIN_STEP, first, result_type=TrainStepResult,
                summary=f"train step {first.step + 1}: {sum(len(p.group_ids) for p in first.batch)} groups",
                **self._train_options())
        else:
            handle = workflow.start_activity(
                contract.TRAIN_STEPS, TrainStepsInput(first=first, then=[i.batch for i in inputs[1:]]),
                result_type=list[TrainStepResult],
                summary=f"train steps {first.step + 1}-{inputs[-1].step + 1}: "
                        f"{sum(len(p.group_ids) for i in inputs for p in i.batch)} groups", **self._train_options())
        self._flights.append(_TrainFlight(inputs=inputs, handle=handle, scheduled_at=workflow.time()))
        return True

    def _commit_flight(self, flight: _TrainFlight) -> None:
        """A returned trainer activity: its steps commit (a permanent failure fails the run)."""
        try:
            out = flight.handle.result()
        except ActivityError as e:
            _fail_run_if_permanent(e, f"train_step {flight.inputs[0].step}")
            raise
        results = [out] if len(flight.inputs) == 1 else out
        now = workflow.time()
        # busy from when it could start: its scheduling, or the return of the activity ahead of it
        self.state.trainer_busy_s += now - max(flight.scheduled_at, self._trainer_free_at)
        self._trainer_free_at = now
        self._commit_steps(flight.inputs, results)
        self.state.last_step_at = self._version_pushed_at = now
        self._upsert_search_attributes()

    async def _settle_trainer(self) -> None:
        """(train-ahead) Wait for every trainer activity in flight and commit them, scheduling none: before a
        continue-as-new or the end of the run."""
        while self._flights:
            await workflow.wait_condition(self._trainer_returned)
            self._commit_flight(self._flights.pop(0))
        self._training = False

    def _maybe_repack(self, after_step: bool = False) -> None:
        """Dynamic repack (laminar mode): plan every rollout.repack_every_s of the engine's time and right after
        each trainer step; the orders reach the replicas in their next answers (workflows/migrations.py)."""
        assert self._cfg is not None and self._policy is not None
        if not self._policy.repacks or self._handover or self.state.stopping:
            return
        r = self._cfg.rollout
        every_s = r.repack_every_s / self._cfg.time_scale
        now = workflow.time()
        if not after_step and now - self.state.last_plan_at < every_s:
            return
        if not workflow.patched("repack"):
            return
        self.migrations.plan(c_max=r.repack_c_max, at=now, batch_limit=self._cfg.decode_batch_limit)

    # -- rollout replicas --------------------------------------------------------------------

    def _replica_ids(self) -> list[str]:
        """The replicas the run should have: rollout.replicas of them until a `laminar scale` (workflows/scale.py)."""
        assert self._cfg is not None
        if self.state.pool:  # a run in a slot pool runs only what it is granted (none before its first grant)
            return list(self.state.replica_ids)
        return list(self.state.replica_ids) or replica_ids(self._cfg.rollout.replicas)

    def _start_replicas(self) -> None:
        for replica_id in self._replica_ids():
            self._start_replica(replica_id)

    def _start_replica(self, replica_id: str) -> None:
        assert self._cfg is not None
        self._replicas[replica_id] = workflow.start_activity(
            contract.RUN_ROLLOUT_REPLICA,
            RolloutReplicaInput(
                run_id=self.state.run_id,
                workflow_id=workflow.info().workflow_id,
                replica_id=replica_id,
                config=self._cfg.to_json(),
                generation=self.state.continued_as_new,
            ),
            task_queue=ROLLOUT_QUEUE,
            start_to_close_timeout=timeouts.SEGMENT_ACTIVITY,
            heartbeat_timeout=timedelta(seconds=self._cfg.rollout.heartbeat_timeout_s),
            retry_policy=timeouts.RETRY_UNTIL_REPLACED,
            activity_id=f"rollout-{replica_id}",
            summary=f"rollout {replica_id} (segment {self.state.continued_as_new})",
        )

    @workflow.update(name=contract.CLAIM_PROMPTS)
    def claim_prompts(self, inp: ClaimPromptsInput) -> ClaimPromptsResult:
        self._updates += 1
        return self._claim(inp)

    def _claim(self, inp: ClaimPromptsInput) -> ClaimPromptsResult:
        """A claim, by itself (claim_prompts) or carried by a report (add_experience): idempotent by request id."""
        assert self._cfg is not None and self._policy is not None
        replica_id = inp.report.replica_id
        self.ledger.note_report(inp.report, at=workflow.time())
        self._note_version_missing(inp.report)
        resume_ok: list[str] = []
        departed = inp.first_claim and replica_id in self.state.departed
        if inp.first_claim:
            if departed:
                self.state.departed.remove(replica_id)
            self.migrations.forget(replica_id)
            self.ledger.release_leases_of(replica_id, keep=set(inp.resuming))
            resume_ok = self.ledger.held_by(replica_id, inp.resuming)
            if inp.attempt > 1:
                self.ledger.rejoin(replica_id, workflow.time())
        if inp.handoff is not None:
            self.migrations.hand_off(replica_id, inp.handoff, workflow.time())
        if inp.taken:
            self.migrations.take(replica_id, inp.taken, workflow.time())
        stop, handover, leave = self.state.stopping, self._handover, self._leaving(replica_id)
        leases = self.ledger.replay_claim(replica_id, inp.request_id)
        if leases is None:
            if inp.departure is not None:  # it leaves: its groups go to a replica of their version, or back
                self.migrations.depart(replica_id, inp.departure, list(self.state.leaving), workflow.time())
            leases = []
            if not (stop or handover or leave or inp.departure or self.state.paused or not self.state.trainer_ready):
                room = self._cfg.rollout.max_ready_groups - len(self.state.ready)
                fresh = fresh_lease_room(self._policy, self.state.prompt_cursor, self.state.policy_version,
                                         self.state.groups_generated + self.state.groups_failed)
                leases = self.ledger.lease(replica_id, max(0, min(inp.max_groups, room)), fresh, claimer=inp.report,
                                           at=workflow.time())
            self.ledger.remember_claim(replica_id, inp.request_id, leases)
        self._maybe_repack()
        return ClaimPromptsResult(
            leases=leases,
            newest_policy_version=self.state.policy_version,
            relays=[r for _, r in sorted(self.state.relays.items()) if r.address in self._chain()],
            stop=stop,
            handover=handover,
            leave=leave,
            paused=self.state.paused,
            resume_ok=resume_ok,
            departed=departed,
            **self._hints(replica_id),
        )

    @claim_prompts.validator
    def _validate_claim(self, inp: ClaimPromptsInput) -> None:
        _check_claim(inp)
        if self._error is not None:
            raise ValueError(f"run failed validation: {self._error}")

    @workflow.update(name=contract.ADD_EXPERIENCE)
    def add_experience(self, inp: AddExperienceInput) -> AddExperienceResult:
        """A report: its complete groups become ready, its failed ones are closed; a claim it carries is answered
        after them, as a claim_prompts update that follows it would be (no patch: the handler issues no command,
        and a recorded history's reports carry no claim)."""
        self._updates += 1
        self.ledger.note_report(inp.report, at=workflow.time())
        accepted, duplicates = self.ledger.add_segment(
            inp.segment, inp.report.replica_id, workflow.time(), inp.tokens_regenerated, inp.reprefill_tokens
        )
        # failed groups: leases closed as failed, never ready (empty in histories written before the field)
        failed = self.ledger.fail_groups(inp.failed, inp.report.replica_id, workflow.time()) if inp.failed else []
        claim = self._claim(inp.claim) if inp.claim is not None else None
        if claim is None:
            self._maybe_repack()
        return AddExperienceResult(
            accepted=accepted, duplicates=duplicates, stop=self.state.stopping,
            handover=self._handover, leave=self._leaving(inp.report.replica_id),
            failed=failed, claim=claim, **self._hints(inp.report.replica_id),
        )

    @add_experience.validator
    def _validate_add(self, inp: AddExperienceInput) -> None:
        if inp.claim is not None:
            _check_claim(inp.claim)
            if self._error is not None:
                raise ValueError(f"run failed validation: {self._error}")
        if inp.failed and not inp.segment.key and not inp.segment.group_ids:
            return  # only failed groups to report
        if not inp.segment.key or not inp.segment.group_ids:
            raise ValueError("add_experience: segment must have a key and at least one group id")

    # -- operator controls -------------------------------------------------------------------

    @workflow.update(name=contract.PAUSE)
    def pause(self) -> str:
        self._updates += 1
        self.state.paused = True
        self._upsert_search_attributes()
        return self._phase()

    @workflow.update(name=contract.RESUME)
    def resume(self) -> str:
        self._updates += 1
        self.state.paused = False
        self._upsert_search_attributes()
        return self._phase()

    @workflow.update(name=contract.STOP)
    def stop(self) -> str:
        self._updates += 1
        self.state.stopping = True
        self._upsert_search_attributes()
        return self._phase()

    @workflow.update(name=contract.SCALE)
    def scale(self, inp: ScaleInput) -> ScaleResult:
        """`laminar scale`: start replicas on free slots, or ask the chosen ones to leave (workflows/scale.py)."""
        self._updates += 1
        if not workflow.patched("scale"):
            raise ApplicationError("this run's workers predate `laminar scale`", type="ScaleUnsupported")
        relays_started, relays_removed = self._scale_relays(inp.relays) if inp.relays is not None else ([], [])
        if inp.replicas is None:
            res = ScaleResult(replicas_target=len(self._replica_ids()), started=[], removed=[])
        elif self.state.pool:
            res = self._scale_ask(inp.replicas)
        else:
            res = self._scale_to(inp.replicas)
        return dataclasses.replace(res, relays_target=len(self._relay_ids()), relays_started=relays_started,
                                   relays_removed=relays_removed)

    def _scale_to(self, target: int) -> ScaleResult:
        """Bring the running replicas to `target` (`laminar scale`, or a slot pool's grant): start new ones, or ask the
        chosen ones to leave (workflows/scale.py)."""
        active = [r for r in self._replica_ids() if r not in self.state.leaving]
        held: dict[str, int] = {}
        for lease in self.state.open_leases.values():
            held[lease.replica_id] = held.get(lease.replica_id, 0) + 1
        plan = plan_scale(active, list(self.state.leaving), held, target, least=0 if self.state.pool else 1)
        at = workflow.time()
        for replica_id in plan.remove:
            self.state.leaving.append(replica_id)
            self.migrations.forget(replica_id)
            self.ledger.note_event("replica_leaving", replica_id, at, held.get(replica_id, 0))
        self.state.replica_ids = plan.active
        if not self._handover and not self._closing and not self.state.stopping:
            for replica_id in plan.start:
                self._start_replica(replica_id)
                self.ledger.note_event("replica_added", replica_id, at)
        # (a segment handing over starts the new ids in the next segment, from state.replica_ids)
        return ScaleResult(replicas_target=len(plan.active), started=plan.start, removed=plan.remove)

    def _scale_relays(self, target: int) -> tuple[list[str], list[str]]:
        """`laminar scale --relays`: new hosts' relays are watched (each joins the chain when its relay worker
        polls); removed ones leave the chain at once (their watcher and activity are cancelled, the trainer
        republishes to the chain that remains)."""
        start, remove = plan_relays(self._relay_ids(), target)
        at = workflow.time()
        self.state.relay_ids = sorted([r for r in self._relay_ids() if r not in remove] + start, key=replica_index)
        for relay_id in remove:
            for key in (relay_id, f"{relay_id}/rejoin"):
                task = self._relay_tasks.pop(key, None)
                if task is not None and not task.done():
                    task.cancel()
            self._lose_relay(relay_id)
            self.ledger.note_event("relay_removed", relay_id, at)
        if not self._handover and not self._closing and not self.state.stopping:
            for relay_id in start:
                self._relay_tasks[relay_id] = asyncio.create_task(self._watch_relay(relay_id))
                self.ledger.note_event("relay_added", relay_id, at)
        return start, remove

    @scale.validator
    def _validate_scale(self, inp: ScaleInput) -> None:
        if self._error is not None:
            raise ValueError(f"run failed validation: {self._error}")
        if inp.replicas is None and inp.relays is None:
            raise ValueError("scale: give replicas, relays or both")
        if inp.replicas is not None:
            check_target(inp.replicas)
        if inp.relays is not None:
            plan_relays(self._relay_ids(), inp.relays)  # raises on a target out of range
        if self.state.stopping or self._finished:
            raise ValueError(f"scale: run {self.state.run_id} is {self._phase()}; a stopping run is not scaled")

    def _leaving(self, replica_id: str) -> bool:
        return replica_id in self.state.leaving

    def _left_replicas(self) -> list[str]:
        """Removed replicas whose activity has returned (or whose activity this segment never started)."""
        return [r for r in self.state.leaving if r not in self._replicas or self._replicas[r].done()]

    def _retire_left(self) -> None:
        """A removed replica returned. It handed its unfinished groups to others as it left (Departure); what it
        still holds (it died before that, or predates departures) goes back to the pool, as a lost replica's does."""
        for replica_id in self._left_replicas():
            self.migrations.forget(replica_id)  # orders to or from it since the scale are void
            released = self.ledger.release_leases_of(replica_id, keep=set())
            self.state.scale_groups_returned += len(released)
            self.state.leaving.remove(replica_id)
            if replica_id in self.state.departed:
                self.state.departed.remove(replica_id)  # no next incarnation to tell
            self.state.replicas.pop(replica_id, None)
            self.state.last_claims.pop(replica_id, None)
            self._replicas.pop(replica_id, None)
            self.ledger.note_event("replica_left", replica_id, workflow.time(), len(released))

    @workflow.query(name=contract.STATUS)
    def status(self) -> RunStatus:
        st = self.ledger.status(
            phase=self._phase(),
            total_steps=self._cfg.run.steps if self._cfg else 0,
            history_events=workflow.info().get_current_history_length(),
            training=self._training,
            **self._watchdog_facts(),
        )
        if self._cfg is None:
            return st
        return dataclasses.replace(
            st, replicas_target=self._ask() if self.state.pool else len(self._replica_ids()),
            replicas_running=sum(1 for t in self._replicas.values() if not t.done()),
            scale_groups_returned=self.state.scale_groups_returned, relays_target=len(self._relay_ids()))

    def _watchdog_facts(self) -> dict[str, Any]:
        if self._cfg is None:
            return {}
        return {"stall_warn_s": self._cfg.run.stall_warn_s, "replicas_wanted": self._cfg.rollout.replicas,
                "has_batch": self._has_batch(), **self._grant_facts()}

    async def _watchdog(self) -> None:
        """Look every run.stall_warn_s / 2 even while nothing reaches the workflow (every worker silent): a timer
        is the only thing that wakes a run that waits on processes that are gone or stopped."""
        assert self._cfg is not None
        tick = timedelta(seconds=self._cfg.run.stall_warn_s / 2)
        while not self._closing:
            try:
                await workflow.sleep(tick)
            except asyncio.CancelledError:
                return
            self._watch()

    def _watch(self) -> None:
        """The watchdog (laminar/watchdog.py) at a _watchdog tick, in workflow time: a stall that starts appends one
        `stall` run event naming what the run waits for (a change of what it waits for is a new one). A batch
        that is there with no step in flight is not looked at: the main loop starts that step in this same
        workflow task (an update just completed the batch), so it is no wait."""
        if self._cfg is None or (self._has_batch() and not self._training):
            return
        d = watchdog.diagnose(watchdog.facts_of_status(self.status(), workflow.time()))
        waits_for = d[0] if d is not None else ""
        if waits_for and waits_for != self.state.stall:
            self.ledger.note_event("stall", waits_for, workflow.time())
            workflow.logger.warning("stall", extra={"waits_for": waits_for, "reason": d[1] if d else ""})
        self.state.stall = waits_for

    def _phase(self) -> str:
        if self._error is not None:
            return "failed"
        if self._finished:
            return "finished"
        if self.state.stopping or self.state.step >= (self._cfg.run.steps if self._cfg else 0):
            return "stopping"
        if self.state.paused:
            return "paused"
        return "running" if self.state.trainer_ready else "starting"

    # -- the slot pool: a run on a shared worker set runs min(ask, grant) replicas (workflows/pool.py) ------

    def _ask(self) -> int:
        """The replicas the run asks for: rollout.replicas, or its last `laminar scale` target."""
        assert self._cfg is not None
        return self.state.replicas_asked or self._cfg.rollout.replicas

    def _scale_ask(self, replicas: int) -> ScaleResult:
        """`laminar scale` on a pooled run changes its ask: the pool hears it, and the run runs min(ask, grant)."""
        self.state.replicas_asked = replicas
        self._ask_unsent = True
        res = self._apply_grant()
        return ScaleResult(replicas_target=replicas, started=res.started if res else [],
                           removed=res.removed if res else [])

    @workflow.signal(name=contract.REPLICA_GRANT)
    def replica_grant(self, grant: ReplicaGrant) -> None:
        if not self.state.pool:
            return  # not a pooled run: a stray signal changes nothing
        self.state.grant, self.state.grant_note = max(0, grant.granted), grant.note
        self._apply_grant()

    def _apply_grant(self) -> ScaleResult | None:
        """Start or retire replicas so that min(ask, grant) run, by `laminar scale`'s own path (retired ones leave
        gracefully). Before run() has started the replicas, or while the run stops, only the grant is kept."""
        if (not self.state.pool or self._cfg is None or self._error is not None or not self._replicas_started
                or self.state.stopping or self._finished):
            return None
        target = min(self._ask(), max(0, self.state.grant))
        if target == len([r for r in self._replica_ids() if r not in self.state.leaving]):
            return None
        return self._scale_to(target)

    async def _tell_pool(self) -> None:
        """State the run's ask to its slot pool at the start of each segment and after each scale; a pool that does
        not take the signal (it is not running) is asked again every POOL_RETRY_S."""
        assert self._cfg is not None
        while not self._closing:
            await workflow.wait_condition(lambda: self._ask_unsent or self._closing)
            if self._closing:
                return
            self._ask_unsent = False
            r = self._cfg.rollout
            ask = PoolAsk(run_id=self.state.run_id, workflow_id=workflow.info().workflow_id, replicas=self._ask(),
                          quota=min(r.quota, self._ask()), engine=r.engine)
            try:
                await workflow.get_external_workflow_handle(self.state.pool).signal(contract.POOL_ASK, ask)
                self.state.pool_error = ""
            except FailureError as e:
                self.state.pool_error = f"slot pool {self.state.pool} did not take the run's ask ({e}); asking again"
                self._ask_unsent = True
                await workflow.sleep(timedelta(seconds=timeouts.POOL_RETRY_S))

    async def _leave_pool(self) -> None:
        """A finished or stopped run gives its slots back at once (a failed one: the pool finds it gone)."""
        if not self.state.pool or not workflow.patched("slot-pool"):
            return
        try:
            await workflow.get_external_workflow_handle(self.state.pool).signal(contract.POOL_LEAVE, self.state.run_id)
        except FailureError as e:
            workflow.logger.warning("pool_leave_failed", extra={"pool": self.state.pool, "error": str(e)})

    def _grant_note(self) -> str:
        if not self.state.pool:
            return ""
        if self.state.pool_error:
            return self.state.pool_error
        if self.state.grant < 0:
            return f"waiting for a grant from slot pool {self.state.pool}"
        return self.state.grant_note

    def _grant_facts(self) -> dict[str, Any]:
        if not self.state.pool:
            return {}
        return {"replicas_granted": self.state.grant, "grant_note": self._grant_note(), "replicas_wanted": self._ask()}

    # -- continue-as-new and finish ----------------------------------------------------------

    def _segment_full(self) -> bool:
        """The history segment is near a server limit (events, updates) or the server suggests a new one."""
        assert self._cfg is not None
        info = workflow.info()
        return (info.get_current_history_length() >= self._cfg.run.history_events_per_segment
                or self._updates >= self._cfg.run.updates_per_segment
                or info.is_continue_as_new_suggested())

    def _should_continue_as_new(self) -> bool:
        assert self._cfg is not None
        if self.state.step >= self._cfg.run.steps or self.state.stopping:
            return False
        every = self._cfg.run.continue_as_new_every
        forced = every > 0 and self.state.step > self._segment_first_step and self.state.step % every == 0
        return forced or self._segment_full()

    async def _drain(self) -> None:
        """Let replicas write their in-flight groups to the partial pool and return, then stop relays."""
        try:
            await workflow.wait_condition(
                lambda: all(t.done() for t in self._replicas.values()), timeout=timeouts.DRAIN
            )
        except TimeoutError:
            workflow.logger.warning("replicas_drain_timed_out")
        self._closing = True
        watchdog_task = [self._watchdog_task] if self._watchdog_task is not None else []
        for task in list(self._replicas.values()) + list(self._relay_tasks.values()) + watchdog_task:
            if not task.done():
                task.cancel()
        await workflow.wait_condition(lambda: all(t.done() for t in self._relay_tasks.values()))
        await workflow.wait_condition(workflow.all_handlers_finished)

    async def _continue_as_new(self) -> None:
        """Hand over to a new history segment. Not a barrier: replicas write their in-flight groups to the
        partial pool and return at their next contact, and the trainer keeps stepping on ready groups while
        they do. The chain and every lease, ready group and counter carry over in the state."""
        assert self._cfg is not None
        self._handover = True
        deadline = workflow.time() + timeouts.DRAIN.total_seconds()
        while not self._replicas_returned() and not self.state.stopping:
            try:
                await workflow.wait_condition(lambda: self._replicas_returned() or self.state.stopping
                                              or self._can_step() or self._trainer_returned(),
                                              timeout=max(0.0, deadline - workflow.time()))
            except TimeoutError:
                workflow.logger.warning("replicas_drain_timed_out")
                break
            if self._ahead:
                self._advance_trainer()
            elif self._can_step():
                await self._step()
        await self._settle_trainer()
        await self._drain()
        if self.state.leaving:
            self._retire_left()  # every replica has returned (or was cancelled): removed ones leave now
        self._note_history()
        self.state.continued_as_new += 1
        self.state.handover_last_step_at = self.state.last_step_at
        workflow.continue_as_new(contract.TrainingRunInput(config=self._cfg.to_json(), state=self.state),
                                 task_timeout=contract.WORKFLOW_TASK)

    def _can_step(self) -> bool:
        """A batch is there and the run still has steps to take (a finished run must not wait on it)."""
        assert self._cfg is not None
        return self._has_batch() and self.state.step < self._cfg.run.steps

    def _replicas_returned(self) -> bool:
        return all(t.done() for t in self._replicas.values())

    async def _finish(self) -> RunStatus:
        self.state.stopping = True
        await self._settle_trainer()
        await self._drain()
        await self._leave_pool()
        self._note_history()
        self._finished = True
        self._upsert_search_attributes()
        return self.ledger.status(
            phase="finished",
            total_steps=self._cfg.run.steps if self._cfg else 0,
            history_events=workflow.info().get_current_history_length(),
        )

    def _note_history(self) -> None:
        n = workflow.info().get_current_history_length()
        self.state.history_events_max = max(self.state.history_events_max, n)


def _fail_run_if_permanent(e: ActivityError, what: str) -> None:
    """A trainer activity retries without limit, so its failure reaching the workflow is permanent (a
    non-retryable ApplicationError: bad model path, no checkpoint that verifies, ...). Fail the run with
    that error's own type and message, not the generic "Activity task failed"; a cancellation passes."""
    cause = e.cause
    if isinstance(cause, ApplicationError) and cause.non_retryable:
        raise ApplicationError(f"{what} failed: {cause.message}", type=cause.type, non_retryable=True) from e


def _check_claim(inp: ClaimPromptsInput) -> None:
    if inp.max_groups < 0:
        raise ValueError(f"claim_prompts: max_groups={inp.max_groups} must be >= 0")


def _pool_of(inp: Any) -> str:
    """The slot pool a new run joins (`laminar start` sets it; "" for a run that owns its workers)."""
    return str(inp.get("pool") or "") if isinstance(inp, dict) else ""


def _parse_input(inp: Any) -> tuple[RunConfig, RunState | None]:
    """Validate the workflow input; ConfigError ends the run FAILED (never an endless task retry)."""
    if not isinstance(inp, dict) or "config" not in inp:
        raise ConfigError(
            'workflow input must be a JSON object {"config": {...run config...}}, '
            f"got {type(inp).__name__}: {str(inp)[:80]}"
        )
    cfg = RunConfig.from_json(inp["config"])
    state = inp.get("state")
    if state is None:
        return cfg, None
    try:
        return cfg, value_to_type(RunState, state)
    except Exception as e:  # a hand-written state that does not match RunState
        raise ConfigError(f"workflow input state does not match RunState: {e}") from None
