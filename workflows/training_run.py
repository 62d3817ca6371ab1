"""TrainingRunWorkflow: the durable owner of one RL run (docs/architecture/index.md: 'Parts', the two traces,
'Continue-as-new: the hand-over').

Owns step, policy version, committed checkpoint, prompt leases, the experience index, relay chain and
replica table. Rollout replicas and relays are long-running activities; each trainer step is one
activity on the trainer's queue. Deterministic: no I/O, no torch, activities called by name.

This class is the run's table of contents: `run` is the run from start to finish, the handlers are what the
outside tells it, and each part is a deterministic class of its own (tested without Temporal):

- workflows/ledger.py `Ledger`: exactly-once accounting over `RunState` (leases, experience, batches, counters);
  workflows/migrations.py `Migrations`: dynamic repack's lease hand-overs.
- workflows/relay_chain.py `RelayChain`: relay-chain supervision (watchers, joins, leaves, the chain).
- workflows/trainer.py `Trainer`: the trainer's batches, steps in flight (train-ahead), commits and republishes.
- workflows/replica_set.py `ReplicaSet`: the rollout replicas' activities, `laminar scale`, retiring removed ones.
- workflows/grants.py `SlotGrants`: a pooled run's ask and grant (workflows/pool.py is the pool).
- workflows/status.py `StatusBoard`: the phase, the status query, search attributes and the stall watchdog.
- workflows/evaluation.py `Evaluation`: held-out eval rounds during training (workflows/eval_rounds.py) on the
  replicas' claims, and each closed round's record (patch `eval-rounds`).
- workflows/segment.py `Segment`: this history segment's input, flags and counters, and when it is full.
- workflows/commands.py: every activity and signal the run issues, with its options, and the `Runtime` (time,
  timers, conditions, tasks) the parts wait with. The parts call Temporal only through these, so the order of
  the workflow's commands is set here and in `run` (tests/test_replay_golden.py replays recorded histories).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from laminar import contract, search
    from laminar.config import RunConfig, check_update_senders
    from laminar.contract import (
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
    from laminar.errors import ConfigError
    from laminar.policy import Policy, fresh_lease_room, policy_for
    from laminar.refs import CheckpointRef
    from laminar.rl.factory import decode_batch_limit, time_scale  # the engines' traits (deterministic)
    from laminar.workflows import commands, timeouts
    from laminar.workflows.carry import encode_state
    from laminar.workflows.commands import Runtime
    from laminar.workflows.evaluation import Evaluation
    from laminar.workflows.grants import SlotGrants
    from laminar.workflows.ledger import Ledger
    from laminar.workflows.migrations import Migrations
    from laminar.workflows.relay_chain import RelayChain
    from laminar.workflows.replica_set import ReplicaSet
    from laminar.workflows.scale import check_target, plan_relays
    from laminar.workflows.segment import Segment, parse_input, pool_of
    from laminar.workflows.state import RunState
    from laminar.workflows.status import StatusBoard
    from laminar.workflows.trainer import Trainer

__all__ = ["TrainingRunWorkflow", "CONTROL_QUEUE"]


@workflow.defn(name=contract.TRAINING_RUN_WORKFLOW)
class TrainingRunWorkflow:
    @workflow.init
    def __init__(self, inp: Any) -> None:
        self._cfg: RunConfig | None = None
        self._policy: Policy | None = None  # the run mode's decisions (laminar/policy.py), from the config
        self.seg = Segment()  # this history segment's flags and counters (workflows/segment.py)
        try:
            self._cfg, state = parse_input(inp)
            self._policy = policy_for(self._cfg)
            run_id = self._cfg.run.run_id or workflow.info().workflow_id.removeprefix("run/")
            self.state = state or RunState(run_id=run_id, started_at=workflow.time(), pool=pool_of(inp))
            self.seg.first_step = self.state.step
        except ConfigError as e:
            self.seg.error = str(e)
            self.state = RunState(run_id="invalid")
        cfg, seg, rt = self._cfg, self.seg, Runtime()
        self.rt = rt
        self.ledger = Ledger(self.state)
        self.migrations = Migrations(self.ledger)  # dynamic repack's lease hand-overs (workflows/migrations.py)
        self.relays = RelayChain(self.state, self.ledger, cfg, rt, closing=lambda: seg.closing,
                                 run_relay=lambda r, g: commands.run_relay(self.state.run_id, cfg, r, g))
        self.trainer = Trainer(self.state, self.ledger, cfg, self._policy, rt, self.relays,
                               train_steps_patched=lambda: workflow.patched("train-steps"),
                               committed=self._committed, stepped=lambda: self.board.upsert_search_attributes())
        self.evaluation = Evaluation(self.state, cfg, rt, record=commands.record_eval)
        self.replicas = ReplicaSet(
            self.state, self.ledger, self.migrations, cfg, rt, may_start=lambda: seg.may_start(self.state),
            start=self._start_replica,
            retired=self.evaluation.release)
        self.grants = SlotGrants(self.state, cfg, rt, workflow.info().workflow_id, signal=commands.signal_pool,
                                 scale_to=self.replicas.scale_to, closing=lambda: seg.closing,
                                 may_apply=lambda: seg.error is None and seg.replicas_started and not seg.finished)
        self.board = StatusBoard(
            self.state, self.ledger, cfg, rt, seg, self.trainer, self.replicas, self.relays, self.grants,
            history_length=lambda: workflow.info().get_current_history_length(),
            has_search_attributes=lambda: workflow.info().typed_search_attributes.get(search.PHASE) is not None,
            search_patched=lambda: workflow.patched("search-attributes"), upsert=workflow.upsert_search_attributes)

    # -- the run, as a table of contents -----------------------------------------------------

    @workflow.run
    async def run(self, inp: Any) -> RunStatus:
        if self.seg.error is not None or self._cfg is None:
            raise ApplicationError(self.seg.error or "invalid input", type="InvalidConfig", non_retryable=True)
        if self.state.pool and workflow.patched("slot-pool"):
            self.rt.spawn(self.grants.tell())  # the pool hears the ask while the trainer starts
        self.relays.start()
        await self.relays.wait_for_relays()
        if not self.state.trainer_ready:
            await self.trainer.init()
        # eval rounds (only a run with eval due asks for the patch, so a history without it replays unchanged)
        self.evaluation.on = self.evaluation.wanted() and workflow.patched("eval-rounds")
        self.evaluation.start_records()  # closed rounds a hand-over left unrecorded
        self.replicas.start_all()
        self.seg.replicas_started = True
        self.grants.apply()  # a pooled run: the replicas its grant allows
        if workflow.patched("watchdog"):
            self.board.watchdog_task = self.rt.spawn(self.board.watchdog())
        self.board.upsert_search_attributes()
        self.trainer.ahead = workflow.patched("train-ahead")
        self.trainer.deep = self.trainer.ahead and workflow.patched("train-ahead-2")
        while self.state.step < self._cfg.run.steps and not self.state.stopping:
            if self.seg.should_continue_as_new(self.state, self._cfg, workflow.info(), self._senders()):
                await self._continue_as_new()
            if not await self._wait_for_batch():
                break
            if self.relays.republish_wanted:
                await self.trainer.republish()
            if self.trainer.ahead:
                self.trainer.advance()
            elif self.trainer.has_batch():
                await self.trainer.step()
        if self.evaluation.on and not self.state.stopping:
            await self.trainer.settle()
            await self.evaluation.finish()  # the last eval rounds (bounded); leases no training prompt meanwhile
        return await self._finish()

    async def _wait_for_batch(self) -> bool:
        """Wait until the trainer has a full batch of complete groups, or the history segment is full (a
        paused or starved run still continues as new); False when the run is stopping."""
        assert self._cfg is not None
        cfg, t0, idle = self._cfg, workflow.time(), not self.trainer.flights
        await workflow.wait_condition(lambda: self.state.stopping or self.trainer.has_batch()
                                      or self.seg.full(cfg, workflow.info(), self._senders())
                                      or self.replicas.failed() is not None or self.relays.republish_wanted
                                      or bool(self.state.leaving and self.replicas.left())
                                      or self.trainer.returned())
        if idle:
            self.state.trainer_wait_s += workflow.time() - t0
        if self.state.leaving:
            self.replicas.retire_left()
        self.replicas.fail_if_one_failed()
        return not self.state.stopping

    # -- relays (workflows/relay_chain.py) and the trainer (workflows/trainer.py) ------------

    @workflow.update(name=contract.RELAY_LEAVING)
    def relay_leaving(self, info: RelayInfo) -> bool:
        """A relay on notice (laminar/notice.py) leaves the chain at once instead of by heartbeat timeout; the
        trainer's next push goes to the chain without it. No republish: the relay keeps serving until what it was
        sent has been forwarded, so the chain that remains holds every version it did (a killed relay's leaving
        does ask for one: it may have died mid-broadcast). False: that incarnation had left already. Its run_relay
        activity then returns; the watcher waits for the relay's worker to come back."""
        self.seg.updates += 1
        return self.relays.leaving(info)

    @workflow.signal(name=contract.RELAY_JOINED)
    def relay_joined(self, info: RelayInfo) -> None:
        self.relays.joined_signal(info)

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

    def _committed(self) -> None:
        """A trainer activity's steps committed: note the history's size, and plan a repack."""
        self._note_history()
        self._maybe_repack(after_step=True)

    def _maybe_repack(self, after_step: bool = False) -> None:
        """Dynamic repack (laminar mode): plan every rollout.repack_every_s of the engine's time and right after
        each trainer step; the orders reach the replicas in their next answers (workflows/migrations.py)."""
        assert self._cfg is not None and self._policy is not None
        if not self._policy.repacks or self.seg.handover or self.state.stopping:
            return
        r = self._cfg.rollout
        every_s = r.repack_every_s / time_scale(self._cfg)
        now = workflow.time()
        if not after_step and now - self.state.last_plan_at < every_s:
            return
        if not workflow.patched("repack"):
            return
        self.migrations.plan(c_max=r.repack_c_max, at=now, batch_limit=decode_batch_limit(self._cfg))

    def _start_replica(self, replica_id: str):
        """A replica's activity in this segment: on the shared rollout queue, or, for one parked at the last
        continue-as-new, on the queue of the process that holds it (patch `handover-route`; workflows/commands.py
        `run_kept_replica` falls back to the shared queue when that process is gone)."""
        assert self._cfg is not None
        cfg, run_id, segment = self._cfg, self.state.run_id, self.state.continued_as_new
        queue = self.state.kept_on.pop(replica_id, "")
        if queue and workflow.patched("handover-route"):
            return self.rt.spawn(commands.run_kept_replica(
                run_id, cfg, replica_id, segment, queue,
                not_found=lambda r: self.ledger.note_event("replica_not_adopted", r, workflow.time())))
        return commands.start_replica(run_id, cfg, replica_id, segment)

    # -- rollout replicas: claims and reports (the ledger leases; workflows/replica_set.py runs them) ---

    @workflow.update(name=contract.CLAIM_PROMPTS)
    def claim_prompts(self, inp: ClaimPromptsInput) -> ClaimPromptsResult:
        self.seg.updates += 1
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
            resume_ok = self.ledger.first_claim(replica_id, inp.resuming)
            if inp.attempt > 1:
                self.ledger.rejoin(replica_id, workflow.time())
        if inp.handoff is not None:
            self.migrations.hand_off(replica_id, inp.handoff, workflow.time())
        if inp.taken:
            self.migrations.take(replica_id, inp.taken, workflow.time())
        stop, handover, leave = self.state.stopping, self.seg.handover, self.replicas.leaving(replica_id)
        leases = replayed = self.ledger.replay_claim(replica_id, inp.request_id)
        if leases is None:
            if inp.departure is not None:  # it leaves: its groups go to a replica of their version, or back
                self.migrations.depart(replica_id, inp.departure, list(self.state.leaving), workflow.time())
            leases = []
            if not (stop or handover or leave or inp.departure or self.state.paused or not self.state.trainer_ready
                    or self.evaluation.ending):
                room = self._cfg.rollout.max_ready_groups - len(self.state.ready)
                fresh = fresh_lease_room(self._policy, self.state.prompt_cursor, self.state.policy_version,
                                         self.state.groups_generated + self.state.groups_failed)
                leases = self.ledger.lease(replica_id, max(0, min(inp.max_groups, room)), fresh, claimer=inp.report,
                                           at=workflow.time())
            self.ledger.remember_claim(replica_id, inp.request_id, leases)
        leasing = replayed is None and not (stop or handover or leave or inp.departure or not self.state.trainer_ready)
        eval_leases = self.evaluation.on_claim(inp, leasing)
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
            eval_leases=eval_leases,
            keep=handover and self.seg.keep,
            **self._hints(replica_id),
        )

    def _hints(self, replica_id: str) -> dict[str, Any]:
        """What every answer to a replica carries besides its own result: its repack part and whether the
        trainer is starved."""
        return {"migrate": self.migrations.order_for(replica_id), "incoming": self.migrations.incoming_for(replica_id),
                "hold_version": self.migrations.hold_for(replica_id), "trainer_starved": self.trainer.starved()}

    @claim_prompts.validator
    def _validate_claim(self, inp: ClaimPromptsInput) -> None:
        _check_claim(inp)
        if self.seg.error is not None:
            raise ValueError(f"run failed validation: {self.seg.error}")

    @workflow.update(name=contract.ADD_EXPERIENCE)
    def add_experience(self, inp: AddExperienceInput) -> AddExperienceResult:
        """A report: its complete groups become ready, its failed ones are closed; a claim it carries is answered
        after them, as a claim_prompts update that follows it would be (no patch: the handler issues no command,
        and a recorded history's reports carry no claim)."""
        self.seg.updates += 1
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
            handover=self.seg.handover, leave=self.replicas.leaving(inp.report.replica_id),
            failed=failed, claim=claim, keep=self.seg.handover and self.seg.keep, **self._hints(inp.report.replica_id),
        )

    @add_experience.validator
    def _validate_add(self, inp: AddExperienceInput) -> None:
        if inp.claim is not None:
            _check_claim(inp.claim)
            if self.seg.error is not None:
                raise ValueError(f"run failed validation: {self.seg.error}")
        if inp.failed and not inp.segment.key and not inp.segment.group_ids:
            return  # only failed groups to report
        if not inp.segment.key or not inp.segment.group_ids:
            raise ValueError("add_experience: segment must have a key and at least one group id")

    # -- operator controls and what the run shows (workflows/status.py) ----------------------

    @workflow.update(name=contract.PAUSE)
    def pause(self) -> str:
        self.seg.updates += 1
        self.state.paused = True
        self.board.upsert_search_attributes()
        return self.board.phase()

    @workflow.update(name=contract.RESUME)
    def resume(self) -> str:
        self.seg.updates += 1
        self.state.paused = False
        self.board.upsert_search_attributes()
        return self.board.phase()

    @workflow.update(name=contract.STOP)
    def stop(self) -> str:
        self.seg.updates += 1
        self.state.stopping = True
        self.board.upsert_search_attributes()
        return self.board.phase()

    @workflow.update(name=contract.SCALE)
    def scale(self, inp: ScaleInput) -> ScaleResult:
        """`laminar scale`: start replicas on free slots, or ask the chosen ones to leave (workflows/scale.py); a
        pooled run changes its ask instead (workflows/grants.py); relays join or leave the chain."""
        self.seg.updates += 1
        if not workflow.patched("scale"):
            raise ApplicationError("this run's workers predate `laminar scale`", type="ScaleUnsupported")
        relays_started, relays_removed = ([], []) if inp.relays is None else self.relays.scale(
            inp.relays, start_watchers=self.seg.may_start(self.state))
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
        if self.seg.error is not None:
            raise ValueError(f"run failed validation: {self.seg.error}")
        if inp.replicas is None and inp.relays is None:
            raise ValueError("scale: give replicas, relays or both")
        if inp.replicas is not None:
            check_target(inp.replicas)
        if inp.relays is not None:
            plan_relays(self.relays.ids(), inp.relays)  # raises on a target out of range
        check_update_senders(inp.replicas if inp.replicas is not None else len(self.replicas.ids()),
                             inp.relays if inp.relays is not None else len(self.relays.ids()), scale=True)
        if self.state.stopping or self.seg.finished:
            raise ValueError(f"scale: run {self.state.run_id} is {self.board.phase()}; a stopping run is not scaled")

    @workflow.signal(name=contract.REPLICA_GRANT)
    def replica_grant(self, grant: ReplicaGrant) -> None:
        """A slot pool's grant (workflows/grants.py): a pooled run runs min(ask, grant) replicas."""
        self.grants.granted(grant)

    @workflow.query(name=contract.STATUS)
    def status(self) -> RunStatus:
        return self.evaluation.annotate(self.board.status())

    # -- continue-as-new and finish ----------------------------------------------------------

    async def _continue_as_new(self) -> None:
        """Hand over to a new history segment. Not a barrier: replicas return at their next contact, and the trainer
        keeps stepping on ready groups while they do. With run.handover_keep they keep their groups in flight in
        memory and re-attach to the next segment (services/rollout/attach.py: its first claim resumes every lease they
        hold, carried here in the state); without, they write them to the partial pool. The chain and every lease,
        ready group and counter carry over in the state. (No patch for `keep`: it is a field of the answers to
        updates, not a command, so every recorded history replays unchanged.)"""
        assert self._cfg is not None
        # kept replicas (patch handover-keep): the trainer's activities in flight return first, the replicas claiming
        # and reporting meanwhile; told only then, they park for a moment (their next contact), not for a step, and
        # no trainer step starts while they do
        keep = self._cfg.run.handover_keep and workflow.patched("handover-keep")
        if keep:
            await self._trainer_returns()
        self.seg.handover = True
        self.seg.keep = self._cfg.run.handover_keep
        deadline = workflow.time() + timeouts.DRAIN.total_seconds()
        while not self.replicas.returned() and not self.state.stopping:
            try:
                await workflow.wait_condition(lambda: self.replicas.returned() or self.state.stopping
                                              or (self._can_step() and not keep) or self.trainer.returned(),
                                              timeout=max(0.0, deadline - workflow.time()))
            except TimeoutError:
                workflow.logger.warning("replicas_drain_timed_out")
                break
            if keep:
                self.trainer.commit_returned()
            elif self.trainer.ahead:
                self.trainer.advance()
            elif self._can_step():
                await self.trainer.step()
        await self.trainer.settle()
        await self.evaluation.settle()  # records in flight land before the hand-over (else the next segment redoes them)
        await self._drain()
        if self.state.leaving:
            self.replicas.retire_left()  # every replica has returned (or was cancelled): removed ones leave now
        # where each parked replica is: the next segment starts its activity there (patch handover-route)
        self.state.kept_on = self.replicas.kept_on() if keep else {}
        self._note_history()
        self.state.continued_as_new += 1
        self.state.handover_last_step_at = self.state.last_step_at
        # the leases as compact columns (workflows/carry.py); a history recorded before it replays with the old format
        state = encode_state(self.state) if workflow.patched("compact-state") else self.state
        workflow.continue_as_new(contract.TrainingRunInput(config=self._cfg.to_json(), state=state),
                                 task_timeout=contract.WORKFLOW_TASK)

    def _senders(self) -> int:
        """Who sends this run updates: its replicas and relays (timeouts.updates_budget)."""
        return len(self.replicas.ids()) + len(self.relays.ids())

    async def _trainer_returns(self) -> None:
        """Before telling kept replicas of a hand-over: commit the trainer activities in flight as they return (they
        end with this segment), scheduling none; the replicas work on. Ends early at the segment's update cap: the
        lower of HANDOVER_UPDATES_CAP and the run's budget (patch handover-cap: a run with more than 25 replicas and
        relays could pass the server's limit after the fixed cap and wedge)."""
        cap = timeouts.HANDOVER_UPDATES_CAP
        if workflow.patched("handover-cap"):
            cap = min(cap, timeouts.updates_budget(self._senders()))
        while self.trainer.flights and not self.state.stopping and self.seg.updates < cap:
            await workflow.wait_condition(lambda: self.trainer.returned() or self.state.stopping
                                          or self.seg.updates >= cap)
            self.trainer.commit_returned()

    def _can_step(self) -> bool:
        """A batch is there and the run still has steps to take (a finished run must not wait on it)."""
        assert self._cfg is not None
        return self.trainer.has_batch() and self.state.step < self._cfg.run.steps

    async def _drain(self) -> None:
        """Let replicas write their in-flight groups to the partial pool and return, then stop relays."""
        try:
            await workflow.wait_condition(self.replicas.returned, timeout=timeouts.DRAIN)
        except TimeoutError:
            workflow.logger.warning("replicas_drain_timed_out")
        self.seg.closing = True
        watchdog_task = [self.board.watchdog_task] if self.board.watchdog_task is not None else []
        for task in list(self.replicas.tasks.values()) + list(self.relays.tasks.values()) + watchdog_task:
            if not task.done():
                task.cancel()
        await workflow.wait_condition(lambda: all(t.done() for t in self.relays.tasks.values()))
        await workflow.wait_condition(workflow.all_handlers_finished)

    async def _finish(self) -> RunStatus:
        self.state.stopping = True
        await self.trainer.settle()
        await self.evaluation.settle()  # records in flight (a stopped run's closed rounds)
        await self._drain()
        if self.state.pool and workflow.patched("slot-pool"):
            await self.grants.leave()
        self._note_history()
        self.seg.finished = True
        self.board.upsert_search_attributes()
        return self.evaluation.annotate(self.ledger.status(
            phase="finished",
            total_steps=self._cfg.run.steps if self._cfg else 0,
            history_events=workflow.info().get_current_history_length(),
        ))

    def _note_history(self) -> None:
        n = workflow.info().get_current_history_length()
        self.state.history_events_max = max(self.state.history_events_max, n)


def _check_claim(inp: ClaimPromptsInput) -> None:
    if inp.max_groups < 0:
        raise ValueError(f"claim_prompts: max_groups={inp.max_groups} must be >= 0")
