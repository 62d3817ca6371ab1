"""One rollout replica: the data-plane loop behind the `run_rollout_replica` activity.

Loop (trajectory-level asynchrony; docs/architecture/traces.md, 'Trace 1' and 'Trace 2'), one `RolloutReplica._turn`
at a time:
- weights (`weights.py`): admit leased prompt groups into the continuous batch while the replica's policy
  version is the newest its relay holds; once a newer version is there, admit nothing more, let in-flight
  trajectories finish on the version they started with, then pull and load the new version (only between
  batches; partial rollout interrupts instead); slots that free up during that drain are claimed already, and
  their leases wait to start on the new version;
- control calls (`control.py`): claims and reports run one at a time on the replica's control thread, so the
  engine keeps generating during a round trip; their answers are handled by the loop, in order. Complete
  groups are written to the trajectory store, then reported (`add_experience`, idempotent), as they complete;
  a report carries the claim that is due with it, and a claim that is due carries the groups complete by then,
  so one update does both (the workflow answers the claim after the report).
  Control traffic is bounded by work: a busy replica, or one still without weights, contacts the workflow at
  least every `contact_s` (that is how it learns of a hand-over while it has no room to claim, and of relays
  that joined after it started, e.g. after a Temporal outage); an idle replica backs off to
  `idle_claim_max_s` and a paused one to `paused_claim_max_s`, but a claim that came back empty at version v
  is sent again as soon as a version newer than v reaches the replica's relay (what frees prompts, the
  trainer's next step, comes with one; `Contacts.woken`), and while idle and waiting for it the replica polls
  its relay every `version_wait_poll_s`;
- generation (`batch.py`): one engine step per turn; each finished sample becomes a trajectory in
  `Batch.record`, and a group with all its samples is complete;
- partial pool (`pool.py`): every flush interval, all in-flight groups are written to the partial-response
  pool, so a killed replica's retry resumes them under the policy version they started on (or restarts them
  fresh, counted); each incarnation (history segment, attempt) writes its own fenced pool;
- migration (`migration.py`): the dynamic-repack hand-off, as source or destination; and leases that come with
  a departed replica's prefixes (`Lease.resume`), continued under their version or regenerated (counted);
- on hand-over (continue-as-new) or stop, flush the pool and return at once (the next incarnation resumes
  the in-flight groups), so a hand-over never waits for the long tail;
- on a notice (laminar/notice.py: SIGTERM, `laminar drain`) or when `laminar scale` removes it (`leave`), depart
  (`RolloutReplica._depart`): report what is complete, stop every unfinished group and send them as one segment
  with a `Departure`, for the workflow to move to a replica of their version or return with their prefixes.

Every interval is a field of `ReplicaTiming` (`timing.py`). The engine comes from `rl.factory.build_engine`
and is used only through `rl.engine_api.Engine`. The replica talks to the workflow only through
`ControlPort`, so the loop is testable without Temporal.

Environment loop (multi-turn tool calls, envs/tools/): in `batch.py`, between the engine and `Batch.record`
(`Batch.tool_turn`). A finished model turn that calls one of the task's tools goes to the environment instead
of into `group.done`; the tool's answer is appended (masked: `Trajectory.tool_mask`) and the sample re-enters
the engine with `engine.add(request_id, prompt_ids, prefix_ids=turns so far, prefix_logprobs=...)` (the resume
path `Batch.resume` already uses), so the pool, the hand-over and repack keep treating it as one in-flight
sample with a prefix. The pool is written right after a turn that ran a tool (`PartialPool.flush_if_due`).
"""

from laminar.services.rollout.control import ControlPort
from laminar.services.rollout.replica import RolloutReplica, tokens_lost_with
from laminar.services.rollout.timing import TIMING, ReplicaTiming

# the defaults under the names callers and tests import
CLAIM_POLL_S, CONTACT_S, HEARTBEAT_EVERY_S = TIMING.claim_poll_s, TIMING.contact_s, TIMING.heartbeat_every_s
IDLE_CLAIM_MAX_S, PAUSED_CLAIM_MAX_S = TIMING.idle_claim_max_s, TIMING.paused_claim_max_s
_next_claim_interval = TIMING.next_claim_interval

__all__ = ["CLAIM_POLL_S", "CONTACT_S", "HEARTBEAT_EVERY_S", "IDLE_CLAIM_MAX_S", "PAUSED_CLAIM_MAX_S", "TIMING",
           "ControlPort", "ReplicaTiming", "RolloutReplica", "tokens_lost_with"]
