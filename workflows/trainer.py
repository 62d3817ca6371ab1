"""The trainer's side of a training run: when the trainer has a batch, which trainer activities are in flight, and
how their results commit.

Deterministic like workflows/ledger.py: the batches and inputs come from the `Ledger` (under the run mode's
`Policy`), the chain from the `RelayChain`, and Temporal is reached only through what it is given: a `Runtime` and
the command functions of workflows/commands.py (`init_trainer`, `republish`, `start_train`), which a test replaces
(tests/test_trainer_steps.py).

- One step at a time (a history from before patch `train-ahead`): `step` runs one trainer activity (one step, or,
  in stream mode, every minibatch step up to the batch's publish whose groups are complete) and commits it.
- Train-ahead (patch `train-ahead`): `advance` commits the oldest trainer activity if it returned and schedules
  the next ones whose batches are complete, up to TRAIN_AHEAD behind the running one. The trainer's worker takes
  them while the running one computes (three slots; services/trainer.py runs them one at a time, in step order), so
  the next starts as the running one ends: no step waits for a workflow task or for the task queue. A step
  scheduled ahead counts against rollout.max_ready_groups (its groups stay ready until it commits), and its input
  is whole on its own (Ledger.train_inputs_after), so a trainer that restarts, or runs them out of order after a
  crash, rewinds as for any step.
- Republish: a chain change (`RelayChain.republish_wanted`) or a replica that finds no version on any relay has the
  trainer push its current version again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import ModuleType
from typing import Any

from temporalio.exceptions import ActivityError

from laminar.config import RunConfig
from laminar.contract import ReplicaReport, TrainStepInput, TrainStepResult
from laminar.policy import Policy, steps_to_publish
from laminar.workflows import commands as temporal_commands
from laminar.workflows import timeouts
from laminar.workflows.commands import Runtime, fail_run_if_permanent
from laminar.workflows.ledger import Ledger
from laminar.workflows.relay_chain import RelayChain
from laminar.workflows.state import RunState

HANDOVER_STALLS_KEPT = 64  # hand-over stalls kept for the summary's p50 (max and count cover the whole run)
TRAIN_AHEAD = 2  # trainer activities scheduled behind the running one at most (patch train-ahead-2; the trainer's
# queue runs them one at a time, in step order, so the next starts as the running one returns, without waiting for a
# workflow task); 1 in a history from before that patch (patch train-ahead)


@dataclasses.dataclass
class TrainFlight:
    """One trainer activity in flight: its steps' inputs, its handle, and when it was scheduled."""

    inputs: list[TrainStepInput]
    handle: Any
    scheduled_at: float


