"""The one exception tree of the project. Each class says when it is raised."""

from __future__ import annotations


class LaminarError(Exception):
    """Base class of every error this project raises on purpose."""


class ConfigError(LaminarError):
    """A run config or deployment setting is invalid (names the field, the value and the fix)."""


class StoreError(LaminarError):
    """An object-store operation failed."""


class StoreUnavailableError(StoreError):
    """The object store could not be reached (wrong endpoint, server down) after bounded retries."""


class BucketNotFoundError(StoreError):
    """The configured S3 bucket does not exist at the configured endpoint."""


class ObjectNotFoundError(StoreError):
    """A key that was expected in the store is absent."""


class CorruptDataError(StoreError):
    """Stored bytes fail verification: checksum mismatch, truncated part or schema mismatch."""


class UntrainableRowError(CorruptDataError):
    """A row of a training batch can never be trained (its token, log-prob and mask lengths disagree): retrying the
    step would refuse it again, so the step fails for good, naming the group, the sample and the reason."""


class InconsistentStateError(LaminarError):
    """The control plane's record and the trainer's state cannot be reconciled; a retry cannot help."""


class StepOutOfTurnError(LaminarError):
    """A trainer step scheduled ahead reached a trainer not at the step before it, on its first attempt (retried)."""


class TrainerLeavingError(LaminarError):
    """A trainer step that waited behind the running one found the trainer leaving on notice (retried elsewhere)."""


class RunLostError(LaminarError):
    """Temporal no longer has a run's workflow that was going, or that the store holds records of: the server's
    state of the run was lost (a reset or replaced database)."""


class RunIdTakenError(LaminarError):
    """A new run was asked for under an id whose store prefix already holds records; laminar never writes over them."""


class RelayError(LaminarError):
    """A weight relay could not be reached or answered with an error."""


class DevStackError(LaminarError):
    """The embedded dev stack (Temporal dev server, S3 server) could not be started or stopped."""


class EngineError(LaminarError):
    """The rollout engine was given input it cannot serve (prompt too long, no weights loaded)."""


# The ApplicationError type a rollout process answers a kept replica's activity with when it no longer holds that
# replica (expired, or closed for a fresh engine): the workflow starts it afresh on the shared queue
# (workflows/commands.py `run_kept_replica`).
REPLICA_NOT_PARKED = "ReplicaNotParked"
