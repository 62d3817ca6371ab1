"""Trainer activities: thin adapters over services.trainer.TrainerService (one per trainer process).

All run as sync activities on the trainer's own queue, so the policy and optimizer stay in this process's
memory between steps. The worker runs the step in progress and those scheduled behind it (TRAINER_SLOTS); the
service lets one call at a time touch the policy. Errors a retry cannot fix (a bad model directory, no committed
checkpoint that verifies, an inconsistent replay) fail the activity for good (activities/errors.py).
"""

from __future__ import annotations

from temporalio import activity

from laminar import contract
from laminar.activities.errors import permanent_errors
from laminar.activities.heartbeat import background_heartbeat
from laminar.contract import (
    RepublishInput,
    TrainerInitInput,
    TrainerInitResult,
    TrainStepInput,
    TrainStepResult,
    TrainStepsInput,
)
from laminar.errors import CorruptDataError
from laminar.services.trainer import TrainerService


class TrainerActivities:
    def __init__(self, service: TrainerService) -> None:
        self.service = service

    @activity.defn(name=contract.INIT_TRAINER)
    def init_trainer(self, inp: TrainerInitInput) -> TrainerInitResult:
        # Loading (or first building) the model reports no progress: beat until it returns.
        with background_heartbeat(stall_s=None), permanent_errors(CorruptDataError):
            return self.service.init(inp)

    @activity.defn(name=contract.TRAIN_STEP)
    def train_step(self, inp: TrainStepInput) -> TrainStepResult:
        with background_heartbeat() as progress, permanent_errors(CorruptDataError):
            info = activity.info()
            queued_s = (info.started_time - info.current_attempt_scheduled_time).total_seconds()
            return self.service.train_step(inp, heartbeat=progress.tick, schedule_to_start_s=queued_s,
                                           scheduled_at=info.scheduled_time.timestamp(), attempt=info.attempt)

    @activity.defn(name=contract.TRAIN_STEPS)
    def train_steps(self, inp: TrainStepsInput) -> list[TrainStepResult]:
        """Several steps back to back: after the first, each starts where the last ended (no rewind, no wait for
        the workflow). A retry runs them all again from the first input, as train_step's retry does."""
        with background_heartbeat() as progress, permanent_errors(CorruptDataError):
            info = activity.info()
            queued_s = (info.started_time - info.current_attempt_scheduled_time).total_seconds()
            steps = inp.inputs()
            return [self.service.train_step(step, heartbeat=progress.tick, schedule_to_start_s=queued_s if i == 0 else None,
                                            scheduled_at=info.scheduled_time.timestamp(), last=i == len(steps) - 1,
                                            attempt=info.attempt)
                    for i, step in enumerate(steps)]

    @activity.defn(name=contract.REPUBLISH)
    def republish(self, inp: RepublishInput) -> int:
        return self.service.republish(inp)
