"""`RolloutReplica`: wires the collaborators of one replica incarnation and runs its loop, one turn at a time
(services/rollout/__init__.py describes the loop)."""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace

from laminar import metrics as prom
from laminar.config import RunConfig
from laminar.contract import (
    AddExperienceInput,
    AddExperienceResult,
    ClaimPromptsInput,
    ClaimPromptsResult,
    ReplicaReport,
    RolloutReplicaResult,
)
from laminar.logs import get_logger
from laminar.notice import NOTICE, Notice
from laminar.policy import may_start, min_version, policy_for
from laminar.refs import SegmentRef
from laminar.rl.factory import build_engine
from laminar.services.model_files import load_run_base, load_run_files
from laminar.services.rollout.batch import Batch, Counters, Group
from laminar.services.rollout.control import Contacts, ControlCalls, ControlPort
from laminar.services.rollout.evaluation import EvalWork
from laminar.services.rollout.migration import Repack
from laminar.services.rollout.pool import PartialPool
from laminar.services.rollout.timing import TIMING, ReplicaTiming
from laminar.services.rollout.weights import Weights
from laminar.storage import keys
from laminar.storage.objects import ObjectStore
from laminar.storage.trajectories import TrajectoryStore
from laminar.timing import TimeBreakdown

log = get_logger(__name__)


