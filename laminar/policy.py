"""Scheduling policies: what differs between `run.mode = laminar` and the baselines it is measured against.

Pure and clock-free (no Temporal, no time): the workflow (leasing, when the trainer steps) and the rollout
replica (when it may start a group, when it loads a version, whether it interrupts) ask these functions,
and a simulator can ask them too. Everything else (leases, exactly-once accounting, relays, drills) is the
same code in every mode.

Batches. Prompts are leased in order; prompt p belongs to batch b = p // B (B = trainer.groups_per_step).
The modes differ in four decisions:

| mode | may lease batch b when | a group of batch b starts on version | new version in flight | trainer trains |
| --- | --- | --- | --- | --- |
| laminar | back-pressure only (max_ready_groups) | any (a replica drains, then loads the newest) | finish first | the oldest B ready groups |
| sync | batch b-1 complete and trained (version b) | b (staleness 0) | finish first | batch b, once complete |
| one_step | batch b-1 complete, version b-1 exists | >= b-1 (staleness <= 1) | finish first | batch b, once complete |
| stream | as one_step | >= b-1 (staleness <= 1) | finish first | batch b, each minibatch as soon as complete |
| partial_rollout | b <= version + max_staleness | any | interrupt, load, continue (re-prefill) | the oldest B ready groups |

Stream: a trainer step is one minibatch (B / trainer.minibatches groups of batch b, taken as soon as that
many are complete), and the policy version advances once per batch, every `steps_per_version` steps: the
trainer publishes version b+1 after the last minibatch of batch b. In every other mode a step is a batch and
a version.

"Finish first": a replica admits nothing new once a newer version is at its relay, lets its in-flight
trajectories finish on the version they started with, then loads it (one version per trajectory). With the
barrier of sync/one_step/stream every replica is idle at a batch boundary, so the weight update is the
global sync point the baselines pay for (the modelled engine charges a global broadcast there).

Invariants (tests/test_policy.py): staleness of a consumed group is 0 in sync and <= 1 in one_step/stream
(version at start >= b - lag, trained at step b); generation never runs more than `lookahead` batches ahead
of the trainer; in partial_rollout a group is never leased more than max_staleness versions ahead.

Dynamic repack (workflows/repack.py, workflows/migrations.py) runs in laminar mode only: it shortens the
"finish first" drain by moving a ramp-down replica's trajectories to another replica of the same version.
The barrier modes idle every replica at a batch boundary anyway, and partial rollout interrupts instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # laminar/config.py validates through lookahead_of below: a type-only import, no cycle
    from laminar.config import RunConfig

PARTIAL_ROLLOUT_STALENESS = 4  # AReaL's recommended staleness bound, used when trainer.max_staleness is -1


@dataclass(frozen=True)
class Policy:
    mode: str
    groups_per_step: int  # B: groups in one global batch (one trainer step; stream: steps_per_version steps)
    lookahead: int | None  # batches generation may lease ahead of the trainer's version (None: no bound)
    barrier: bool  # batch b is leased only once batch b-1 is completely generated
    version_lag: int | None  # a group of batch b starts only on a version >= b - version_lag (None: any)
    interrupts: bool  # a newer version interrupts in-flight trajectories (they continue under it)
    global_sync: bool  # a weight update is a global broadcast during which every replica stops
    whole_batches: bool  # the trainer trains exactly batch b (not the oldest ready groups)
    steps_per_version: int  # trainer steps per policy version: trainer.minibatches in stream, else 1
    repacks: bool = False  # dynamic repack (workflows/repack.py): laminar with rollout.repack


# Batches generation may lease ahead of the trainer's version, per barrier mode (policy_for below; None: no bound
# from the mode). Config validation asks lookahead_of for the groups a mode keeps in flight.
_BARRIER_LOOKAHEAD = {"sync": 0, "one_step": 1, "stream": 1}


def lookahead_of(mode: str) -> int | None:
    """Batches a barrier mode leases ahead of the trainer's version; None for the modes without a barrier (their
    bound, if any, is the staleness bound: partial_rollout; laminar has back-pressure only)."""
    return _BARRIER_LOOKAHEAD.get(mode)


def policy_for(cfg: RunConfig) -> Policy:
    mode, b = cfg.run.mode, cfg.trainer.groups_per_step
    if mode == "laminar":
        return Policy(mode, b, None, False, None, False, False, False, 1, repacks=cfg.rollout.repack)
    if mode == "sync":
        return Policy(mode, b, lookahead_of(mode), True, 0, False, True, True, 1)
    if mode == "one_step":
        return Policy(mode, b, lookahead_of(mode), True, 1, False, True, True, 1)
    if mode == "stream":
        return Policy(mode, b, lookahead_of(mode), True, 1, False, True, True, cfg.trainer.minibatches)
    if mode == "partial_rollout":
        return Policy(mode, b, staleness_bound(cfg), False, None, True, True, False, 1)
    raise ValueError(f"run.mode={mode!r} has no policy; one of laminar, sync, one_step, stream, partial_rollout")


def staleness_bound(cfg: RunConfig) -> int:
    """Samples staler than this many versions are dropped by the trainer; -1: no bound."""
    if cfg.run.mode == "partial_rollout" and cfg.trainer.max_staleness < 0:
        return PARTIAL_ROLLOUT_STALENESS
    return cfg.trainer.max_staleness


def version_of(policy: Policy, step: int) -> int:
    """The policy version after `step` trainer steps (stream: a version per batch of minibatch steps)."""
    return step // policy.steps_per_version


def publishes(policy: Policy, step: int) -> bool:
    """The trainer publishes a new version after reaching `step` (stream: only at the end of a batch)."""
    return step % policy.steps_per_version == 0


def steps_to_publish(policy: Policy, step: int) -> int:
    """Trainer steps from `step` up to and including the next publish. They may run back to back in one trainer
    activity once their batches are complete (stream's minibatches of one batch): no version becomes visible in
    between, so nothing the workflow or a replica decides depends on their boundaries. 1 in every other mode."""
    return policy.steps_per_version - step % policy.steps_per_version


def batch_of(policy: Policy, prompt_id: int) -> int:
    return prompt_id // policy.groups_per_step


def min_version(policy: Policy, prompt_id: int) -> int:
    """The oldest policy version a replica may start this prompt's group on."""
    if policy.version_lag is None:
        return 0
    return max(0, batch_of(policy, prompt_id) - policy.version_lag)


def fresh_lease_room(policy: Policy, prompt_cursor: int, version: int, groups_generated: int) -> int | None:
    """How many fresh prompts (from `prompt_cursor` on) may be leased now; None: no bound from the policy.

    `version` is the trainer's newest policy version (= steps done); `groups_generated` counts complete groups
    since the run began (prompts are leased in order, so it reaches b * B once batches 0..b-1 are complete)."""
    if policy.lookahead is None:
        return None
    b = policy.groups_per_step
    limit = (version + policy.lookahead + 1) * b  # prompts of batches <= version + lookahead
    if policy.barrier:
        limit = min(limit, (groups_generated // b + 1) * b)  # ... and of the batch after the last complete one
    return max(0, limit - prompt_cursor)


def trainer_batch(policy: Policy, ready: list[tuple[str, int]], step: int, settled: bool = False
                  ) -> list[str] | None:
    """Group ids the trainer's next step consumes from `ready` ((group id, prompt id), arrival order), or None
    when it must wait. Barrier modes train exactly batch `step` once all its groups are complete; stream trains
    batch version_of(step) one minibatch at a time, each as soon as that many of its groups are complete.
    settled: no more group of that batch can arrive (the rest failed: workflows/ledger.py fail_groups), so the
    step takes the ones there are, none if all failed (an empty step: no update, the version still advances,
    so the barrier moves on)."""
    b = policy.groups_per_step
    if not policy.whole_batches:
        return [g for g, _ in ready[:b]] if len(ready) >= b else None
    size = b // policy.steps_per_version
    mine = [g for g, p in ready if batch_of(policy, p) == version_of(policy, step)][:size]
    return mine if len(mine) >= size or settled else None


def may_start(policy: Policy, lease_min_version: int, engine_version: int | None, newer_waiting: bool) -> bool:
    """A replica may start a leased group now: it holds a version the group may start on, and (unless the
    mode interrupts) no newer version waits for the in-flight trajectories to drain."""
    if engine_version is None or engine_version < lease_min_version:
        return False
    return policy.interrupts or not newer_waiting


def load_action(policy: Policy, engine_version: int | None, newest: int | None, in_flight: int) -> str:
    """What a replica does about the newest version at its relay: "" nothing, "load" (nothing in flight),
    "interrupt" (partial rollout: stop in-flight trajectories, load, continue them under the new version)."""
    if newest is None or (engine_version is not None and newest <= engine_version):
        return ""
    if in_flight == 0:
        return "load"
    return "interrupt" if policy.interrupts else ""
