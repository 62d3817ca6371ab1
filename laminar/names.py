"""The names that cross Temporal: workflow types, activities, updates, the signal and the query. Callers and
handlers both spell them from here (workflows call activities by name, so that they never import torch).

Running workflows and recorded histories hold these strings: a value never changes. A rename is a new name
served beside the old one (and a `workflow.patched()` branch in the caller). tests/test_names.py checks that
every name here has a handler and every handler's name is here.
"""

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
              PLAN_DRILL, INTERRUPT_STORE, OBSERVE_RECOVERY, INJECT_FAULT)
UPDATES = (CLAIM_PROMPTS, ADD_EXPERIENCE, PAUSE, RESUME, STOP, SCALE, RELAY_LEAVING)
SIGNALS = (RELAY_JOINED, TRAINER_CHECKPOINTED, WORKFLOW_RESET, REPLICA_GRANT, POOL_SLOTS, POOL_ASK, POOL_LEAVE)
QUERIES = (STATUS, POOL_STATUS)