class Trainer:
    def __init__(self, state: RunState, ledger: Ledger, cfg: RunConfig | None, policy: Policy | None, rt: Runtime,
                 relays: RelayChain, *, train_steps_patched: Callable[[], bool], committed: Callable[[], None],
                 stepped: Callable[[], None], commands: ModuleType | Any = temporal_commands) -> None:
        self.state, self.ledger, self.cfg, self.policy, self.rt, self.relays = state, ledger, cfg, policy, rt, relays
        self.commands = commands  # init_trainer, republish, start_train (workflows/commands.py)
        self.train_steps_patched = train_steps_patched  # workflow.patched("train-steps"), asked only for 2+ steps
        self.committed = committed  # after each trainer activity's steps commit (history size, repack)
        self.stepped = stepped  # after each trainer activity, once its times are noted (search attributes)
        self.training = False  # a trainer activity is in flight
        self.ahead = False  # patch train-ahead: trainer activities are scheduled ahead (advance)
        self.deep = False  # patch train-ahead-2: up to TRAIN_AHEAD of them behind the running one (else one)
        self.free_at = 0.0  # (train-ahead) when the last trainer activity returned
        self.flights: list[TrainFlight] = []  # (train-ahead) the trainer activities in flight, in step order
        self.version_pushed_at = rt.now()  # the last publish or republish (see note_version_missing)

    # -- start, republish ---------------------------------------------------------------------

    async def init(self) -> None:
        """Load (or build) the model at the committed checkpoint and publish its version to the chain."""
        assert self.cfg is not None
        res = await self.commands.init_trainer(self.state.run_id, self.cfg, self.state.checkpoint, self.state.step,
                                               self.relays.chain())
        self.state.step, self.state.policy_version, self.state.trainer_ready = res.step, res.policy_version, True
        self.version_pushed_at = self.rt.now()
        self.state.trainer_ready_at = self.rt.now()

    async def republish(self) -> None:
        """A relay joined the chain or left it: have the trainer push its current version again. In a barrier
        mode (sync, one_step, stream) the replicas wait for that version, and a master relay that died before
        forwarding it (or a relay that came back empty) would otherwise wedge the run: no step comes to publish
        a newer one. Best effort: a failure is logged, never fatal (a later chain change asks again)."""
        self.relays.republish_wanted = False
        await self.commands.republish(self.state.run_id, self.state.step, self.relays.chain())
        self.version_pushed_at = self.rt.now()

    def note_version_missing(self, report: ReplicaReport) -> None:
        """A replica needs a version and no relay holds any of this run's (a relay dropped it, or every relay
        restarted while the trainer served another run): push it again, as for a chain change. Replicas poll
        every 0.5 s, so a report within VERSION_MISSING_GRACE_S of a push may predate it and is not acted on.
        No patch: only replicas of this code set version_missing, so no recorded history takes this branch."""
        if (not report.version_missing or not self.state.trainer_ready or self.relays.republish_wanted
                or self.rt.now() - self.version_pushed_at < timeouts.VERSION_MISSING_GRACE_S):
            return
        self.relays.republish_wanted = True
        self.ledger.note_event("version_missing", report.replica_id, self.rt.now())
        self.rt.logger.warning("version_missing", extra={"replica_id": report.replica_id,
                                                         "policy_version": self.state.policy_version})

    # -- is there work ------------------------------------------------------------------------

    def has_batch(self) -> bool:
        """The run mode's policy has a batch for the trainer (laminar/policy.py trainer_batch); with train-ahead,
        for the step after those in flight, while the run has that step to take and there is room to schedule it."""
        assert self.policy is not None and self.cfg is not None
        if self.state.paused:
            return False
        if not self.ahead:
            return self.ledger.trainable(self.policy) is not None
        in_flight = self._in_flight_batches()
        return (len(self.flights) <= self._train_ahead() and self.state.step + len(in_flight) < self.cfg.run.steps
                and self.ledger.trainable_after(self.policy, in_flight) is not None)

    def starved(self) -> bool:
        """The trainer is idle for want of complete groups (so a replica should not hold one back to batch
        its reports: that wait would be the trainer's)."""
        if self.ahead:  # starved once the steps in flight end: none is scheduled behind the running one, or there is
            # room for one more (train-ahead-2), and no batch is there for it
            return (self.state.trainer_ready and not self.state.paused
                    and len(self.flights) <= max(1, self._train_ahead()) and not self.has_batch())
        return self.state.trainer_ready and not self.training and not self.state.paused and not self.has_batch()

    def returned(self) -> bool:
        """(train-ahead) the oldest trainer activity in flight has returned: its steps are to commit."""
        return bool(self.flights) and self.flights[0].handle.done()

    def _train_ahead(self) -> int:
        """Trainer activities scheduled behind the running one: TRAIN_AHEAD (1 before patch train-ahead-2), and
        fewer than trainer.keep_last. n + 1 activities in flight name restore points at most n commits apart; a
        trainer that runs the last one first (after a crash) deletes checkpoints older than its input's oldest
        retained one, which holds the first input's restore point only when the run keeps n + 1 or more."""
        assert self.cfg is not None
        return max(0, min(TRAIN_AHEAD if self.deep else 1, self.cfg.trainer.keep_last - 1))

    def _in_flight_batches(self) -> list[list[str]]:
        """The group ids of every step in flight, in step order."""
        return [[g for part in inp.batch for g in part.group_ids] for f in self.flights for inp in f.inputs]

    # -- one step at a time -------------------------------------------------------------------

    async def step(self) -> None:
        """One trainer activity, awaited; the first step of a continued segment measures the hand-over stall."""
        self.note_handover_stall()
        self.training = True
        try:
            await self._train_one_step()
        finally:
            self.training = False
        self.state.last_step_at = self.version_pushed_at = self.rt.now()
        self.stepped()

    async def _train_one_step(self) -> None:
        """One trainer activity: one step, or (stream) every minibatch step up to the batch's publish whose groups
        are all complete, back to back: the trainer then waits for no workflow round trip between them."""
        assert self.cfg is not None and self.policy is not None
        limit = min(steps_to_publish(self.policy, self.state.step), self.cfg.run.steps - self.state.step)
        inputs = self._with_checks(self.ledger.next_train_inputs(self.cfg, self.relays.chain(), limit))
        t0 = self.rt.now()
        try:
            out = await self.commands.start_train(self.cfg, inputs)
        except ActivityError as e:
            fail_run_if_permanent(e, f"train_step {inputs[0].step}")
            raise
        self.state.trainer_busy_s += self.rt.now() - t0
        self._commit_steps(inputs, [out] if len(inputs) == 1 else out)

    def _with_checks(self, inputs: list[TrainStepInput]) -> list[TrainStepInput]:
        """The relays out of the chain go with each step (the trainer probes them); one step per activity in
        histories from before `train-steps`."""
        if relays_out := self.relays.relays_out():
            inputs = [dataclasses.replace(i, relays_out=relays_out) for i in inputs]
        if len(inputs) > 1 and not self.train_steps_patched():
            inputs = inputs[:1]
        return inputs

    def _commit_steps(self, inputs: list[TrainStepInput], results: list[TrainStepResult]) -> None:
        assert self.cfg is not None
        for inp, res in zip(inputs, results, strict=True):
            self.ledger.commit_step(inp, res, keep_last=self.cfg.trainer.keep_last, at=self.rt.now())
        self.relays.note_checks(results)
        self.committed()

    def note_handover_stall(self) -> None:
        """The first step of a continued segment measures the hand-over stall."""
        if self.state.handover_last_step_at is not None:
            stall = max(0.0, self.rt.now() - self.state.handover_last_step_at)
            self.state.handover_stalls = (self.state.handover_stalls + [round(stall, 3)])[-HANDOVER_STALLS_KEPT:]
            self.state.handover_stall_max = max(self.state.handover_stall_max, stall)
            self.state.handover_last_step_at = None

    # -- train-ahead: the next step is scheduled while one runs -------------------------------

    def advance(self) -> None:
        """Commit the oldest trainer activity if it returned, then schedule the next ones whose batches are complete,
        up to TRAIN_AHEAD behind the running one."""
        if self.returned():  # one a call: the run loop looks for a continue-as-new between steps
            self._commit_flight(self.flights.pop(0))
        while len(self.flights) <= self._train_ahead() and self.has_batch() and self._schedule_steps():
            pass
        self.training = bool(self.flights)

    def _schedule_steps(self) -> bool:
        """Schedule the next trainer activity (the steps after those in flight); False when there was none."""
        assert self.cfg is not None and self.policy is not None
        in_flight = self._in_flight_batches()
        step = self.state.step + len(in_flight)
        limit = min(steps_to_publish(self.policy, step), self.cfg.run.steps - step)
        inputs = self._with_checks(self.ledger.train_inputs_after(self.cfg, self.relays.chain(), in_flight, limit)
                                   if limit > 0 else [])
        if not inputs:
            return False
        if in_flight:
            inputs[0] = dataclasses.replace(inputs[0], ahead=True, behind=len(in_flight))
        self.note_handover_stall()
        handle = self.commands.start_train(self.cfg, inputs)
        self.flights.append(TrainFlight(inputs=inputs, handle=handle, scheduled_at=self.rt.now()))
        return True

    def _commit_flight(self, flight: TrainFlight) -> None:
        """A returned trainer activity: its steps commit (a permanent failure fails the run)."""
        try:
            out = flight.handle.result()
        except ActivityError as e:
            fail_run_if_permanent(e, f"train_step {flight.inputs[0].step}")
            raise
        results = [out] if len(flight.inputs) == 1 else out
        now = self.rt.now()
        # busy from when it could start: its scheduling, or the return of the activity ahead of it
        self.state.trainer_busy_s += now - max(flight.scheduled_at, self.free_at)
        self.free_at = now
        self._commit_steps(flight.inputs, results)
        self.state.last_step_at = self.version_pushed_at = now
        self.stepped()

    def commit_returned(self) -> None:
        """(train-ahead) Commit the oldest trainer activity if it returned, scheduling none (a hand-over waits)."""
        if self.returned():
            self._commit_flight(self.flights.pop(0))
        self.training = bool(self.flights)

    async def settle(self) -> None:
        """(train-ahead) Wait for every trainer activity in flight and commit them, scheduling none: before a
        continue-as-new or the end of the run."""
        while self.flights:
            await self.rt.wait(self.returned)
            self._commit_flight(self.flights.pop(0))
        self.training = False