class RolloutReplica:
    def __init__(self, *, run_id: str, replica_id: str, host_id: str, segment_prefix: str, cfg: RunConfig,
                 store: ObjectStore, control: ControlPort, attempt: int = 1, generation: int = 0,
                 previous_heartbeat: dict | None = None, relay_token: str | None = None,
                 clock: Callable[[], float] = time.time, timing: ReplicaTiming = TIMING,
                 notice: Notice = NOTICE) -> None:
        self.run_id, self.replica_id, self.host_id, self.cfg, self.store = run_id, replica_id, host_id, cfg, store
        self.segment_prefix = segment_prefix  # attempt-scoped: a zombie never overwrites its retry's segments
        self.control, self.attempt, self.clock, self.timing = control, attempt, clock, timing
        self.notice = notice  # this process's notice (laminar/notice.py): set, the replica leaves at its next turn
        self.previous_heartbeat = previous_heartbeat or {}  # the failed attempt's last heartbeat details
        self.policy = policy_for(cfg)  # what the run mode lets this replica do (laminar/policy.py)
        seed = zlib.crc32(f"{cfg.run.seed}/{replica_id}/{segment_prefix}".encode())  # sampling differs per incarnation
        self.engine, self.task = build_engine(cfg, policy=self.policy, seed=seed,
                                              run_files=lambda: load_run_files(store, run_id, cfg),
                                              run_base=lambda: load_run_base(store, run_id))
        # where this incarnation's time goes; generate/drain count tokens (sequence-steps), the rest calls
        self.profile, self.counters = TimeBreakdown(), Counters()
        self.metrics = prom.ReplicaMetrics.of(replica_id)  # Prometheus series (laminar/metrics.py)
        self.calls = ControlCalls(replica_id, segment_prefix, self.profile, self.metrics)
        self.contacts = Contacts(timing, cfg.rollout.max_inflight_groups)
        trajectories = TrajectoryStore(store)
        self.batch = Batch(self.engine, self.task, run_id, replica_id, cfg.rollout.group_size, clock,
                           reward_timeout_s=cfg.task.reward_timeout_s, max_group_retries=cfg.task.max_group_retries,
                           counters=self.counters)
        self.weights = Weights(self.engine, self.policy, run_id, replica_id, host_id, relay_token, self.counters,
                               self.metrics)
        self.pool = PartialPool(trajectories, run_id, replica_id, (generation, attempt), self.batch, self.weights,
                                self.counters, self.profile)
        self.repack = Repack(self.batch, trajectories, run_id, replica_id, self.counters, self.profile,
                             load_version=self.weights.load_version)
        # held-out eval leases, on an eval engine of its own (services/rollout/evaluation.py)
        self.eval = EvalWork(cfg, self.task, self.engine, self.weights.fetch, seed, replica_id)
        self.seq, self.last_beat, self.profile_written = 0, 0.0, self.profile.started
        self.parked = False  # kept across a continue-as-new (services/rollout/attach.py): engine and calls stay up

    # -- a continue-as-new without a hand-over (services/rollout/attach.py) ------------------------

    def reattach(self, control: ControlPort, attempt: int, generation: int) -> None:
        """Adopted by the next segment's activity: talk to the workflow through its control port from now on (its
        heartbeats, its cancellation), and write its partial pool under that activity's fence (a retry of it reads
        the newest). Segment keys and request ids keep this incarnation's prefix: still unique."""
        self.control, self.attempt, self.parked = control, attempt, False
        self.pool.fence = (generation, attempt)

    def held(self) -> list[str]:
        """Every training group this replica holds a lease of: in flight, waiting, deferred, complete or failed and
        not yet reported (no report is in flight when it parks: the hand-over came as an answer)."""
        b = self.batch
        return sorted({*b.groups, *(lease.group_id for lease in b.pending), *b.deferred,
                       *(g.lease.group_id for g in b.completed + b.reporting),
                       *(f.group_id for f in b.failed + b.reporting_failed)})

    def keepable(self) -> bool:
        """It can park: no repack hand-off or acknowledgement waits to be sent and no held-out eval is under way
        (those talk to the workflow about this segment's orders; such a replica hands over as before)."""
        return not self.repack.urgent and not self.eval.busy() and self.calls.kind is None

    def close_parked(self) -> None:
        """A parked replica nobody adopted: close it without a word to the workflow (its leases are recovered at its
        next first claim, from its partial pool or fresh, as after a crash)."""
        self.calls.shutdown()
        self.engine.close()
        log.info("parked_replica_closed", replica_id=self.replica_id, in_flight_groups=len(self.batch.groups))

    def _reattach(self) -> RolloutReplicaResult | None:
        """The first claim of an adopted replica: it resumes every group it holds (the workflow carried their leases);
        any the workflow no longer counts as its own (none, unless a migration or a lost-replica recovery took it) is
        dropped (its sequences aborted), so no report names a lease it does not hold."""
        held = self.held()
        first = self.control.claim(
            ClaimPromptsInput(report=self._report(), max_groups=0, resuming=held, first_claim=True,
                              attempt=self.attempt, request_id=self.calls.request_id(), **self.eval.claim_fields()))
        self.eval.answered(first.eval_leases)
        self.weights.relays = first.relays or self.weights.relays
        self.weights.newest_known = max(self.weights.newest_known, first.newest_policy_version)
        if first.stop or first.handover:
            return self._hand_over(first.stop, keep=first.keep)
        ok, b = set(first.resume_ok), self.batch
        if len(ok) < len(held):
            b.pending = [lease for lease in b.pending if lease.group_id in ok]
            b.completed = [g for g in b.completed if g.lease.group_id in ok]
            b.failed = [f for f in b.failed if f.group_id in ok]
            for g in [g for g in b.deferred if g not in ok]:
                del b.deferred[g]
            gone = [g for g in b.groups if g not in ok]
            self.engine.abort([f"{g}/{i}" for g in gone for i in range(self.cfg.rollout.group_size)])
            for g in gone:
                del b.groups[g]
            log.warning("reattach_leases_gone", replica_id=self.replica_id, gone=len(held) - len(ok))
        self.contacts.last_claim = self.clock()
        log.info("replica_reattached", replica_id=self.replica_id, groups=len(ok), attempt=self.attempt)
        return None

    # -- the loop ------------------------------------------------------------------------------

    def run(self, starting: AbstractContextManager = nullcontext(), reattach: bool = False) -> RolloutReplicaResult:
        """The loop until the replica hands over, departs, stops or parks. `starting` is held around the start (pool
        read, first claim, resume; or an adopted replica's first claim), before the loop's own heartbeats: the
        activity's start-up heartbeat."""
        try:
            with starting:
                done = self._reattach() if reattach else self._start()
            while done is None:
                done = self._turn()
            return done
        finally:
            if not self.parked:
                self.calls.shutdown()
                self.engine.close()  # its GPU slot back; vLLM: one engine per process, kept for the next incarnation

    def _start(self) -> RolloutReplicaResult | None:
        """Resume the previous incarnation's pool as the first claim's answer allows; returns at once when the
        run hands over (the pool is kept for the next incarnation)."""
        resumed = self.pool.read()
        lost = self._tokens_lost_by_previous_attempt()
        first = self.control.claim(
            ClaimPromptsInput(report=self._report(), max_groups=0, resuming=sorted(resumed), first_claim=True,
                              attempt=self.attempt, request_id=self.calls.request_id(), **self.eval.claim_fields())
        )
        self.eval.answered(first.eval_leases)
        self.weights.relays = first.relays
        # a previous incarnation that departed handed everything on (its last heartbeat may predate that)
        self.counters.tokens_regenerated += 0 if first.departed else lost
        if first.stop or first.handover:
            self.pool.keep(resumed)
            return self._hand_over(first.stop)
        self.pool.resume({g: rows for g, rows in resumed.items() if g in set(first.resume_ok)})
        self.pool.write()  # claim this incarnation's fence before anything else can be lost
        self.pool.clear_older()
        return None

    def _turn(self) -> RolloutReplicaResult | None:
        """Weights, the control plane's answer, the next contact, one engine step, upkeep; the result once the
        replica hands over or stops."""
        now = self.clock()
        if self.notice.given:  # this worker goes away (laminar/notice.py): leave without waiting to be found dead
            return self._depart("notice")
        if self.control.cancelled():
            self.pool.write()
            self._write_profile()
            raise InterruptedError(f"replica {self.replica_id} cancelled")
        self.weights.refresh(now, self.batch.pending, self.timing, self.profile, self.contacts.awaited_version())
        if (done := self._on_answer()) is not None:
            return done
        if self.batch.deferred:  # resumes that waited for room (Batch.resume)
            self.batch.resume_deferred()
        if self.batch.pending:
            self._admit_startable()
        self._contact(now)
        if in_flight := self.engine.in_flight():
            self._generate(in_flight)
        elif not self.eval.busy():
            self._idle()
        if self.eval.busy():
            with self.profile.measure("eval"):
                self.eval.step()
        self._upkeep(now)
        return None

    def _on_answer(self) -> RolloutReplicaResult | None:
        """Handle the control call's answer, if one came: leases, relays, hand-over, repack orders."""
        answer = self._collect(wait=False)
        if answer is None:
            return None
        kind, res = answer
        claim = res if kind == "claim" else res.claim  # a report may carry the next claim (its answer with it)
        if claim is not None:
            self.weights.relays = claim.relays or self.weights.relays
            self.weights.newest_known = max(self.weights.newest_known, claim.newest_policy_version)
        if res.stop:
            return self._hand_over(True)
        if res.leave:  # `laminar scale` removed it
            return self._depart("removed")
        if res.handover:
            return self._hand_over(False, keep=res.keep)
        if claim is not None:
            self.batch.pending += claim.leases
            self.contacts.claimed(len(claim.leases), claim.paused, claim.newest_policy_version)
            self.eval.answered(claim.eval_leases)
        self.weights.hold_version = res.hold_version
        self.contacts.trainer_starved = res.trainer_starved
        self.repack.on_answer(res.migrate, res.incoming)
        return None

    def _contact(self, now: float) -> None:
        """Start the claim or report that is due, one control call at a time, in as few updates as it takes: a
        report carries the claim that is due with it, and a claim that is due carries the groups complete by then
        (one `add_experience` update instead of two; the workflow answers the claim after the report)."""
        if self.calls.kind is not None:
            return
        want, b, holding = self._admissible_groups(), self.batch, self.weights.hold_version >= 0
        waiting = self.engine.in_flight() > 0 or self.engine.policy_version is None or holding
        relay_version = self.weights.newest_at_relay
        claim_due = self.contacts.claim_due(now, want, len(b.groups), len(b.completed), waiting, holding,
                                            self.repack.urgent, relay_version) or self.eval.due()
        done = len(b.completed) + len(b.failed)
        if not (claim_due or self.contacts.report_due(now, len(b.groups), done, b.completed_since)):
            return
        claim = None
        if claim_due:
            self.contacts.asked = want
            self.contacts.claiming(relay_version)
            handoff, taken = self.repack.outgoing()
            claim = ClaimPromptsInput(report=self._report(), max_groups=max(0, want), attempt=self.attempt,
                                      request_id=self.calls.request_id(), handoff=handoff, taken=taken,
                                      **self.eval.claim_fields())
        if done:
            self._start_report(claim)
        else:
            self.calls.start("claim", self.control.claim, claim)
        self.contacts.last_claim = now  # a report is a contact too

    def _generate(self, in_flight: int) -> None:
        """One engine step; draining (a newer version waits, so nothing is admitted until these finish)."""
        self.counters.unsaved_tokens += in_flight  # one token per sequence per engine step
        t0 = self.profile.clock()
        finished = self.engine.step()
        draining = self.weights.newer_available() and not self.policy.interrupts
        self.profile.add("drain" if draining else "generate", self.profile.clock() - t0, in_flight)
        self.metrics.tokens.inc(in_flight)
        self.batch.record(finished)

    def _idle(self) -> None:
        """Nothing in flight: waiting for weights, for a claim's answer, or for work (paused, back-pressure:
        empty claims); wake for an answer."""
        if self.engine.policy_version is None or self.weights.waiting_for_version(self.batch.pending):
            idle = "wait_weights"
        elif self.calls.claiming:
            idle = "idle_claim_in_flight"
        else:
            idle = "idle_no_work" if self.contacts.claim_every > 0 else "idle"
        with self.profile.measure(idle):
            self.calls.wait(self.timing.idle_wait_s)

    def _upkeep(self, now: float) -> None:
        self.pool.flush_if_due(now, self.cfg.rollout.flush_interval_s)
        if now - self.last_beat >= self.timing.beat_every_s(self.cfg.rollout.heartbeat_timeout_s):
            with self.profile.measure("heartbeat"):
                self.control.heartbeat(self._heartbeat_details())
            self.last_beat = now
        if self.profile.clock() - self.profile_written >= self.timing.profile_every_s:
            self._write_profile()

    # -- admission -----------------------------------------------------------------------------

    def _admissible_groups(self) -> int:
        """Free group slots not yet leased, or 0 while weights are missing. While a newer version waits
        (drain), slots are claimed too: their leases wait in `pending` for the new version."""
        if self.engine.policy_version is None:
            return 0
        return self.engine.free_slots() // self.cfg.rollout.group_size - len(self.batch.pending)

    def _admit_startable(self) -> None:
        """Start the pending leases the run mode lets this replica start now; the others keep waiting (for
        the drain to end, or for the version their batch needs)."""
        newer, b = self.weights.newer_available(), self.batch
        if resumes := [lease for lease in b.pending if lease.resume is not None]:
            b.pending = [lease for lease in b.pending if lease.resume is None]
            self.repack.take_leases(resumes)  # under the version they started on: no run-mode wait
        start = [lease for lease in b.pending
                 if may_start(self.policy, min_version(self.policy, lease.prompt_id), self.engine.policy_version,
                              newer)]
        if start:
            b.pending = [lease for lease in b.pending if lease not in start]
            b.admit(start)

    # -- reports -------------------------------------------------------------------------------

    def _collect(self, wait: bool) -> tuple[str, ClaimPromptsResult | AddExperienceResult] | None:
        answer = self.calls.collect(wait)
        if answer is not None and answer[0] == "report":
            self._reported(self.batch.reporting, answer[1])
            self.batch.reporting, self.batch.reporting_failed = [], []
        return answer

    def _start_report(self, claim: ClaimPromptsInput | None = None) -> None:
        """Report the complete groups: write them as one segment, then `add_experience` (carrying `claim`, if
        any), on the control thread."""
        b, c = self.batch, self.counters
        b.reporting, b.completed = b.completed, []
        b.reporting_failed, b.failed = b.failed, []
        rows = [t for g in b.reporting for _, t in sorted(g.done.items())]
        failed = list(b.reporting_failed)
        report = claim.report if claim is not None else self._report()  # one report of the replica's state
        seq, regenerated = f"{self.segment_prefix}-{self.seq:06d}", c.tokens_regenerated
        self.seq += 1
        c.tokens_regenerated = 0
        reprefill, c.reprefill_unreported = c.reprefill_unreported, 0

        def send() -> AddExperienceResult:
            # only failed groups: no segment is written (an empty ref; the workflow's validator allows it)
            ref = (self.pool.trajectories.write_segment(self.run_id, self.replica_id, seq, rows) if rows
                   else SegmentRef(key="", sha256="", size=0, rows=0))
            return self.control.add_experience(AddExperienceInput(report=report, segment=ref,
                                                                  tokens_regenerated=regenerated,
                                                                  reprefill_tokens=reprefill, failed=failed,
                                                                  claim=claim))

        self.calls.start("report", send, claiming=claim is not None)

    def _reported(self, groups: list[Group], res: AddExperienceResult) -> None:
        self.counters.groups_completed += len(res.accepted)
        self.counters.tokens_generated += sum(len(t.response_ids) for g in groups for t in g.done.values())
        log.info("experience_reported", replica_id=self.replica_id, groups=len(groups),
                 policy_version=max((t.policy_version for g in groups for t in g.done.values()), default=-1),
                 duplicates=len(res.duplicates), failed=len(res.failed))

    def _hand_over(self, stop: bool, keep: bool = False) -> RolloutReplicaResult:
        """Report what is complete, write the pool and return at once: the next incarnation resumes the
        in-flight groups, so a hand-over never waits for the long tail. With `keep` (and nothing of this segment's
        own under way), park instead: nothing is written or reported, the engine keeps its groups, and the next
        segment's activity re-attaches it (services/rollout/attach.py; the activity parks it)."""
        if keep and not stop and self.keepable():
            self.parked = True
            log.info("replica_parked", replica_id=self.replica_id, in_flight_groups=len(self.batch.groups))
            return RolloutReplicaResult(replica_id=self.replica_id, groups_completed=self.counters.groups_completed,
                                        tokens_generated=self.counters.tokens_generated, handed_over=0,
                                        kept=len(self.held()))
        if self.batch.completed or self.batch.failed:
            self._start_report()
            self._collect(wait=True)
        self.pool.write()
        self._write_profile()
        log.info("replica_returned", replica_id=self.replica_id, stop=stop, in_flight_groups=len(self.batch.groups))
        return RolloutReplicaResult(replica_id=self.replica_id, groups_completed=self.counters.groups_completed,
                                    tokens_generated=self.counters.tokens_generated,
                                    handed_over=len(self.batch.groups))

    def _depart(self, reason: str) -> RolloutReplicaResult:
        """Leave at once without losing work (a notice, or `laminar scale` removed it): report what is complete,
        write the pool (should the departure not reach the workflow, the retry resumes from it), stop every
        unfinished group and send them, as one segment, with a Departure on a last claim. The workflow moves them
        to a replica of their version or returns them with their prefixes; nothing waits for a heartbeat
        timeout to find this replica gone."""
        if self.calls.kind is not None:
            self._collect(wait=True)
        if self.batch.completed or self.batch.failed:
            self._start_report()
            self._collect(wait=True)
        self.pool.write()
        departure = self.repack.depart(reason, f"depart-{self.replica_id}-{self.segment_prefix}")
        # tokens thrown away since the last report go with the departure: no report follows it
        departure = replace(departure, tokens_regenerated=departure.tokens_regenerated + self.counters.tokens_regenerated)
        self.counters.tokens_regenerated = 0
        handoff, taken = self.repack.outgoing()
        self.control.claim(ClaimPromptsInput(report=self._report(), max_groups=0, attempt=self.attempt,
                                             request_id=self.calls.request_id(), handoff=handoff, taken=taken,
                                             departure=departure, **self.eval.claim_fields(leaving=True)))
        self._write_profile()
        log.info("replica_departed", replica_id=self.replica_id, reason=reason,
                 groups=len(departure.segment.group_ids) if departure.segment else 0)
        return RolloutReplicaResult(replica_id=self.replica_id, groups_completed=self.counters.groups_completed,
                                    tokens_generated=self.counters.tokens_generated, handed_over=0, departed=reason)

    def _write_profile(self) -> None:
        """This incarnation's time breakdown, to the store (read by the run summary)."""
        with self.profile.measure("profile_write"):
            key = keys.profile(self.run_id, f"rollout-{self.replica_id}-{self.segment_prefix}")
            self.store.put(key, json.dumps(self.profile.to_dict()).encode())
        self.profile_written = self.profile.clock()

    def _report(self, advance: bool = True) -> ReplicaReport:
        """What this replica holds now; kv_prev is kv_used at the previous report (heartbeats do not advance it)."""
        used, capacity = self.engine.kv_usage()
        version = self.engine.policy_version
        report = ReplicaReport(
            replica_id=self.replica_id, host_id=self.host_id,
            policy_version=-1 if version is None else int(version),
            in_flight=self.engine.in_flight(), kv_used=used, kv_capacity=capacity,
            kv_prev=self.counters.kv_reported, waiting=len(self.batch.pending),
            version_missing=self.weights.version_missing(),
        )
        if advance:
            self.counters.kv_reported = used
        return report

    def _heartbeat_details(self) -> dict:
        r = self._report(advance=False)
        self.metrics.state(r.policy_version, r.in_flight, r.kv_used, r.kv_capacity)
        return {"policy_version": r.policy_version, "in_flight": r.in_flight, "kv_used": r.kv_used,
                "kv_capacity": r.kv_capacity, "groups_completed": self.counters.groups_completed,
                "unsaved_tokens": self.counters.unsaved_tokens}

    def _tokens_lost_by_previous_attempt(self) -> int:
        """Tokens the failed attempt generated after its last pool write (they die with it and are generated
        again), as its last heartbeat reported them; tokens generated after that heartbeat are not known."""
        lost = tokens_lost_with(self.previous_heartbeat)
        if lost > 0:
            log.info("tokens_lost_with_attempt", replica_id=self.replica_id, attempt=self.attempt - 1, tokens=lost)
        return lost


def tokens_lost_with(last_heartbeat: dict) -> int:
    """Tokens a dead incarnation generated after its last pool write, from its last heartbeat's details
    (0 for a first attempt, or when that heartbeat was sent while it waited on the control plane)."""
    return max(0, int(last_heartbeat.get("unsaved_tokens", 0)))
