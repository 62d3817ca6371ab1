"""The durable state of one training run: what TrainingRunWorkflow owns and carries across
continue-as-new. Small by construction: ids, refs and counters, never per-token or per-trajectory data,
and nothing that grows with the number of steps except bounded windows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from laminar.contract import (
    BatchPart,
    FailedGroup,
    Incoming,
    Lease,
    MigrationOrder,
    RelayInfo,
    ReplicaReport,
    RunEvent,
    WorkflowReset,
)
from laminar.refs import CheckpointRef, SegmentRef

RECENT_REWARDS = 20  # steps of reward kept for the live status
RECENT_STEPS = 100  # step completion times kept (drills measure trainer stall from them)
RECENT_EVENTS = 50
EVENTS_PER_KEY = 8  # times kept per (event kind, subject): faults of one subject are rare
RECENT_FAILURES = 20  # failed groups kept (with reason and prompt id) for the status


@dataclass
class OpenLease:
    group_id: str
    prompt_id: int
    replica_id: str
    resume: SegmentRef | None = None  # a departed replica's prefixes of this group (laminar.contract.Lease)
    resume_version: int = -1
    returned_at: float = 0.0  # workflow time it went back with prefixes (ledger.RESUME_PREFERENCE_S)


@dataclass
class ReadyGroup:
    group_id: str
    segment_key: str
    policy_version: int
    prompt_id: int = -1  # its batch is prompt_id // trainer.groups_per_step (laminar/policy.py)


@dataclass
class RunState:
    run_id: str
    step: int = 0
    policy_version: int = 0
    trainer_ready: bool = False
    checkpoint: CheckpointRef | None = None  # the newest committed checkpoint
    checkpoints: list[CheckpointRef] = field(default_factory=list)  # the last keep_last committed, newest last
    prompt_cursor: int = 0
    open_leases: dict[str, OpenLease] = field(default_factory=dict)  # group_id -> lease
    returned: list[OpenLease] = field(default_factory=list)  # leases to hand out again (lost replicas)
    segments: dict[str, SegmentRef] = field(default_factory=dict)  # key -> ref, while any group unconsumed
    ready: list[ReadyGroup] = field(default_factory=list)  # complete, not yet consumed, oldest first
    uncommitted: list[list[BatchPart]] = field(default_factory=list)  # batches since the checkpoint
    # batches of the steps from the oldest retained restore point (checkpoints[0], or step 0 until the first
    # checkpoint leaves the window) up to `checkpoint`: a corrupt checkpoint falls back to an older one
    # (at most keep_last * checkpoint_every batches with `uncommitted`)
    committed_batches: list[list[BatchPart]] = field(default_factory=list)
    relays: dict[str, RelayInfo] = field(default_factory=dict)
    replicas: dict[str, ReplicaReport] = field(default_factory=dict)
    paused: bool = False
    stopping: bool = False
    groups_generated: int = 0
    groups_consumed: int = 0
    groups_consumed_twice: int = 0
    dropped_stale: int = 0  # samples the trainer dropped as staler than the mode's bound
    duplicate_reports: int = 0
    tokens_consumed: int = 0
    reward_recent: list[float] = field(default_factory=list)
    staleness_histogram: dict[str, int] = field(default_factory=dict)
    max_versions_in_use: int = 0
    history_events_max: int = 0
    continued_as_new: int = 0
    trainer_wait_s: float = 0.0
    trainer_busy_s: float = 0.0
    started_at: float = 0.0
    steps_redone: int = 0
    tokens_regenerated: int = 0
    reprefill_tokens: int = 0
    step_times: list[float] = field(default_factory=list)
    events: list[RunEvent] = field(default_factory=list)
    event_times: dict[str, list[float]] = field(default_factory=dict)  # "<kind>/<subject>" -> recent times
    last_step_at: float | None = None  # workflow time the last step completed
    handover_last_step_at: float | None = None  # set by a continue-as-new; cleared by the next segment's step
    # replicas parked at the last continue-as-new (run.handover_keep), by id: the queue of the process that holds each
    # (RolloutReplicaResult.queue); the next segment starts them there (patch `handover-route`), then forgets it
    kept_on: dict[str, str] = field(default_factory=dict)
    handover_stalls: list[float] = field(default_factory=list)
    handover_stall_max: float = 0.0
    last_claims: dict[str, LastClaim] = field(default_factory=dict)  # replica_id -> its last claim
    rejoined: list[str] = field(default_factory=list)  # replicas retried and not yet recovered
    # dynamic repack (workflows/repack.py): orders not yet handed off (by source), hand-offs not yet
    # acknowledged (by destination), and what the carried-out ones moved and cost
    migrations: dict[str, MigrationOrder] = field(default_factory=dict)
    inbox: dict[str, list[Incoming]] = field(default_factory=dict)
    migration_seq: int = 0
    last_plan_at: float = 0.0
    repacks: int = 0
    repack_groups: int = 0
    repack_overhead_s: float = 0.0
    groups_failed: int = 0  # leases closed as failed (ledger.fail_groups): never ready, never trained
    failures: list[FailedGroup] = field(default_factory=list)  # the most recent RECENT_FAILURES
    # the watchdog's facts (laminar/watchdog.py), in workflow time
    trainer_ready_at: float | None = None
    replica_seen: dict[str, float] = field(default_factory=dict)  # replica -> its last report
    unversioned_since: dict[str, float] = field(default_factory=dict)  # replica -> first report at version -1
    workflow_resets: list[WorkflowReset] = field(default_factory=list)  # the most recent RECENT_FAILURES
    stall: str = ""  # what the run waited for when the workflow last looked ("" healthy)
    # `laminar scale` (workflows/scale.py): the replica ids that run (empty: rollout.replicas of them, as before
    # any scale), the removed ones not yet returned, and the groups removed replicas gave back to the pool
    replica_ids: list[str] = field(default_factory=list)
    leaving: list[str] = field(default_factory=list)
    scale_groups_returned: int = 0
    departed: list[str] = field(default_factory=list)  # replicas that handed their groups on, until their next first claim
    relay_ids: list[str] = field(default_factory=list)  # the relays (hosts) the run has; empty: relay.relays of them
    # a run on a shared worker set (`laminar start`): its slot pool's workflow id (workflows/pool.py; "" for a run
    # that owns its workers), its ask (0: rollout.replicas until a `laminar scale`), the pool's grant (-1: none
    # yet) with its reason, and why the pool did not take the run's ask ("" when it did)
    pool: str = ""
    replicas_asked: int = 0
    grant: int = -1
    grant_note: str = ""
    pool_error: str = ""
    # held-out evaluation during training (workflows/evaluation.py): the rounds (a closed one's results until its
    # record is stored) and the most recent closed rounds' figures. Typed Any: a continued segment receives them as
    # JSON, and `Evaluation` rebuilds them explicitly (eval_rounds.rounds_from_json); Temporal's converter did not
    # convert this nesting (dicts keyed by int of dataclasses) inside the workflow sandbox
    eval: Any = None  # EvalRounds | None
    eval_done: list[Any] = field(default_factory=list)  # EvalRoundStatus


@dataclass
class LastClaim:
    request_id: str
    leases: list[Lease]
