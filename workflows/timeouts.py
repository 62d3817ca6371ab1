"""Every timeout, backoff and retry policy the workflows give Temporal, named for what it bounds.

Heartbeat timeouts of replicas, relays and the trainer are run config (`*.heartbeat_timeout_s`); these are
the fixed bounds around them. None of them is part of a workflow's command sequence (a change replays), but
each is behaviour a running workflow has: change one deliberately. The run's workflow task timeout, which a
client gives at start too, is part of the contract (laminar/contract.py: WORKFLOW_TASK, REPAIR_SWEEP_S).
"""

from datetime import timedelta

from temporalio.common import RetryPolicy

from laminar.config import SERVER_MAX_TOTAL_UPDATES, UPDATES_RESERVE

# -- TrainingRunWorkflow -------------------------------------------------------------------------

# run_rollout_replica and run_relay live as long as their history segment; their heartbeat timeout is the
# failure detector, so start-to-close only has to outlast any segment (continue-as-new ends them first).
SEGMENT_ACTIVITY = timedelta(days=30)
# One init_trainer or train_step(s) attempt. A dead or stuck trainer shows first as a missed heartbeat (a step
# stops beating after 600 s without progress); this bounds init_trainer, which beats until the model is
# loaded or built, with room for a large checkpoint on a slow store.
TRAINER_ATTEMPT = timedelta(minutes=30)
# init_trainer, train_step(s) and run_rollout_replica retry without limit: a retry on another (or the
# restarted) worker is how a dead process is replaced. 1 s first, at most 10 s apart: a restarted worker is
# back in work within seconds.
RETRY_UNTIL_REPLACED = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))
# run_relay is never retried by the server: the workflow's watcher must first take the dead relay out of the
# chain, then starts a new attempt itself.
RELAY_ONE_ATTEMPT = RetryPolicy(maximum_attempts=1)
# After a relay attempt ends the watcher waits 1 s, or 2, 4, 8 ... s while attempts keep ending within
# RELAY_FAILING_FAST_S of their start, at most RELAY_BACKOFF_MAX_S: a relay that cannot start costs a few
# history events a minute, never a spin.
RELAY_FAILING_FAST_S = 30
RELAY_BACKOFF_MAX_S = 30
# A new run waits this long for every relay before publishing version 0 with those that joined (a relay
# process starts in about 1 s; the rest rejoin as they come).
RELAY_JOIN = timedelta(seconds=120)
# A continued segment keeps its inherited relays; one that does not re-join within this many relay heartbeat
# timeouts is gone and leaves the chain.
RELAY_REJOIN_HEARTBEATS = 2
# Continue-as-new and finish wait this long for replicas to write their in-flight groups to the partial pool
# and return (they do at their next claim or report).
DRAIN = timedelta(seconds=120)
# A continue-as-new with kept replicas (run.handover_keep) first lets the trainer's activities in flight return while
# the replicas go on claiming and reporting; past this many updates in the segment it tells them anyway (the server
# refuses more than history.maxTotalUpdates = 2,000 per run: a refused update is sent again, to the next segment),
# or earlier for a run with many replicas (updates_budget).
HANDOVER_UPDATES_CAP = 1900


def updates_budget(senders: int) -> int:
    """The most updates a segment may have handled when it tells its `senders` of updates (rollout replicas and
    relays) to hand over, so that the run never reaches the server's limit: past it, each sender may have one update
    accepted in the workflow task that crossed it (a replica has one contact in flight at a time) and one more that
    the hand-over answers, besides the reserve. Negative when `senders` is more than one run can carry
    (laminar/config.py check_update_senders refuses such a config or scale)."""
    return SERVER_MAX_TOTAL_UPDATES - 2 * senders - UPDATES_RESERVE


# A replica parked at a continue-as-new is started in the next segment on its process's own queue; a process that
# does not take it within this long is taken for gone (the server does not retry a schedule-to-start timeout) and the
# replica starts afresh on the shared queue. A live worker polls its queue at once (adoptions take 0.1-0.2 s): this is
# the margin for a loaded machine. The replica's groups wait that long when its process died, and so does every
# retry of an adopted replica (a retry goes back to the same queue): with 30 s a rollout worker killed after the
# run's first continue-as-new was detected 33.9 s after the kill, against its 3 s heartbeat timeout.
KEPT_START = timedelta(seconds=10)
# That fresh start's pool fence is its attempt plus this (services/rollout/pool.py): above any attempt of the
# routed activity, whose late writes (a stopped process that comes back) can then not replace the fresh start's.
KEPT_FALLBACK_ATTEMPTS = 1000
# republish is best effort and stop and continue-as-new wait for it: 60 s per attempt, 3 attempts 1 s apart,
# and 120 s in all even while no trainer polls its queue (the trainer is restarting).
REPUBLISH_ATTEMPT = timedelta(seconds=60)
REPUBLISH_IN_ALL = timedelta(seconds=120)
REPUBLISH_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3)
# record_eval (a closed eval round's record, one store write on the control worker): 60 s per attempt, 5 attempts
# from 1 s apart; after that the round stays unrecorded (logged) and its figures stay in the status.
RECORD_EVAL_ATTEMPT = timedelta(seconds=60)
RECORD_EVAL_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=5)
# A replica's "no relay holds a version of this run" within this long of a publish may predate the publish
# (replicas waiting for weights poll every 0.5 s and claim every 1 s): acted on only after it.
VERSION_MISSING_GRACE_S = 5.0

# -- RecoveryDrillWorkflow -----------------------------------------------------------------------

# The drill runner's activities beat every second or more often (activities/drill.py); 10 s without one means
# the `laminar drill` process is gone.
DRILL_RUNNER_HEARTBEAT = timedelta(seconds=10)
# observe_recovery stops at the drill's own timeout_s; this is the margin to read the last step times and
# write the report.
OBSERVE_REPORT_MARGIN_S = 60
# interrupt_store keeps the S3 server down for outage_s; this is the margin to stop and restart it.
STORE_RESTART_MARGIN_S = 120
# inject_fault must be picked up by the target process (it polls its own fault queue) and answered within
# this, or the drill fails instead of waiting on a process that is already gone.
FAULT_DELIVERY = timedelta(seconds=60)
# A fault is injected at most once: a retried kill would hit the process that replaced the killed one.
DRILL_ONE_ATTEMPT = RetryPolicy(maximum_attempts=1)
POOL_RETRY_S = 10.0  # a run whose slot pool did not take its ask asks again after this long
