"""The Temporal contract: everything that crosses Temporal between callers and handlers, in one module. The
client, the activities, the services and the workflows all spell it from here (workflows call activities by name,
so that they never import torch); `client/` needs nothing from `workflows/` to start, signal or query a run.

- names: workflow types, activities, updates, signals and queries;
- task queues;
- the timeouts a client gives a workflow at start (the workflow-internal ones stay in workflows/timeouts.py);
- the inputs and results, with their direction: typed messages, small and JSON-able (ids, refs, counts).

Running workflows and recorded histories hold the names: a value never changes. A rename is a new name served
beside the old one (and a `workflow.patched()` branch in the caller). tests/test_names.py checks that every name
here has a handler and every handler's name is here. Payloads are JSON without type names (laminar's data
converter, client/converter.py): a message's fields are its contract, its class and module name are not; a field
is only ever added with a default.

Nothing here carries tokens, tensors, weights or trajectories (docs/architecture/invariants.md, 'Only small things cross
Temporal'). Deterministic and import-light: imported by workflow code through the sandbox pass-through.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from typing import Any

from laminar.evalstats import EvalSummary, PromptResult
from laminar.refs import CheckpointRef, SegmentRef

# -- names ------------------------------------------------------------------------------------

# workflow types (laminar-control)
TRAINING_RUN_WORKFLOW = "TrainingRunWorkflow"
RECOVERY_DRILL_WORKFLOW = "RecoveryDrillWorkflow"
SLOT_POOL_WORKFLOW = "SlotPoolWorkflow"  # one per rollout queue: shares its slots between runs (workflows/pool.py)

# activities: trainer (laminar-trainer), rollout (laminar-rollout), relay (laminar-relay-<host>)
INIT_TRAINER = "init_trainer"
TRAIN_STEP = "train_step"
TRAIN_STEPS = "train_steps"
REPUBLISH = "republish"
RUN_ROLLOUT_REPLICA = "run_rollout_replica"
RECORD_EVAL = "record_eval"  # control queue: store a closed eval round's record (activities/evaluation.py)
RUN_RELAY = "run_relay"
# activities: recovery drills (the `laminar drill` process, and each worker's own fault queue)
PLAN_DRILL = "plan_drill"
INTERRUPT_STORE = "interrupt_store"
OBSERVE_RECOVERY = "observe_recovery"
INJECT_FAULT = "inject_fault"

# TrainingRunWorkflow's updates (replicas; operators), signal (relays) and query (everyone)
CLAIM_PROMPTS = "claim_prompts"
ADD_EXPERIENCE = "add_experience"
PAUSE = "pause"
RESUME = "resume"
STOP = "stop"
SCALE = "scale"
RELAY_JOINED = "relay_joined"
TRAINER_CHECKPOINTED = "trainer_checkpointed"  # the trainer, leaving on notice between steps
RELAY_LEAVING = "relay_leaving"
WORKFLOW_RESET = "workflow_reset"  # the repairer (services/repair.py), to the run it reset
STATUS = "status"
# the slot pool: worker sets report slots, runs state their ask and leave (signals to the pool); the pool signals
# each run its grant; `laminar pool` queries it
REPLICA_GRANT = "replica_grant"
POOL_SLOTS = "pool_slots"
POOL_ASK = "pool_ask"
POOL_LEAVE = "pool_leave"
POOL_STATUS = "pool_status"

WORKFLOWS = (TRAINING_RUN_WORKFLOW, RECOVERY_DRILL_WORKFLOW, SLOT_POOL_WORKFLOW)
ACTIVITIES = (INIT_TRAINER, TRAIN_STEP, TRAIN_STEPS, REPUBLISH, RUN_ROLLOUT_REPLICA, RUN_RELAY,
              PLAN_DRILL, INTERRUPT_STORE, OBSERVE_RECOVERY, INJECT_FAULT, RECORD_EVAL)
UPDATES = (CLAIM_PROMPTS, ADD_EXPERIENCE, PAUSE, RESUME, STOP, SCALE, RELAY_LEAVING)
SIGNALS = (RELAY_JOINED, TRAINER_CHECKPOINTED, WORKFLOW_RESET, REPLICA_GRANT, POOL_SLOTS, POOL_ASK, POOL_LEAVE)
QUERIES = (STATUS, POOL_STATUS)

# -- task queues ------------------------------------------------------------------------------

CONTROL_QUEUE = "laminar-control"
# the slot pool and recovery drills: served with no workflow cache (every task replays its history), so a task that
# timed out can never run on an instance that applied it in memory (workers/processes.py, docs/decisions/wedged-runs.md)
CONTROL_UNCACHED_QUEUE = "laminar-control-uncached"
TRAINER_QUEUE = "laminar-trainer"
ROLLOUT_QUEUE = "laminar-rollout"
QUEUES = (CONTROL_QUEUE, CONTROL_UNCACHED_QUEUE, TRAINER_QUEUE, ROLLOUT_QUEUE)  # and relay_queue(host) per relay


def relay_queue(relay_id: str) -> str:
    """Each relay's activities run on its own host's queue."""
    return f"laminar-relay-{relay_id}"


def rollout_process_queue(process: str) -> str:
    """The queue only one rollout worker process polls (besides ROLLOUT_QUEUE): a replica it parked at a continue-as-new
    is started there in the next segment, so that it is adopted where it is (services/rollout/attach.py)."""
    return f"{ROLLOUT_QUEUE}@{process}"


def workflow_id_for(run_id: str) -> str:
    return f"run/{run_id}"


# -- the timeouts a client gives at start (the workflow-internal ones: workflows/timeouts.py) -----

# The run's workflow task timeout, set at start (client/run_control.py) and at every continue-as-new
# (workflows/training_run.py). Temporal's default is 10 s. A control worker that is alive but slow for longer (its
# process SIGSTOPped, starved of CPU, or cut off by a Temporal server restart while it completed a task) then races
# its own task's retry: the cached run has applied the timed-out task in memory, and the retry can run on that
# advanced instance, which leaves a history that does not replay (docs/upstream/wedged-run.md; services/repair.py
# repairs such a run). 30 s outlasts the chaos run's longest SIGSTOP (12 s) and a dev server restart. The cost: when
# the control worker really dies while it holds a task, that task moves to another worker after up to 30 s instead
# of 10 s (the sticky queue's schedule-to-start timeout still moves the tasks that follow at once): measured 9.0 s
# at 10 s, 29.0 s at 30 s (tests/test_wedge_window.py, a worker killed while it held a task).
WORKFLOW_TASK = timedelta(seconds=30)
# Every control worker's repairer (services/repair.py) looks for wedged runs this often (LAMINAR_REPAIR_SWEEP_S).
REPAIR_SWEEP_S = 10.0


# -- client -> TrainingRunWorkflow (the start input) ------------------------------------------------


@dataclass
class TrainingRunInput:
    """client -> TrainingRunWorkflow. `config` is the RunConfig as JSON (what `temporal workflow start
    --input '{"config": {...}}'` sends); `state` is set only by continue-as-new."""

    config: dict[str, Any]
    # the workflow's own durable state (workflows/state.py RunState), carried across continue-as-new; the
    # workflow reads its input as JSON and checks the state itself, so callers never need its type
    state: Any = None
    pool: str = ""  # a new run's slot pool (workflows/pool.py): `laminar start` sets it


# -- replicas <-> workflow (updates) ----------------------------------------------------------


@dataclass(frozen=True)
class ReplicaReport:
    """rollout replica -> workflow, piggy-backed on every update: what the replica holds now."""

    replica_id: str
    host_id: str
    policy_version: int  # -1: no weights loaded yet
    in_flight: int = 0
    kv_used: int = 0
    kv_capacity: int = 0
    kv_prev: int = 0  # kv_used at the previous report (repack's idleness test: falling below the peak)
    waiting: int = 0  # prompts leased to it and not started
    version_missing: bool = False  # it needs a version and its last poll found none of its run at any relay


@dataclass(frozen=True)
class MigrationOrder:
    """workflow -> source replica (dynamic repack, workflows/repack.py): hand every unfinished trajectory of
    `policy_version` to `destination`, then load the newest version."""

    migration_id: str
    destination: str
    policy_version: int


@dataclass(frozen=True)
class Handoff:
    """source replica -> workflow (on a claim): the groups it stopped, written as one segment (partial rows:
    prefixes and log-probs; finished samples as they are). No segment: it declined (its version changed or
    nothing was left in flight)."""

    migration_id: str
    segment: SegmentRef | None = None
    overhead_s: float = 0.0  # the source's stop + write time


@dataclass(frozen=True)
class Incoming:
    """workflow -> destination replica, on every answer until it acknowledges: groups to continue under
    `policy_version` from the segment (their leases are already the destination's)."""

    migration_id: str
    source: str
    segment: SegmentRef
    policy_version: int


@dataclass(frozen=True)
class Taken:
    """destination -> workflow (on a claim): it continued the groups of a migration (ok) or could not
    (its version changed or no room; their leases go back to the pool and are generated again)."""

    migration_id: str
    ok: bool
    overhead_s: float = 0.0  # the destination's read + re-prefill admission time


@dataclass(frozen=True)
class Lease:
    """workflow -> replica: one prompt group to generate. group_id is the idempotency key. With `resume`, the
    group was in flight on a replica that left (or a migration its destination declined): the segment holds its
    samples' prefixes, started under `resume_version`; a replica that holds that version continues them, any
    other generates the group again from its prompt, answering its recorded tool calls from the rows."""

    group_id: str
    prompt_id: int
    resume: SegmentRef | None = None
    resume_version: int = -1


@dataclass(frozen=True)
class Departure:
    """replica -> workflow (on its last claim): it leaves (a notice, or `laminar scale` removed it). Its unfinished
    groups were stopped and written as one segment (None: nothing was in flight); the workflow moves them to a
    replica of the same version (a migration) or returns them to the pool with the segment to resume from, and
    returns the leases it had not started. The replica then exits without waiting for any timeout."""

    reason: str  # "notice" (SIGTERM, `laminar drain`, a preemption) or "removed" (`laminar scale`)
    segment: SegmentRef | None = None
    policy_version: int = -1  # the version its groups started under
    tokens_regenerated: int = 0  # tokens of groups it could not hand over (another version): generated again


@dataclass(frozen=True)
class ClaimPromptsInput:
    """replica -> workflow (update `claim_prompts`)."""

    report: ReplicaReport
    max_groups: int
    resuming: list[str] = field(default_factory=list)  # group ids the replica resumes from its partial pool
    first_claim: bool = False  # set by a (re)started replica: its other open leases are returned to the pool
    attempt: int = 1  # the replica activity's attempt: > 1 means it was retried after a failure
    request_id: str = ""  # idempotency key: a retried claim with the same id gets the same leases back
    handoff: Handoff | None = None  # repack: a source hands its stopped groups over
    taken: list[Taken] = field(default_factory=list)  # repack: a destination acknowledges incoming groups
    departure: Departure | None = None  # the replica leaves: its groups go to others (no leases are given)
    # held-out evaluation during training (workflows/evaluation.py): the size of the eval set this replica renders
    # (0: it evaluates nothing), eval prompts it can take now, the eval leases it holds (any other leased to it goes
    # back to its round), results scored since its last claim, and versions it could not load (no relay held them)
    eval_set: int = 0
    eval_room: int = 0
    eval_holding: list[EvalLease] = field(default_factory=list)
    eval_results: list[EvalReport] = field(default_factory=list)
    eval_unloadable: list[int] = field(default_factory=list)


@dataclass(frozen=True, order=True)
class EvalLease:
    """workflow -> replica: score prompt `index` of the eval set with policy version `policy_version` (its
    eval.samples samples at eval.temperature). Never a training prompt: no group id, never in the ledger."""

    policy_version: int
    index: int


@dataclass(frozen=True)
class EvalReport:
    """replica -> workflow (in a claim): one eval lease's result, scored with the training reward."""

    policy_version: int
    index: int
    result: PromptResult


@dataclass(frozen=True)
class RelayInfo:
    relay_id: str
    host_id: str
    address: str


@dataclass(frozen=True)
class ClaimPromptsResult:
    """workflow -> replica."""

    leases: list[Lease]
    newest_policy_version: int
    relays: list[RelayInfo]
    stop: bool = False  # the run is over: finish and return
    handover: bool = False  # continue-as-new pending: write in-flight to the partial pool and return
    leave: bool = False  # `laminar scale` removed this replica: hand its groups to others (Departure) and return
    departed: bool = False  # (first claim) the previous incarnation departed: it handed everything on, lost nothing
    paused: bool = False
    resume_ok: list[str] = field(default_factory=list)  # of `resuming`: still leased to this replica
    migrate: MigrationOrder | None = None  # repack: this replica is a source
    incoming: list[Incoming] = field(default_factory=list)  # repack: this replica is a destination
    hold_version: int = -1  # repack: a migration to this replica is on its way: keep this version loaded
    trainer_starved: bool = False  # the trainer waits for groups: report each complete group at once
    eval_leases: list[EvalLease] = field(default_factory=list)  # held-out prompts to score (workflows/evaluation.py)
    # with handover: keep the groups in flight in memory, park and re-attach to the next segment (its first claim
    # resumes them all; services/rollout/attach.py) instead of writing them to the partial pool
    keep: bool = False


@dataclass(frozen=True)
class FailedGroup:
    """replica -> workflow (in `add_experience`): a group whose reward or generation failed on every try
    (task.max_group_retries + 1): its lease is closed as failed, counted, and the group never trained on.
    reason: raised | timeout | nan | wrong_type | sandbox | generation (envs/tasks/scoring.py)."""

    group_id: str
    prompt_id: int
    reason: str
    detail: str = ""  # what the last try's failure said, at most 200 characters (the status keeps 20 of these)
    attempts: int = 1  # tries made, the first included
    source_id: str = ""  # the prompt's id in its prompt file ("" for generated prompts)


@dataclass(frozen=True)
class AddExperienceInput:
    """replica -> workflow (update `add_experience`): a committed segment of complete groups, and the groups
    that failed (their segment may then be empty: key "" and no group ids); with `claim`, its next claim too."""

    report: ReplicaReport
    segment: SegmentRef
    tokens_regenerated: int = 0  # tokens thrown away since the last report (restarted partial groups)
    reprefill_tokens: int = 0  # since the last report: prefix tokens prefilled again (interrupts, repack)
    failed: list[FailedGroup] = field(default_factory=list)  # default: histories written before it decode
    # the replica's next claim, answered in the same update (one update instead of two; None: a report only)
    claim: ClaimPromptsInput | None = None


@dataclass(frozen=True)
class AddExperienceResult:
    accepted: list[str]
    duplicates: list[str]  # already reported (a retried report): ignored
    stop: bool = False
    handover: bool = False
    leave: bool = False
    migrate: MigrationOrder | None = None
    incoming: list[Incoming] = field(default_factory=list)
    hold_version: int = -1
    trainer_starved: bool = False
    failed: list[str] = field(default_factory=list)  # of inp.failed: leases closed as failed by this report
    claim: ClaimPromptsResult | None = None  # the answer to inp.claim (None when the report carried none)
    keep: bool = False  # with handover: park and re-attach (ClaimPromptsResult.keep)


# -- trainer activities -----------------------------------------------------------------------


@dataclass(frozen=True)
class BatchPart:
    """Which groups of one segment a step consumes."""

    segment: SegmentRef
    group_ids: list[str]


@dataclass(frozen=True)
class TrainerInitInput:
    """workflow -> trainer worker: load (or restore) the policy and publish it to the relay chain."""

    run_id: str
    config: dict[str, Any]
    checkpoint: CheckpointRef | None
    relay_chain: list[str]


@dataclass(frozen=True)
class TrainerInitResult:
    step: int
    policy_version: int
    published_bytes: int


@dataclass(frozen=True)
class RepublishInput:
    """workflow -> trainer worker: push the version of `step` again to `relay_chain` (a relay joined or was
    lost, and a version in flight may not have reached the chain). Only a trainer whose in-memory policy is at
    `step` does it; any other skips (a restarted trainer publishes with its next step)."""

    run_id: str
    step: int
    relay_chain: list[str]


@dataclass(frozen=True)
class TrainStepInput:
    """workflow -> trainer worker. `step` is the number of steps already applied to the policy the
    trainer must start from; a trainer whose in-memory state is elsewhere restores `checkpoint` and
    replays `replay` (the batches of steps checkpoint.step .. step-1) first, so a retry is idempotent.

    If `checkpoint` fails verification, the trainer falls back to the newest of `fallbacks` (older
    committed checkpoints the workflow still retains, oldest first) that verifies, replaying the batches
    from there: `fallback_replay` holds the batches of steps base .. checkpoint.step-1, where
    base = checkpoint.step - len(fallback_replay). base == 0 means the base model (step 0) is a fallback
    too. The trainer never deletes a checkpoint of a step >= base."""

    run_id: str
    config: dict[str, Any]
    step: int
    batch: list[BatchPart]
    checkpoint: CheckpointRef | None
    replay: list[list[BatchPart]]
    relay_chain: list[str]
    fallbacks: list[CheckpointRef] = field(default_factory=list)
    fallback_replay: list[list[BatchPart]] = field(default_factory=list)
    # relays the workflow took out of the chain for failing their data-plane checks (workflows/relay_health.py):
    # the trainer probes them in the background and reports those that pass (TrainStepResult.relays_passed)
    relays_out: list[str] = field(default_factory=list)
    # scheduled while the step before it was in flight (workflows/trainer.py, train-ahead): a trainer that is
    # not at that step defers it once (services/trainer.py), so the step before it, retried or finishing on a
    # trainer that leaves, runs first
    ahead: bool = False
    # with ahead: how many trainer steps were in flight before it when it was scheduled (train-ahead-2: 1 or 2; 0 in
    # inputs from before it, meaning 1). A retry that must rewind trains those first and keeps their results, so that
    # their own retries do not rewind again (services/trainer.py _steps_before)
    behind: int = 0


@dataclass(frozen=True)
class TrainStepsInput:
    """workflow -> trainer worker: consecutive steps whose batches are all complete, run back to back in one
    activity (stream's minibatches up to the batch's publish; laminar/policy.py steps_to_publish): `first`,
    then one step per batch of `then`. The result lists one TrainStepResult per step. Only the first input
    travels whole (its replay and fallbacks are most of its size); `inputs()` rebuilds the others."""

    first: TrainStepInput
    then: list[list[BatchPart]]

    def inputs(self) -> list[TrainStepInput]:
        out = [self.first]
        for batch in self.then:
            out.append(next_step_input(out[-1], batch))
        return out


# The server refuses a payload above 2 MB (its blob size limit) and warns above 256 KB (docs/architecture/temporal.md,
# "Payloads stay small").
PAYLOAD_REFUSED_BYTES = 2 * 1024 * 1024
PAYLOAD_WARNED_BYTES = 256 * 1024


def retained_batches_bytes(keep_last: int, checkpoint_every: int, groups_per_step: int,
                           groups_per_segment: int = 1) -> int:
    """The bytes of batch references one payload carries: a train step's input holds the batches from the oldest
    retained checkpoint to the step (`replay` + `fallback_replay`: that checkpoint is keep_last checkpoints back once
    the run retains keep_last, and the step up to checkpoint_every - 1 past the newest, so fewer than
    (keep_last + 1) * checkpoint_every batches) and the workflow carries as many through a continue-as-new
    (`committed_batches` + `uncommitted`, workflows/state.py).
    Each batch is groups_per_step groups in segments of groups_per_segment (1: the worst case, a replica that
    reports every group alone; groups_per_step: the best), with keys, checksums and ids as long as a real run's,
    encoded as the SDK encodes them (compact JSON)."""
    per_segment = max(1, min(groups_per_segment, groups_per_step))
    ids = [f"g{i:08d}" for i in range(per_segment)]
    part = BatchPart(
        segment=SegmentRef(key="runs/" + "r" * 24 + "/experience/rollout-host-00-000/00000000.parquet",
                           sha256="0" * 64, size=10**9, rows=10**6, group_ids=ids, policy_version=10**6,
                           tokens=10**9),
        group_ids=ids)
    one_part = len(json.dumps(asdict(part), separators=(",", ":"))) + 1  # and its comma
    parts = -(-groups_per_step // per_segment)
    return (keep_last + 1) * checkpoint_every * parts * one_part


def next_step_input(prev: TrainStepInput, batch: list[BatchPart]) -> TrainStepInput:
    """The input of the step after `prev`, had `prev` committed without a checkpoint: one step further, the
    same restore point, prev's batch appended to the replay. Whole on its own: a trainer that restarts before it
    rewinds exactly as for any step."""
    return replace(prev, step=prev.step + 1, batch=batch, replay=[*prev.replay, prev.batch])


@dataclass(frozen=True)
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
    # behaviour policy vs the trainer's at the start of the step (rl/grpo.py behaviour_drift); defaults let
    # histories written before these fields decode
    is_weight_mean: float = 0.0  # mean of pi_trainer / pi_behaviour over response tokens
    is_weight_max: float = 0.0
    is_capped_fraction: float = 0.0  # tokens whose weight exceeds trainer.tis_cap
    kl_behaviour: float = 0.0  # KL(behaviour || trainer) per token, k3 estimator


@dataclass(frozen=True)
class TrainStepResult:
    step: int  # steps applied after this one
    policy_version: int
    metrics: StepMetrics
    checkpoint: CheckpointRef | None  # set when this step committed a checkpoint
    steps_redone: int
    publish_stall_s: float
    restored: bool = False  # this trainer process restored the checkpoint before stepping (fresh or rewound)
    # steps of the committed checkpoints that failed verification when restoring, newest first; the trainer
    # restored from the newest retained restore point older than all of them
    corrupt_checkpoints: list[int] = field(default_factory=list)
    # data-plane checks (relay.breaker): relays of the chain or of relays_out the trainer could not reach (its
    # breaker is open), and relays of relays_out whose probe passed since; the workflow takes the first out of
    # the chain and the second back in (workflows/relay_health.py)
    relays_failed: list[str] = field(default_factory=list)
    relays_passed: list[str] = field(default_factory=list)


# -- rollout / relay activities ---------------------------------------------------------------


@dataclass(frozen=True)
class RolloutReplicaInput:
    """workflow -> rollout worker (long-running activity `run_rollout_replica`)."""

    run_id: str
    workflow_id: str
    replica_id: str
    config: dict[str, Any]
    generation: int = 0  # the run's history segment (continue-as-new count): fences the partial pool
    # added to the activity's attempt in the pool's fence: a start on the shared queue after a kept replica's own
    # process was not found (workflows/commands.py `run_kept_replica`) fences above any attempt of the one before it
    attempt_base: int = 0


@dataclass(frozen=True)
class RolloutReplicaResult:
    replica_id: str
    groups_completed: int
    tokens_generated: int
    handed_over: int  # in-flight groups written to the partial pool at hand-over
    departed: str = ""  # it left (Departure.reason): "notice" or "removed"; "" for a hand-over or stop
    kept: int = -1  # parked for the next segment with this many groups in flight, none written out (-1: not parked)
    queue: str = ""  # parked: the queue of the process that holds it (rollout_process_queue; "" from older workers)


@dataclass(frozen=True)
class RunRelayInput:
    """workflow -> relay worker (long-running activity `run_relay`)."""

    run_id: str
    workflow_id: str
    relay_id: str


# -- operator-facing ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RunEvent:
    """Something the control plane noticed, with the workflow time it noticed it (drills read these).

    kinds: replica_rejoined (a retried replica claimed again), replica_recovered (its first complete
    group after rejoining), relay_lost, relay_joined, trainer_restored (a step replayed from a checkpoint),
    checkpoint_fallback (subject: the corrupt checkpoint steps; count: the step restored from instead),
    repack_ordered / repack_moved / repack_declined (subject: "<source>-><destination>"; count: trajectories
    ordered / groups moved / groups sent back to the pool), stall (subject: what the run waits for, "weights",
    "groups", "replicas" or "trainer"; laminar/watchdog.py), relay_out / relay_back (subject: the relay's address,
    taken out of the chain for failing its data-plane checks, or back; workflows/relay_health.py), relay_leaving
    (a relay on notice left the chain by itself), workflow_reset (the run's workflow was wedged and reset by the
    repairer; subject: the error, count: steps redone), replica_not_adopted (a replica parked at the last
    continue-as-new was not found in its process, gone or no longer holding it: its activity started afresh on the
    shared queue, as after a crash).
    """

    kind: str
    subject: str
    at: float
    count: int = 0


@dataclass(frozen=True)
class WorkflowReset:
    """repairer -> TrainingRunWorkflow (signal `workflow_reset`), and a record under the run in the store: the
    run's workflow was wedged and was reset (services/repair.py). Event ids are of the reset run's history."""

    run_id: str  # the laminar run
    error: str  # the failing workflow task's error (first line)
    bad_event_id: int  # the first event that did not replay (or the failing task's scheduled event)
    reset_to: int  # the WorkflowTaskCompleted event the run was reset to
    old_run_id: str  # the wedged run (Temporal's run id)
    new_run_id: str
    step_before: int  # the run's step when it was found wedged (its last search attribute)
    step_after: int  # the step it went on from (steps_redone = step_before - step_after)
    at: float  # Unix seconds


@dataclass(frozen=True)
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
    prompts_issued: int = 0
    returned_leases: int = 0
    steps_redone: int = 0
    tokens_regenerated: int = 0
    duplicate_reports: int = 0  # group reports ignored because the group was already recorded (retries)
    step_times: list[float] = field(default_factory=list)  # workflow time each recent step completed
    events: list[RunEvent] = field(default_factory=list)  # most recent last, bounded
    # "<kind>/<subject>" -> workflow times of its last few events: a burst of routine events of other kinds or
    # subjects never pushes out the fault a drill waits for
    event_times: dict[str, list[float]] = field(default_factory=dict)
    handover_stalls: list[float] = field(default_factory=list)  # trainer idle across recent continue-as-new (s)
    handover_stall_max: float = 0.0  # the longest, over the whole run (s)
    # a train step is in flight; after `pause` the run is quiet (nothing commits) once this is False
    training: bool = False
    dropped_stale: int = 0  # samples dropped as staler than the run mode's bound (laminar/policy.py)
    reprefill_tokens: int = 0  # prompt + prefix tokens prefilled again: partial-rollout interrupts, repack takes
    repacks: int = 0  # migrations carried out (groups handed over and continued by the destination)
    repack_groups: int = 0  # groups moved by them
    repack_overhead_s: float = 0.0  # summed over them: source stop + write, destination read + admit
    # repack migrations ordered or handed over, not yet acknowledged, as "<source>-><destination>"
    migrating: list[str] = field(default_factory=list)
    # groups dropped after task.max_group_retries failed tries (never trained on); prompts_issued =
    # groups_generated + groups_failed + open_leases + returned_leases
    groups_failed: int = 0
    failures: list[FailedGroup] = field(default_factory=list)  # the most recent, last; bounded
    # resets of the run's workflow by the repairer (services/repair.py), the most recent last; bounded
    workflow_resets: list[WorkflowReset] = field(default_factory=list)
    # the watchdog's facts (laminar/watchdog.py: `laminar status` prints what a silent run waits for)
    stall_warn_s: float = 0.0  # run.stall_warn_s (0: a status from before the watchdog)
    last_step_at: float | None = None
    trainer_ready_at: float | None = None
    has_batch: bool = False
    replicas_wanted: int = 0
    replica_seen: dict[str, float] = field(default_factory=dict)  # replica -> workflow time of its last report
    unversioned_since: dict[str, float] = field(default_factory=dict)  # replica -> first report at version -1
    # `laminar scale`: the replica count asked for, the replica activities running (removed ones that have
    # not returned yet count until they do), and the unfinished groups removed replicas gave back to the pool
    replicas_target: int = 0
    replicas_running: int = 0
    scale_groups_returned: int = 0
    relays_target: int = 0  # the relay (host) count asked for; `relays` is the chain as it stands
    # a run on a shared worker set (workflows/pool.py): the slots the pool granted it (-1: not in a pool) and,
    # when that is less than it asks, the pool's reason
    replicas_granted: int = -1
    grant_note: str = ""
    # held-out evaluation during training (workflows/evaluation.py): open rounds (policy version -> prompts not
    # scored yet) and the most recent closed ones, last last
    eval_pending: dict[str, int] = field(default_factory=dict)
    eval_done: list[EvalRoundStatus] = field(default_factory=list)


@dataclass(frozen=True)
class EvalRoundStatus:
    """A closed eval round: its figures (laminar/evalstats.py), results reported twice and ignored, leases that went
    back to it, when it opened and closed (workflow time), and whether its record is in the store (runs/<id>/evals/step-<version>.json)."""

    policy_version: int
    summary: EvalSummary
    duplicates: int = 0
    opened_at: float = 0.0
    closed_at: float = 0.0
    recorded: bool = False
    releases: int = 0  # leases that went back to the round (a replica died, left, or lost its answer)


@dataclass(frozen=True)
class RecordEvalInput:
    """workflow -> control worker (activity `record_eval`): a closed eval round's results, stored as the record
    `laminar eval` writes (services/evaluate.py store_record); a retry writes the same record again."""

    run_id: str
    config: dict[str, Any]  # the RunConfig as JSON (the record's settings)
    policy_version: int
    results: list[PromptResult]
    wall_s: float  # from the round's opening to its last result (workflow time)
    duplicates: int = 0
    releases: int = 0  # leases that went back to the round (a replica died, left, or lost its answer)


@dataclass(frozen=True)
class ScaleInput:
    """operator -> workflow (`laminar scale`): the rollout replica count the run should have, and optionally its
    relay count (one per host, `host-<i>`; None: unchanged). replicas None: unchanged (relays only)."""

    replicas: int | None = None
    relays: int | None = None


@dataclass(frozen=True)
class ScaleResult:
    replicas_target: int
    started: list[str]  # replica ids started
    removed: list[str]  # replica ids asked to leave (they return at their next contact)
    relays_target: int = 0
    relays_started: list[str] = field(default_factory=list)  # relay (host) ids whose relay joins the chain
    relays_removed: list[str] = field(default_factory=list)  # relay ids taken out of the chain


# -- the slot pool (workflows/pool.py) -----------------------------------------------------------


def pool_workflow_id(queue: str = ROLLOUT_QUEUE) -> str:
    """The slot pool of one rollout task queue: every worker polling it shares its slots through this workflow."""
    return f"pool/{queue}"


@dataclass(frozen=True)
class SlotReport:
    """worker set -> pool: the rollout slots one worker set (`laminar workers`) gives the queue; 0 withdraws them."""

    reporter: str  # stable per worker set (host and home): a restarted set replaces its own report
    slots: int
    engines: list[str] = field(default_factory=list)  # the rollout engines every one of its workers serves


@dataclass(frozen=True)
class PoolAsk:
    """run -> pool: what the run asks (rollout.replicas, or its `laminar scale` target) and its quota."""

    run_id: str
    workflow_id: str  # where the pool signals the grant
    replicas: int
    quota: int = 0  # rollout.quota: a guaranteed minimum (workflows/fairshare.py)
    engine: str = ""


@dataclass(frozen=True)
class ReplicaGrant:
    """pool -> run: the slots it may use, and why that is less than it asks ("" when it is not)."""

    granted: int
    note: str = ""


@dataclass(frozen=True)
class PoolRun:
    run_id: str
    asked: int
    quota: int
    granted: int
    note: str = ""


@dataclass(frozen=True)
class PoolStatus:
    """The pool's `pool_status` query (`laminar pool`)."""

    slots: int
    reporters: dict[str, int]
    engines: list[str]
    runs: list[PoolRun]


@dataclass
class PoolState:
    """SlotPoolWorkflow's durable state, carried across its continue-as-new: one entry per run and worker set."""

    reports: dict[str, SlotReport] = field(default_factory=dict)  # reporter -> its last report (slots > 0)
    asks: dict[str, PoolAsk] = field(default_factory=dict)  # run id -> its last ask
    seq: dict[str, int] = field(default_factory=dict)  # run id -> registration order (ties go to the older)
    next_seq: int = 0
    sent: dict[str, ReplicaGrant] = field(default_factory=dict)  # run id -> the grant last signalled to it


@dataclass
class PoolInput:
    """client (`laminar workers`, `laminar start`: an empty one) or continue-as-new -> SlotPoolWorkflow."""

    state: PoolState | None = None


# -- recovery drills ----------------------------------------------------------------------------

FAULTS = ("rollout", "relay", "master-relay", "trainer", "control", "store", "preempt")
# `--fault preempt --target ROLE[:ID]`: the notice (SIGTERM, laminar/notice.py) instead of SIGKILL, to one of these
PREEMPT_ROLES = ("rollout", "relay", "trainer")


def fault_queue(process: str) -> str:
    """Each worker process polls its own fault queue, so a fault is delivered to the process that dies."""
    return f"laminar-fault-{process}"


@dataclass(frozen=True)
class DrillInput:
    """client -> RecoveryDrillWorkflow."""

    run_id: str
    drill_id: str
    fault: str  # one of FAULTS
    target: str = ""  # replica id (rollout) or relay id (relay); empty: pick one. preempt: ROLE[:ID], ROLE one of PREEMPT_ROLES
    at_step: int = 0  # inject once the run has completed this many steps
    runner_queue: str = ""  # queue of the `laminar drill` process that observes the run
    timeout_s: float = 300.0  # give up waiting for recovery after this long (s)
    outage_s: float = 3.0  # store fault: how long the S3 server stays down (s)
    during: str = ""  # "migration": inject while a repack migration is pending (rollout: into its source)


@dataclass(frozen=True)
class DrillPlan:
    """What the drill will do, resolved against the live run just before injecting."""

    fault: str
    target: str  # replica id, relay id, "trainer", "control" or "store"
    process: str  # the worker process that receives the fault (its fault queue)
    baseline: RunStatus


@dataclass(frozen=True)
class InjectFaultInput:
    drill_id: str
    fault: str
    target: str
    delay_s: float = 0.5  # the process dies this long after acknowledging, so the reply is delivered


@dataclass(frozen=True)
class InjectFaultResult:
    process: str
    pid: int
    injected_at: float  # Unix time the process died (or the store went down)


@dataclass(frozen=True)
class ObserveInput:
    drill: DrillInput
    plan: DrillPlan
    injected: InjectFaultResult


@dataclass(frozen=True)
class DrillReport:
    """A drill's outcome (also written to the store and printed). Times are Unix seconds."""

    drill_id: str
    run_id: str
    fault: str
    target: str
    injected_at: float
    detected_at: float | None
    recovered_at: float | None
    steps_during_outage: int
    trainer_stall_s: float
    groups_lost: int
    groups_consumed_twice: int
    tokens_regenerated: int
    steps_redone: int
    recovered: bool
    notes: str = ""
    # the first time the trainer's tokens/s over a sliding window was back to 90 % of its mean over the minute
    # before the fault (services/drill.py throughput_restored_at); None: not within the observation
    throughput_restored_at: float | None = None
    tokens_lost: int = 0  # generated tokens thrown away (not in a flush, or not resumable), from the run's counters
    # tool calls run a second time, not by a failure's retry (reporting/tool_calls.py), counted from the run's
    # local logs when the drill ends; None: not counted (no logs of the run on this machine, e.g. a Ray run)
    tool_calls_rerun: int | None = None
