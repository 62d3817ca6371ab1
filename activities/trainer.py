"""Trainer activities: thin adapters over services.trainer.TrainerService (one per trainer process).

Both run as sync activities on the trainer's own queue with one slot, so the policy and optimizer stay
in this process's memory between steps.
"""

from __future__ import annotations

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.heartbeat import background_heartbeat
from laminar.errors import InconsistentStateError
from laminar.messages import TrainerInitInput, TrainerInitResult, TrainStepInput, TrainStepResult
from services.trainer import TrainerService


class TrainerActivities:
    def __init__(self, service: TrainerService) -> None:
        self.service = service

    @activity.defn(name="init_trainer")
    def init_trainer(self, inp: TrainerInitInput) -> TrainerInitResult:
        with background_heartbeat():
            return self.service.init(inp)

    @activity.defn(name="train_step")
    def train_step(self, inp: TrainStepInput) -> TrainStepResult:
        with background_heartbeat() as progress:
            try:
                return self.service.train_step(inp, heartbeat=progress.tick)
            except InconsistentStateError as e:  # permanent: fail the step instead of retrying forever
                raise ApplicationError(str(e), type="InconsistentState", non_retryable=True) from e
