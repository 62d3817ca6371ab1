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
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from temporalio.converter import value_to_type

    from laminar import names, search, watchdog
    from laminar.config import RunConfig
    from laminar.errors import ConfigError
    from laminar.messages import (
        CONTROL_QUEUE,
        AddExperienceInput,
        AddExperienceResult,
        ClaimPromptsInput,
        ClaimPromptsResult,
        RelayInfo,
        ReplicaGrant,
        RunStatus,
        ScaleInput,
        ScaleResult,
        WorkflowReset,
    )
    from laminar.policy import Policy, fresh_lease_room, policy_for
    from laminar.refs import CheckpointRef
    from workflows import commands, timeouts
    from workflows.commands import Runtime
    from workflows.grants import SlotGrants
    from workflows.ledger import Ledger
    from workflows.migrations import Migrations
    from workflows.relay_chain import RelayChain
    from workflows.replica_set import ReplicaSet
    from workflows.scale import check_target, plan_relays
    from workflows.state import RunState, TrainingRunInput
    from workflows.trainer import Trainer

__all__ = ["TrainingRunWorkflow", "CONTROL_QUEUE"]

HANDOVER_STALLS_KEPT = 64  # hand-over stalls kept for the summary's p50 (max and count cover the whole run)
SEARCH_ATTRIBUTES_EVERY_S = 5.0  # step, version and reward are upserted at most this often (a phase change: at once)
TRAIN_AHEAD = 1  # trainer activities scheduled behind the running one (patch train-ahead; the trainer's queue runs
# one at a time, so the next starts as the running one returns, without waiting for a workflow task)


