"""Typed messages that cross Temporal, with their direction. Small and JSON-able: ids, refs, counts.

Nothing here carries tokens, tensors, weights or trajectories (DESIGN.md §2).
Deterministic and import-light: imported by workflow code through the sandbox pass-through.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from laminar.refs import CheckpointRef, SegmentRef

CONTROL_QUEUE = "laminar-control"
TRAINER_QUEUE = "laminar-trainer"
ROLLOUT_QUEUE = "laminar-rollout"


def relay_queue(relay_id: str) -> str:
    """Each relay's activities run on its own host's queue."""
    return f"laminar-relay-{relay_id}"


def workflow_id_for(run_id: str) -> str:
    return f"run/{run_id}"


# -- replicas <-> workflow (updates) ----------------------------------------------------------


@dataclass
class ReplicaReport:
    """rollout replica -> workflow, piggy-backed on every update: what the replica holds now."""

    replica_id: str
    host_id: str
    policy_version: int  # -1: no weights loaded yet
    in_flight: int = 0
    kv_used: int = 0
    kv_capacity: int = 0


@dataclass
class Lease:
    """workflow -> replica: one prompt group to generate. group_id is the idempotency key."""

    group_id: str
    prompt_id: int


@dataclass
class ClaimPromptsInput:
    """replica -> workflow (update `claim_prompts`)."""

    report: ReplicaReport
    max_groups: int
    resuming: list[str] = field(default_factory=list)  # group ids the replica resumes from its partial pool
    first_claim: bool = False  # set by a (re)started replica: its other open leases are returned to the pool


@dataclass
class RelayInfo:
    relay_id: str
    host_id: str
    address: str


@dataclass
class ClaimPromptsResult:
    """workflow -> replica."""

    leases: list[Lease]
    newest_policy_version: int
    relays: list[RelayInfo]
    stop: bool = False  # the run is over: finish and return
    handover: bool = False  # continue-as-new pending: write in-flight to the partial pool and return
    paused: bool = False
    resume_ok: list[str] = field(default_factory=list)  # of `resuming`: still leased to this replica


@dataclass
class AddExperienceInput:
    """replica -> workflow (update `add_experience`): a committed segment of complete groups."""

    report: ReplicaReport
    segment: SegmentRef


@dataclass
class AddExperienceResult:
    accepted: list[str]
    duplicates: list[str]  # already reported (a retried report): ignored
    stop: bool = False
    handover: bool = False


# -- trainer activities -----------------------------------------------------------------------


@dataclass
class BatchPart:
    """Which groups of one segment a step consumes."""

    segment: SegmentRef
    group_ids: list[str]


@dataclass
class TrainerInitInput:
    """workflow -> trainer worker: load (or restore) the policy and publish it to the relay chain."""

    run_id: str
    config: dict[str, Any]
    checkpoint: CheckpointRef | None
    relay_chain: list[str]


@dataclass
class TrainerInitResult:
    step: int
    policy_version: int
    published_bytes: int


@dataclass
class TrainStepInput:
    """workflow -> trainer worker. `step` is the number of steps already applied to the policy the
    trainer must start from; a trainer whose in-memory state is elsewhere restores `checkpoint` and
    replays `replay` (the batches of steps checkpoint.step .. step-1) first, so a retry is idempotent."""

    run_id: str
    config: dict[str, Any]
    step: int
    batch: list[BatchPart]
    checkpoint: CheckpointRef | None
    replay: list[list[BatchPart]]
    relay_chain: list[str]


@dataclass
class StepMetrics:
    reward_mean: float
    loss: float
    grad_norm: float
    samples: int
    tokens: int
    response_len_mean: float
    staleness: dict[str, int]  # version gap -> samples
    dropped_stale: int
    clip_fraction: float
    consumed_twice: int  # groups the trainer had already consumed (must stay 0)


@dataclass
class TrainStepResult:
    step: int  # steps applied after this one
    policy_version: int
    metrics: StepMetrics
    checkpoint: CheckpointRef | None  # set when this step committed a checkpoint
    steps_redone: int
    publish_stall_s: float


# -- rollout / relay activities ---------------------------------------------------------------


@dataclass
class RolloutReplicaInput:
    """workflow -> rollout worker (long-running activity `run_rollout_replica`)."""

    run_id: str
    workflow_id: str
    replica_id: str
    config: dict[str, Any]


@dataclass
class RolloutReplicaResult:
    replica_id: str
    groups_completed: int
    tokens_generated: int
    handed_over: int  # in-flight groups written to the partial pool at hand-over


@dataclass
class RunRelayInput:
    """workflow -> relay worker (long-running activity `run_relay`)."""

    run_id: str
    workflow_id: str
    relay_id: str


# -- operator-facing ---------------------------------------------------------------------------


@dataclass
class RunStatus:
    """The `status` query and the workflow result."""

    run_id: str
    phase: str  # starting | running | paused | stopping | finished
    step: int
    total_steps: int
    policy_version: int
    ready_groups: int
    open_leases: int
    groups_generated: int
    groups_consumed: int
    groups_consumed_twice: int
    tokens_consumed: int
    reward_recent: list[float]
    versions_in_use: list[int]
    max_versions_in_use: int
    staleness_histogram: dict[str, int]
    trainer_wait_fraction: float
    history_events: int
    history_events_max: int
    continued_as_new: int
    checkpoints: list[CheckpointRef]
    relays: list[RelayInfo]
    replicas: list[ReplicaReport]
    started_at: float
