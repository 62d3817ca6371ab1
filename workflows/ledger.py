"""Exactly-once accounting over RunState (docs/architecture/invariants.md, 'Exactly-once accounting'): leases, the
experience index, consumed batches and counters. Pure and deterministic, so it is unit-tested without
Temporal.

Invariants:
- a group id is leased to at most one replica at a time, and enters `ready` at most once;
- a failed group (fail_groups) never enters `ready`: its lease is closed once, as failed, and counted; every
  prompt leased is generated (ready or consumed), failed, leased, or returned to be leased again:
  prompt_cursor == groups_generated + groups_failed + len(open_leases) + len(returned);
- a group leaves `ready` only when a train step that consumed it has returned;
- batches consumed since the last committed checkpoint are kept (`uncommitted`) so that a restarted
  trainer replays them instead of consuming new groups or skipping them; those since the oldest retained
  checkpoint are kept too (`committed_batches`), so a corrupt newest checkpoint falls back to an older one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from laminar.config import RunConfig
from laminar.contract import (
    BatchPart,
    FailedGroup,
    Lease,
    ReplicaReport,
    RunEvent,
    RunStatus,
    TrainStepInput,
    TrainStepResult,
    WorkflowReset,
    next_step_input,
)
from laminar.policy import Policy, policy_for, trainer_batch, version_of
from laminar.refs import CheckpointRef, SegmentRef
from laminar.workflows.state import (
    EVENTS_PER_KEY,
    RECENT_EVENTS,
    RECENT_FAILURES,
    RECENT_REWARDS,
    RECENT_STEPS,
    LastClaim,
    OpenLease,
    ReadyGroup,
    RunState,
)


class Ledger:
    def __init__(self, state: RunState) -> None:
        self.state = state

    # -- replicas ----------------------------------------------------------------------------

    def note_report(self, report: ReplicaReport, at: float | None = None) -> None:
        self.state.replicas[report.replica_id] = report
        if at is not None:  # the watchdog's facts: when it last reported, since when it has no weights
            self.state.replica_seen[report.replica_id] = at
            if report.policy_version >= 0:
                self.state.unversioned_since.pop(report.replica_id, None)
            else:
                self.state.unversioned_since.setdefault(report.replica_id, at)
        in_use = self.versions_in_use()
        self.state.max_versions_in_use = max(self.state.max_versions_in_use, len(in_use))

    def migrating(self) -> list[str]:
        """Repack migrations not yet acknowledged (workflows/migrations.py): ordered, then handed over."""
        s = self.state
        return ([f"{src}->{o.destination}" for src, o in sorted(s.migrations.items())]
                + [f"{i.source}->{dst}" for dst, q in sorted(s.inbox.items()) for i in q])

    def versions_in_use(self) -> list[int]:
        return sorted({r.policy_version for r in self.state.replicas.values() if r.policy_version >= 0})

    def note_event(self, kind: str, subject: str, at: float, count: int = 0) -> None:
        self.state.events = (self.state.events + [RunEvent(kind=kind, subject=subject, at=at, count=count)])[-RECENT_EVENTS:]
        key = f"{kind}/{subject}"
        self.state.event_times[key] = (self.state.event_times.get(key, []) + [at])[-EVENTS_PER_KEY:]

    def note_reset(self, reset: WorkflowReset, at: float) -> None:
        """The repairer reset this run's workflow (services/repair.py): kept for the status, and an event whose
        count is the steps redone. A reset is recorded once, by its new run id (a repeated signal is a no-op)."""
        if any(r.new_run_id == reset.new_run_id for r in self.state.workflow_resets):
            return
        self.state.workflow_resets = (self.state.workflow_resets + [reset])[-RECENT_FAILURES:]
        self.note_event("workflow_reset", reset.error[:200], at, max(0, reset.step_before - reset.step_after))

    def replay_claim(self, replica_id: str, request_id: str) -> list[Lease] | None:
        """The leases of a retried claim (same request id), still held by the replica; None if not a retry."""
        last = self.state.last_claims.get(replica_id)
        if not request_id or last is None or last.request_id != request_id:
            return None
        held = set(self.held_by(replica_id, [lease.group_id for lease in last.leases]))
        return [lease for lease in last.leases if lease.group_id in held]

    def remember_claim(self, replica_id: str, request_id: str, leases: list[Lease]) -> None:
        if request_id:
            self.state.last_claims[replica_id] = LastClaim(request_id=request_id, leases=list(leases))

    def rejoin(self, replica_id: str, at: float) -> None:
        """A retried replica activity claimed again: the failure was detected and recovery began."""
        if replica_id not in self.state.rejoined:
            self.state.rejoined.append(replica_id)
        self.note_event("replica_rejoined", replica_id, at)

    def lease(self, replica_id: str, n: int, fresh_room: int | None = None, claimer: ReplicaReport | None = None,
              at: float = 0.0) -> list[Lease]:
        """Hand out up to n groups: returned leases first (oldest first), then at most `fresh_room` fresh
        prompts (None: no bound; the run mode's bound, laminar/policy.py fresh_lease_room). A returned lease with
        prefixes to resume goes to a claimer that can continue them (`_can_resume`); the others pass it by."""
        out: list[Lease] = []
        loads = -1  # the one older version an idle claimer will load to continue groups (it holds one at a time)
        for old in list(self.state.returned):
            if len(out) >= n:
                break
            if claimer is not None and old.resume is not None and claimer.policy_version != old.resume_version:
                if not _can_resume(old, claimer, at) or (loads >= 0 and old.resume_version != loads):
                    continue
                if at - old.returned_at < RESUME_PREFERENCE_S:
                    loads = old.resume_version
            self.state.returned.remove(old)
            out.append(self._open(old.group_id, old.prompt_id, replica_id, old.resume, old.resume_version))
        stop_at = n if fresh_room is None else min(n, len(out) + fresh_room)
        while len(out) < stop_at:
            prompt_id = self.state.prompt_cursor
            self.state.prompt_cursor += 1
            out.append(self._open(f"g{prompt_id:08d}", prompt_id, replica_id))
        return out

    def _open(self, group_id: str, prompt_id: int, replica_id: str, resume: SegmentRef | None = None,
              resume_version: int = -1) -> Lease:
        self.state.open_leases[group_id] = OpenLease(group_id=group_id, prompt_id=prompt_id, replica_id=replica_id,
                                                     resume=resume, resume_version=resume_version)
        return Lease(group_id=group_id, prompt_id=prompt_id, resume=resume, resume_version=resume_version)

    def give_back(self, replica_id: str, group_ids: list[str], resume: SegmentRef | None,
                  resume_version: int = -1, at: float = 0.0) -> list[str]:
        """Return these leases of `replica_id` to the pool with the segment their prefixes are in (None: from
        their prompts); the next replica to lease one resumes it where it can (laminar.contract.Lease)."""
        back = self.held_by(replica_id, group_ids)
        for g in back:
            lease = self.state.open_leases.pop(g)
            if resume is not None:
                lease.resume, lease.resume_version, lease.returned_at = resume, resume_version, at
            self.state.returned.append(lease)
        return back

    def release_leases_of(self, replica_id: str, keep: set[str]) -> list[str]:
        """A (re)started replica holds only what it resumes: its other open leases go back to the pool."""
        released = [g for g, lease in self.state.open_leases.items() if lease.replica_id == replica_id and g not in keep]
        for g in released:
            self.state.returned.append(self.state.open_leases.pop(g))
        return released

    def first_claim(self, replica_id: str, resuming: list[str]) -> list[str]:
        """A replica's first claim in an incarnation: what it resumes (from its partial pool, or every group it held
        when it parked across a continue-as-new: services/rollout/attach.py) stays its own, its other open leases
        go back to the pool; returns the resumed groups it still holds (`resume_ok`)."""
        self.release_leases_of(replica_id, keep=set(resuming))
        return self.held_by(replica_id, resuming)

    def held_by(self, replica_id: str, group_ids: list[str]) -> list[str]:
        return [g for g in group_ids if g in self.state.open_leases and self.state.open_leases[g].replica_id == replica_id]

    def add_segment(self, seg: SegmentRef, replica_id: str = "", at: float = 0.0,
                    tokens_regenerated: int = 0, reprefill_tokens: int = 0) -> tuple[list[str], list[str]]:
        """Record complete groups; idempotent by group id (a retried report is a no-op, and its
        regenerated tokens are not counted again)."""
        accepted: list[str] = []
        duplicates: list[str] = []
        returned = {lease.group_id: lease.prompt_id for lease in self.state.returned}
        for g in seg.group_ids:
            if g in self.state.open_leases:
                prompt_id = self.state.open_leases.pop(g).prompt_id
            elif g in returned:  # a replica thought lost finished it after all
                prompt_id = returned.pop(g)
                self.state.returned = [lease for lease in self.state.returned if lease.group_id != g]
            else:
                duplicates.append(g)
                continue
            self.state.ready.append(ReadyGroup(group_id=g, segment_key=seg.key, policy_version=seg.policy_version,
                                               prompt_id=prompt_id))
            accepted.append(g)
        if accepted:
            self.state.tokens_regenerated += tokens_regenerated
            self.state.reprefill_tokens += reprefill_tokens
            self.state.segments[seg.key] = seg
            self.state.groups_generated += len(accepted)
            if replica_id in self.state.rejoined:
                self.state.rejoined.remove(replica_id)
                self.note_event("replica_recovered", replica_id, at, len(accepted))
        self.state.duplicate_reports += len(duplicates)
        return accepted, duplicates

    def fail_groups(self, failed: list[FailedGroup], replica_id: str, at: float = 0.0) -> list[str]:
        """Close the leases of groups that failed on every try: counted in groups_failed, never ready, never
        leased again. Only the replica holding the lease fails it: a group already recorded (complete, failed,
        a retried report), or leased elsewhere or back in the pool since (its reporter was thought lost), is
        ignored, and is generated or retried by its holder."""
        closed: list[str] = []
        for f in failed:
            g = f.group_id
            lease = self.state.open_leases.get(g)
            if lease is None or lease.replica_id != replica_id:
                continue
            del self.state.open_leases[g]
            closed.append(g)
            self.state.groups_failed += 1
            self.state.failures = (self.state.failures + [f])[-RECENT_FAILURES:]
            self.note_event("group_failed", f.reason, at, f.prompt_id)
        return closed

    # -- trainer -----------------------------------------------------------------------------

    def trainable(self, policy: Policy) -> list[str] | None:
        """The group ids the next step consumes under the run mode's policy, or None while it must wait."""
        return trainer_batch(policy, [(g.group_id, g.prompt_id) for g in self.state.ready], self.state.step,
                             self.settled(policy, self.state.step))

    def settled(self, policy: Policy, step: int) -> bool:
        """Whole-batch modes: every prompt of the batch `step` trains is leased and none is still leased or
        waiting to be leased again, so no more of its groups can arrive (those missing failed). Never true of a
        batch without a failed group, whose groups are then all ready or consumed."""
        if not policy.whole_batches or not self.state.groups_failed:
            return False
        b = policy.groups_per_step
        lo = version_of(policy, step) * b
        if self.state.prompt_cursor < lo + b:
            return False
        leased = [lease.prompt_id for lease in self.state.open_leases.values()] + [
            lease.prompt_id for lease in self.state.returned]
        return not any(lo <= p < lo + b for p in leased)

    def batch_parts(self, group_ids: list[str]) -> list[BatchPart]:
        """These ready groups, grouped by segment in arrival order."""
        wanted = set(group_ids)
        parts: list[BatchPart] = []
        for g in (g for g in self.state.ready if g.group_id in wanted):
            if parts and parts[-1].segment.key == g.segment_key:
                parts[-1].group_ids.append(g.group_id)
            else:
                parts.append(BatchPart(segment=self.state.segments[g.segment_key], group_ids=[g.group_id]))
        return parts

    def next_train_input(self, cfg: RunConfig, chain: list[str]) -> TrainStepInput:
        """The trainer's next step: the batch the mode's policy picks (the workflow asks only once there is one;
        otherwise the oldest ready groups, up to a batch)."""
        group_ids = self.trainable(policy_for(cfg))
        if group_ids is None:
            group_ids = [g.group_id for g in self.state.ready[:cfg.trainer.groups_per_step]]
        return TrainStepInput(
            run_id=self.state.run_id,
            config=cfg.to_json(),
            step=self.state.step,
            batch=self.batch_parts(group_ids),
            checkpoint=self.state.checkpoint,
            replay=list(self.state.uncommitted),
            relay_chain=chain,
            fallbacks=[c for c in self.state.checkpoints[:-1] if c.step >= self._replay_base()],
            fallback_replay=list(self.state.committed_batches),
        )

    def next_train_inputs(self, cfg: RunConfig, chain: list[str], limit: int) -> list[TrainStepInput]:
        """The trainer's next steps whose batches are complete now, in order: the first as next_train_input
        builds it, then up to `limit` in all, each as next_train_input would build it had the ones before it
        committed without a checkpoint (one step further, the batch the mode's policy picks from the groups
        left, the same restore point with the earlier batches appended to its replay). Each input is whole on its
        own, so a trainer that restarts inside a multi-step activity rewinds exactly as for a single step."""
        inputs = [self.next_train_input(cfg, chain)]
        policy = policy_for(cfg)
        taken = {g for part in inputs[0].batch for g in part.group_ids}
        while len(inputs) < limit:
            prev = inputs[-1]
            group_ids = trainer_batch(policy, [(g.group_id, g.prompt_id) for g in self.state.ready
                                               if g.group_id not in taken], prev.step + 1,
                                      self.settled(policy, prev.step + 1))
            if group_ids is None:
                break
            inputs.append(next_step_input(prev, self.batch_parts(group_ids)))
            taken.update(group_ids)
        return inputs

    def trainable_after(self, policy: Policy, in_flight: list[list[str]]) -> list[str] | None:
        """The group ids of the step after the steps in flight (their group ids, in step order; not committed yet,
        so their groups are still `ready`), picked by the mode's policy from the ready groups none of them holds;
        None while it must wait. With nothing in flight, trainable()."""
        if not in_flight:
            return self.trainable(policy)
        taken = {g for group_ids in in_flight for g in group_ids}
        step = self.state.step + len(in_flight)
        return trainer_batch(policy, [(g.group_id, g.prompt_id) for g in self.state.ready if g.group_id not in taken],
                             step, self.settled(policy, step))

    def train_inputs_after(self, cfg: RunConfig, chain: list[str], in_flight: list[list[str]],
                           limit: int) -> list[TrainStepInput]:
        """The trainer's next steps after the steps in flight: up to `limit` steps whose batches are complete now
        (trainable_after, step by step); [] while there is none. Built from the steps in flight as
        next_train_inputs builds its later steps (each had the ones before it committed without a checkpoint),
        so each is whole on its own, whatever the steps in flight return."""
        policy = policy_for(cfg)
        if self.trainable_after(policy, in_flight) is None:
            return []
        if not in_flight:
            return self.next_train_inputs(cfg, chain, limit)
        prev = dataclasses.replace(self.next_train_input(cfg, chain), batch=self.batch_parts(in_flight[0]))
        for group_ids in in_flight[1:]:
            prev = next_step_input(prev, self.batch_parts(group_ids))
        out: list[TrainStepInput] = []
        steps = list(in_flight)
        while len(out) < limit and (group_ids := self.trainable_after(policy, steps)) is not None:
            prev = next_step_input(prev, self.batch_parts(group_ids))
            out.append(prev)
            steps.append(group_ids)
        return out

    def _replay_base(self) -> int:
        """The step `committed_batches` start at: the oldest restore point the workflow retains."""
        return (self.state.checkpoint.step if self.state.checkpoint else 0) - len(self.state.committed_batches)

    def commit_step(self, inp: TrainStepInput, res: TrainStepResult, keep_last: int, at: float = 0.0) -> None:
        consumed = {g for part in inp.batch for g in part.group_ids}
        self.state.ready = [g for g in self.state.ready if g.group_id not in consumed]
        live = {g.segment_key for g in self.state.ready}
        self.state.segments = {k: v for k, v in self.state.segments.items() if k in live}
        self.state.step, self.state.policy_version = res.step, res.policy_version
        if res.corrupt_checkpoints:
            self._fall_back(res.corrupt_checkpoints, at)
        self.state.uncommitted.append(inp.batch)
        self.state.step_times = (self.state.step_times + [at])[-RECENT_STEPS:]
        self.state.steps_redone += res.steps_redone
        if res.restored:
            self.note_event("trainer_restored", "trainer", at, res.steps_redone)
        if res.checkpoint is not None:
            self._commit_checkpoint(res.checkpoint, keep_last)
        m = res.metrics
        self.state.groups_consumed += len(consumed)
        self.state.groups_consumed_twice += m.consumed_twice
        self.state.dropped_stale += m.dropped_stale
        self.state.tokens_consumed += m.tokens
        self.state.reward_recent = (self.state.reward_recent + [m.reward_mean])[-RECENT_REWARDS:]
        for gap, n in m.staleness.items():
            self.state.staleness_histogram[gap] = self.state.staleness_histogram.get(gap, 0) + n

    def _commit_checkpoint(self, ref: CheckpointRef, keep_last: int) -> None:
        """ref, a checkpoint of the step the run is at, becomes the restore point; the batches since the old one
        join committed_batches, and those of a checkpoint that leaves the keep_last window go."""
        base = self._replay_base()
        self.state.committed_batches += self.state.uncommitted
        self.state.checkpoint = ref
        self.state.uncommitted = []
        full = len(self.state.checkpoints) >= keep_last
        self.state.checkpoints = (self.state.checkpoints + [ref])[-keep_last:]
        if full:  # the oldest checkpoint (and step 0 with it) left the window: its batches go too
            self.state.committed_batches = self.state.committed_batches[max(0, self.state.checkpoints[0].step - base):]

    def commit_deadline_checkpoint(self, ref: CheckpointRef, keep_last: int, at: float = 0.0) -> bool:
        """The trainer left on notice between steps and checkpointed its policy (services/trainer.py
        deadline_checkpoint): commit it if it is of the step the run is at and newer than the restore point.
        A step that committed meanwhile moved the run past it (that step's batch is not in it): ignored, the
        successor replays from the restore point as after a crash. A step still in flight commits on top of it
        as usual (its batch goes to `uncommitted`). True when committed."""
        s = self.state
        if ref.run_id != s.run_id or ref.step != s.step or (s.checkpoint is not None and ref.step <= s.checkpoint.step):
            return False
        self._commit_checkpoint(ref, keep_last)
        self.note_event("deadline_checkpoint", "trainer", at, ref.step)
        return True

    def _fall_back(self, corrupt: list[int], at: float) -> None:
        """The trainer found these committed checkpoints corrupt and restored from the newest older restore
        point: forget them, so the next restore starts there and replays the batches since."""
        batches = self.state.committed_batches + self.state.uncommitted
        base = self._replay_base()
        self.state.checkpoints = [c for c in self.state.checkpoints if c.step not in corrupt]
        self.state.checkpoint = self.state.checkpoints[-1] if self.state.checkpoints else None
        split = (self.state.checkpoint.step if self.state.checkpoint else 0) - base
        self.state.committed_batches, self.state.uncommitted = batches[:split], batches[split:]
        restored_from = self.state.checkpoint.step if self.state.checkpoint else 0
        self.note_event("checkpoint_fallback", ",".join(f"step-{c}" for c in corrupt), at, restored_from)

    # -- status ------------------------------------------------------------------------------

    def status(self, phase: str, total_steps: int, history_events: int, training: bool = False,
               **watchdog: Any) -> RunStatus:
        """`watchdog`: the config's stall_warn_s, replicas_wanted and has_batch (laminar/watchdog.py)."""
        s = self.state
        busy, wait = s.trainer_busy_s, s.trainer_wait_s
        return RunStatus(
            run_id=s.run_id,
            phase=phase,
            step=s.step,
            total_steps=total_steps,
            policy_version=s.policy_version,
            ready_groups=len(s.ready),
            open_leases=len(s.open_leases),
            groups_generated=s.groups_generated,
            groups_consumed=s.groups_consumed,
            groups_consumed_twice=s.groups_consumed_twice,
            tokens_consumed=s.tokens_consumed,
            reward_recent=list(s.reward_recent),
            versions_in_use=self.versions_in_use(),
            max_versions_in_use=s.max_versions_in_use,
            staleness_histogram=dict(sorted(s.staleness_histogram.items(), key=lambda kv: int(kv[0]))),
            trainer_wait_fraction=wait / (wait + busy) if wait + busy > 0 else 0.0,
            history_events=history_events,
            history_events_max=max(s.history_events_max, history_events),
            continued_as_new=s.continued_as_new,
            checkpoints=list(s.checkpoints),
            relays=[r for _, r in sorted(s.relays.items())],
            replicas=[r for _, r in sorted(s.replicas.items())],
            started_at=s.started_at,
            prompts_issued=s.prompt_cursor,
            returned_leases=len(s.returned),
            steps_redone=s.steps_redone,
            tokens_regenerated=s.tokens_regenerated,
            reprefill_tokens=s.reprefill_tokens,
            duplicate_reports=s.duplicate_reports,
            step_times=list(s.step_times),
            events=list(s.events),
            event_times={k: list(v) for k, v in s.event_times.items()},
            handover_stalls=list(s.handover_stalls),
            handover_stall_max=s.handover_stall_max,
            training=training,
            dropped_stale=s.dropped_stale,
            repacks=s.repacks,
            repack_groups=s.repack_groups,
            repack_overhead_s=round(s.repack_overhead_s, 4),
            migrating=self.migrating(),
            workflow_resets=list(s.workflow_resets),
            groups_failed=s.groups_failed,
            failures=list(s.failures),
            last_step_at=s.last_step_at,
            trainer_ready_at=s.trainer_ready_at,
            replica_seen=dict(s.replica_seen),
            unversioned_since=dict(s.unversioned_since),
            **watchdog,
        )


# A returned group with prefixes waits this long (workflow seconds) for a replica that can continue them; then any
# replica takes it (and generates it again if it cannot): a version nobody holds any more never strands a group.
RESUME_PREFERENCE_S = 15.0


def _can_resume(lease: OpenLease, claimer: ReplicaReport, at: float) -> bool:
    """The claimer can continue the lease's prefixes: it holds their version, or it is idle (nothing in flight or
    waiting: it loads that version from a relay first, services/rollout/migration.py). Plain leases, and any
    lease that has waited RESUME_PREFERENCE_S, go to anyone."""
    return (lease.resume is None or claimer.policy_version == lease.resume_version
            or (claimer.in_flight == 0 and claimer.waiting == 0) or at - lease.returned_at >= RESUME_PREFERENCE_S)