@workflow.defn(name=names.TRAINING_RUN_WORKFLOW)
class TrainingRunWorkflow:
    @workflow.init
    def __init__(self, inp: Any) -> None:
        self._error: str | None = None
        self._cfg: RunConfig | None = None
        self._policy: Policy | None = None  # the run mode's decisions (laminar/policy.py), from the config
        self._handover = False
        self._closing = False  # draining for continue-as-new or finish: relay watchers stop
        self._finished = False
        self._updates = 0  # updates handled in this history segment (the server caps them per run)
        self._search_upserted: tuple[str, float] = ("", 0.0)  # (phase, workflow time) of the last upsert
        self._watchdog_task: Any = None  # _watchdog's timer loop (patch `watchdog`)
        self._replicas_started = False  # run() started the replicas: a grant (slot pool) is applied from then on
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
        self.rt = Runtime()
        self.relays = RelayChain(self.state, self.ledger, self._cfg, self.rt, closing=lambda: self._closing,
                                 run_relay=lambda r, g: commands.run_relay(self.state.run_id, self._cfg, r, g))
        self.trainer = Trainer(self.state, self.ledger, self._cfg, self._policy, self.rt, self.relays,
                               train_steps_patched=lambda: workflow.patched("train-steps"),
                               committed=self._committed, stepped=self._upsert_search_attributes)
        self.replicas = ReplicaSet(
            self.state, self.ledger, self.migrations, self._cfg, self.rt,
            start=lambda r: commands.start_replica(self.state.run_id, self._cfg, r, self.state.continued_as_new),
            may_start=lambda: not self._handover and not self._closing and not self.state.stopping)
        self.grants = SlotGrants(self.state, self._cfg, self.rt, workflow.info().workflow_id,
                                 signal=commands.signal_pool, scale_to=self.replicas.scale_to, closing=lambda: self._closing,
                                 may_apply=lambda: self._error is None and self._replicas_started and not self._finished)

    # -- the run, as a table of contents -----------------------------------------------------

    @workflow.run
    async def run(self, inp: Any) -> RunStatus:
        if self._error is not None or self._cfg is None:
            raise ApplicationError(self._error or "invalid input", type="InvalidConfig", non_retryable=True)
        if self.state.pool and workflow.patched("slot-pool"):
            self.rt.spawn(self.grants.tell())  # the pool hears the ask while the trainer starts
        self.relays.start()
        await self.relays.wait_for_relays()
        if not self.state.trainer_ready:
            await self.trainer.init()
        self.replicas.start_all()
        self._replicas_started = True
        self.grants.apply()  # a pooled run: the replicas its grant allows
        if workflow.patched("watchdog"):
            self._watchdog_task = asyncio.create_task(self._watchdog())
        self._upsert_search_attributes()
        self.trainer.ahead = workflow.patched("train-ahead")
        while self.state.step < self._cfg.run.steps and not self.state.stopping:
            if self._should_continue_as_new():
                await self._continue_as_new()
            if not await self._wait_for_batch():
                break
            if self.relays.republish_wanted:
                await self.trainer.republish()
            if self.trainer.ahead:
                self.trainer.advance()
            elif self.trainer.has_batch():
                await self.trainer.step()
        return await self._finish()

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

    # -- relays (workflows/relay_chain.py) ---------------------------------------------------

    @workflow.update(name=names.RELAY_LEAVING)
    def relay_leaving(self, info: RelayInfo) -> bool:
        """A relay on notice (laminar/notice.py) leaves the chain at once instead of by heartbeat timeout; the
        trainer's next push goes to the chain without it. No republish: the relay keeps serving until what it was
        sent has been forwarded, so the chain that remains holds every version it did (a killed relay's leaving
        does ask for one: it may have died mid-broadcast). False: that incarnation had left already. Its run_relay
        activity then returns; the watcher waits for the relay's worker to come back."""
        self._updates += 1
        return self.relays.leaving(info)

    @workflow.signal(name=names.RELAY_JOINED)
    def relay_joined(self, info: RelayInfo) -> None:
        self.relays.joined_signal(info)

    @workflow.signal(name=names.TRAINER_CHECKPOINTED)
    def trainer_checkpointed(self, ref: CheckpointRef) -> None:
        """The trainer left on notice between steps and wrote a deadline checkpoint (workers/processes.py): the
        ledger commits it if the run is still at its step, so the successor redoes no step. No patch: the
        handler issues no command, and only trainers of this code send the signal, so no recorded history
        holds it."""
        if self._cfg is not None:
            self.ledger.commit_deadline_checkpoint(ref, self._cfg.trainer.keep_last, workflow.time())

    @workflow.signal(name=names.WORKFLOW_RESET)
    def workflow_reset(self, reset: WorkflowReset) -> None:
        """The repairer (services/repair.py) reset this run's wedged workflow to an earlier workflow task: noted
        for the status and the run's events. No patch: the handler issues no command, and only a repairer of this
        code sends it, so no recorded history holds it."""
        self.ledger.note_reset(reset, workflow.time())

    # -- trainer (workflows/trainer.py) -------------------------------------------------------

    def _hints(self, replica_id: str) -> dict[str, Any]:
        """What every answer to a replica carries besides its own result: its repack part and whether the
        trainer is starved."""
        return {"migrate": self.migrations.order_for(replica_id), "incoming": self.migrations.incoming_for(replica_id),
                "hold_version": self.migrations.hold_for(replica_id), "trainer_starved": self.trainer.starved()}

    async def _wait_for_batch(self) -> bool:
        """Wait until the trainer has a full batch of complete groups, or the history segment is full (a
        paused or starved run still continues as new); False when the run is stopping."""
        t0, idle = workflow.time(), not self.trainer.flights
        await workflow.wait_condition(lambda: self.state.stopping or self.trainer.has_batch() or self._segment_full()
                                      or self.replicas.failed() is not None or self.relays.republish_wanted
                                      or bool(self.state.leaving and self.replicas.left())
                                      or self.trainer.returned())
        if idle:
            self.state.trainer_wait_s += workflow.time() - t0
        if self.state.leaving:
            self.replicas.retire_left()
        self.replicas.fail_if_one_failed()
        return not self.state.stopping

    def _committed(self) -> None:
        """A trainer activity's steps committed: note the history's size, and plan a repack."""
        self._note_history()
        self._maybe_repack(after_step=True)

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

    @workflow.update(name=names.CLAIM_PROMPTS)
    def claim_prompts(self, inp: ClaimPromptsInput) -> ClaimPromptsResult:
        self._updates += 1
        return self._claim(inp)

    def _claim(self, inp: ClaimPromptsInput) -> ClaimPromptsResult:
        """A claim, by itself (claim_prompts) or carried by a report (add_experience): idempotent by request id."""
        assert self._cfg is not None and self._policy is not None
        replica_id = inp.report.replica_id
        self.ledger.note_report(inp.report, at=workflow.time())
        self.trainer.note_version_missing(inp.report)
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
        stop, handover, leave = self.state.stopping, self._handover, self.replicas.leaving(replica_id)
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
            relays=self.relays.members(),
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

    @workflow.update(name=names.ADD_EXPERIENCE)
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
            handover=self._handover, leave=self.replicas.leaving(inp.report.replica_id),
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

    @workflow.update(name=names.PAUSE)
    def pause(self) -> str:
        self._updates += 1
        self.state.paused = True
        self._upsert_search_attributes()
        return self._phase()

    @workflow.update(name=names.RESUME)
    def resume(self) -> str:
        self._updates += 1
        self.state.paused = False
        self._upsert_search_attributes()
        return self._phase()

    @workflow.update(name=names.STOP)
    def stop(self) -> str:
        self._updates += 1
        self.state.stopping = True
        self._upsert_search_attributes()
        return self._phase()

    @workflow.update(name=names.SCALE)
    def scale(self, inp: ScaleInput) -> ScaleResult:
        """`laminar scale`: start replicas on free slots, or ask the chosen ones to leave (workflows/scale.py)."""
        self._updates += 1
        if not workflow.patched("scale"):
            raise ApplicationError("this run's workers predate `laminar scale`", type="ScaleUnsupported")
        relays_started, relays_removed = ([], []) if inp.relays is None else self.relays.scale(
            inp.relays, start_watchers=not (self._handover or self._closing or self.state.stopping))
        if inp.replicas is None:
            res = ScaleResult(replicas_target=len(self.replicas.ids()), started=[], removed=[])
        elif self.state.pool:
            res = self.grants.scale_ask(inp.replicas)
        else:
            res = self.replicas.scale_to(inp.replicas)
        return dataclasses.replace(res, relays_target=len(self.relays.ids()), relays_started=relays_started,
                                   relays_removed=relays_removed)

    @scale.validator
    def _validate_scale(self, inp: ScaleInput) -> None:
        if self._error is not None:
            raise ValueError(f"run failed validation: {self._error}")
        if inp.replicas is None and inp.relays is None:
            raise ValueError("scale: give replicas, relays or both")
        if inp.replicas is not None:
            check_target(inp.replicas)
        if inp.relays is not None:
            plan_relays(self.relays.ids(), inp.relays)  # raises on a target out of range
        if self.state.stopping or self._finished:
            raise ValueError(f"scale: run {self.state.run_id} is {self._phase()}; a stopping run is not scaled")

    @workflow.query(name=names.STATUS)
    def status(self) -> RunStatus:
        st = self.ledger.status(
            phase=self._phase(),
            total_steps=self._cfg.run.steps if self._cfg else 0,
            history_events=workflow.info().get_current_history_length(),
            training=self.trainer.training,
            **self._watchdog_facts(),
        )
        if self._cfg is None:
            return st
        return dataclasses.replace(
            st, replicas_target=self.grants.ask() if self.state.pool else len(self.replicas.ids()),
            replicas_running=self.replicas.running(),
            scale_groups_returned=self.state.scale_groups_returned, relays_target=len(self.relays.ids()))

    def _watchdog_facts(self) -> dict[str, Any]:
        if self._cfg is None:
            return {}
        return {"stall_warn_s": self._cfg.run.stall_warn_s, "replicas_wanted": self._cfg.rollout.replicas,
                "has_batch": self.trainer.has_batch(), **self.grants.facts()}

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
        if self._cfg is None or (self.trainer.has_batch() and not self.trainer.training):
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

    # -- the slot pool: a run on a shared worker set runs min(ask, grant) replicas (workflows/grants.py) ---

    @workflow.signal(name=names.REPLICA_GRANT)
    def replica_grant(self, grant: ReplicaGrant) -> None:
        self.grants.granted(grant)

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
                self.replicas.returned, timeout=timeouts.DRAIN
            )
        except TimeoutError:
            workflow.logger.warning("replicas_drain_timed_out")
        self._closing = True
        watchdog_task = [self._watchdog_task] if self._watchdog_task is not None else []
        for task in list(self.replicas.tasks.values()) + list(self.relays.tasks.values()) + watchdog_task:
            if not task.done():
                task.cancel()
        await workflow.wait_condition(lambda: all(t.done() for t in self.relays.tasks.values()))
        await workflow.wait_condition(workflow.all_handlers_finished)

    async def _continue_as_new(self) -> None:
        """Hand over to a new history segment. Not a barrier: replicas write their in-flight groups to the
        partial pool and return at their next contact, and the trainer keeps stepping on ready groups while
        they do. The chain and every lease, ready group and counter carry over in the state."""
        assert self._cfg is not None
        self._handover = True
        deadline = workflow.time() + timeouts.DRAIN.total_seconds()
        while not self.replicas.returned() and not self.state.stopping:
            try:
                await workflow.wait_condition(lambda: self.replicas.returned() or self.state.stopping
                                              or self._can_step() or self.trainer.returned(),
                                              timeout=max(0.0, deadline - workflow.time()))
            except TimeoutError:
                workflow.logger.warning("replicas_drain_timed_out")
                break
            if self.trainer.ahead:
                self.trainer.advance()
            elif self._can_step():
                await self.trainer.step()
        await self.trainer.settle()
        await self._drain()
        if self.state.leaving:
            self.replicas.retire_left()  # every replica has returned (or was cancelled): removed ones leave now
        self._note_history()
        self.state.continued_as_new += 1
        self.state.handover_last_step_at = self.state.last_step_at
        workflow.continue_as_new(TrainingRunInput(config=self._cfg.to_json(), state=self.state),
                                 task_timeout=timeouts.WORKFLOW_TASK)

    def _can_step(self) -> bool:
        """A batch is there and the run still has steps to take (a finished run must not wait on it)."""
        assert self._cfg is not None
        return self.trainer.has_batch() and self.state.step < self._cfg.run.steps

    async def _finish(self) -> RunStatus:
        self.state.stopping = True
        await self.trainer.settle()
        await self._drain()
        if self.state.pool and workflow.patched("slot-pool"):
            await self.grants.leave()
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
