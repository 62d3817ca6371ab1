"""One rollout replica: the data-plane loop behind the `run_rollout_replica` activity.

Loop (trajectory-level asynchrony; docs/architecture.md, 'Trace 1' and 'Trace 2'):
- admit leased prompt groups into the continuous batch while the replica's policy version is the newest
  its relay holds; once a newer version is there, admit nothing more, let in-flight trajectories finish
  on the version they started with, then pull and load the new version (only between batches); slots
  that free up during that drain are claimed already, and their leases wait to start on the new version;
- write complete groups to the trajectory store, then report them (`add_experience`, idempotent), as soon
  as they complete;
- control calls (claims, reports) run one at a time on the replica's control thread, so the engine keeps
  generating during a round trip; their answers are handled by the loop, in order;
- every flush interval, write all in-flight groups to the partial-response pool, so a killed replica's
  retry resumes them under the policy version they started on (or restarts them fresh, counted); each
  incarnation (history segment, attempt) writes its own fenced pool, so a zombie cannot overwrite its retry's;
- on hand-over (continue-as-new) or stop, flush the pool and return at once (the next incarnation resumes
  the in-flight groups), so a hand-over never waits for the long tail;
- control traffic is bounded by work: a busy replica, or one still without weights, contacts the workflow at
  least every CONTACT_S (that is how it learns of a hand-over while it has no room to claim, and of relays
  that joined after it started, e.g. after a Temporal outage); an idle replica backs off to
  IDLE_CLAIM_MAX_S and a paused one to PAUSED_CLAIM_MAX_S.

Talks to the workflow only through `ControlPort`, so the loop is testable without Temporal.
"""

from __future__ import annotations

import contextvars
import json
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Protocol

from laminar import metrics as prom
from laminar.config import RunConfig
from laminar.errors import CorruptDataError, RelayError
from laminar.logs import get_logger
from laminar.messages import (
    AddExperienceInput,
    AddExperienceResult,
    ClaimPromptsInput,
    ClaimPromptsResult,
    Handoff,
    Incoming,
    Lease,
    MigrationOrder,
    RelayInfo,
    ReplicaReport,
    RolloutReplicaResult,
    Taken,
)
from laminar.policy import load_action, may_start, min_version, policy_for
from laminar.records import Trajectory
from laminar.timing import TimeBreakdown
from relay import client as relay_client
from relay.weights import state_dict_from_buffer
from rl.engine import Finished
from rl.factory import build_engine
from rl.model import bytes_to_state_dict
from rl.tasks import Prompt
from services.model_files import load_run_files
from storage import keys
from storage.objects import ObjectStore
from storage.trajectories import TrajectoryStore

log = get_logger(__name__)

VERSION_POLL_S = 0.5  # how often the replica asks its relay for the newest version
VERSION_WAIT_POLL_S = 0.02  # ... while its leases wait for a version it does not hold yet (barrier modes)
CLAIM_POLL_S = 0.1  # a replica with free slots asks again this long after an empty claim (then doubling)
CONTACT_S = 1.0  # a busy replica with no free slot still reports this often (hand-over, stop)
IDLE_CLAIM_MAX_S = 2.0  # an empty claim doubles the interval up to this (back-pressure, no weights yet)
PAUSED_CLAIM_MAX_S = 10.0  # ... and up to this while the run is paused
CLAIM_MIN_GROUPS = 2  # a replica with groups in flight claims once this many group slots are free ...
REPORT_MIN_GROUPS = 2  # ... and reports once this many groups are complete or the oldest waited REPORT_MAX_WAIT_S:
REPORT_MAX_WAIT_S = 0.25  # each update costs the workflow a task, which delays the trainer's next step (no wait
# at all while the last answer said the trainer is starved: then the wait would be the trainer's)
HEARTBEAT_EVERY_S = 0.2  # the loop heartbeats at most this often (a beat costs ~1.6 ms: thread hop, payload)
PROFILE_EVERY_S = 5.0  # how often the replica writes its time breakdown to the store (and at return)


class ControlPort(Protocol):
    """What the replica needs from the control plane (Temporal updates in production)."""

    def claim(self, inp: ClaimPromptsInput) -> ClaimPromptsResult: ...
    def add_experience(self, inp: AddExperienceInput) -> AddExperienceResult: ...
    def heartbeat(self, details: dict) -> None: ...
    def cancelled(self) -> bool: ...


@dataclass
class _Group:
    lease: Lease
    prompt: Prompt  # derived once per group; the verifier needs it for every finished sample
    started_at: float
    start_version: int  # the policy version it started on (partial rollout may finish it under newer ones)
    done: dict[int, Trajectory] = field(default_factory=dict)  # sample index -> finished trajectory


class RolloutReplica:
    def __init__(
        self,
        *,
        run_id: str,
        replica_id: str,
        host_id: str,
        segment_prefix: str,
        cfg: RunConfig,
        store: ObjectStore,
        control: ControlPort,
        attempt: int = 1,
        generation: int = 0,
        previous_heartbeat: dict | None = None,
        relay_token: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.run_id, self.replica_id, self.host_id = run_id, replica_id, host_id
        self.segment_prefix = segment_prefix  # attempt-scoped: a zombie never overwrites its retry's segments
        self.cfg = cfg
        self.store = store
        self.trajectories = TrajectoryStore(store)
        self.control = control
        self.attempt = attempt
        self.fence = (generation, attempt)  # this incarnation's partial pool
        self.previous_heartbeat = previous_heartbeat or {}  # the failed attempt's last heartbeat details
        self.relay_token = relay_token
        self.clock = clock
        self.claims = 0
        self.policy = policy_for(cfg)  # what the run mode lets this replica do (laminar/policy.py)
        seed = zlib.crc32(f"{cfg.run.seed}/{replica_id}/{segment_prefix}".encode())  # sampling differs per incarnation
        self.engine, self.task = build_engine(cfg, policy=self.policy, seed=seed,
                                              run_files=lambda: load_run_files(store, run_id, cfg))
        self.groups: dict[str, _Group] = {}
        self.completed: list[_Group] = []
        self.reporting: list[_Group] = []  # complete groups whose report is in flight
        self._completed_since = 0.0  # when the oldest complete group not yet reported completed
        self.pending: list[Lease] = []  # leased while draining: admitted once the newer version is loaded
        self._control_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"control-{replica_id}")
        self._call: tuple[str, Future] | None = None  # the control call in flight: ("claim" | "report", future)
        self._last_call = ""  # kind of the last call started
        self.relays: list[RelayInfo] = []
        self.newest_at_relay: int | None = None
        self.newest_known = -1  # the newest version the workflow announced (claims answer with it)
        self.reprefill_tokens = 0  # prefix tokens prefilled again (partial-rollout interrupts, repack takes)
        self.reprefill_unreported = 0  # ... since the last report
        self.seq = 0
        self.groups_completed = self.tokens_generated = 0  # by this incarnation, reported
        self.tokens_regenerated = 0  # since the last report
        self.unsaved_tokens = 0  # generated since the last pool write: a retry would generate them again
        self._pool_empty = False  # unknown until the first write
        # Where this incarnation's time goes; generate/drain count tokens (sequence-steps), the rest calls.
        self.profile = TimeBreakdown()
        self._profile_written = self.profile.started
        self.metrics = prom.ReplicaMetrics.of(replica_id)  # Prometheus series (laminar/metrics.py)
        # dynamic repack (workflows/migrations.py): what the next claim carries, and migrations already handled
        self._handoff: Handoff | None = None
        self._taken: list[Taken] = []
        self._repack_seen: set[str] = set()
        self._kv_reported = 0  # kv_used at the previous report (kv_prev)
        self._hold_version = -1  # a migration to this replica is on its way: do not load past this version
        self._trainer_starved = False  # the last answer said the trainer waits for groups: report at once

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> RolloutReplicaResult:
        try:
            return self._run()
        finally:
            self._control_thread.shutdown(wait=False, cancel_futures=True)
            self.engine.close()  # its GPU slot back; vLLM: one engine per process, kept for the next incarnation

    def _run(self) -> RolloutReplicaResult:
        resumed = self._read_partial_pool()
        self.tokens_regenerated += self._tokens_lost_by_previous_attempt()
        first = self.control.claim(
            ClaimPromptsInput(report=self._report(), max_groups=0, resuming=sorted(resumed), first_claim=True,
                              attempt=self.attempt, request_id=self._request_id())
        )
        self.relays = first.relays
        if first.stop or first.handover:  # started (or retried) while the run hands over: keep the pool
            self.trajectories.write_partial(self.run_id, self.replica_id, self.fence,
                                            [t for rows in resumed.values() for t in rows])
            return self._hand_over(first.stop)
        self._resume({g: rows for g, rows in resumed.items() if g in set(first.resume_ok)})
        self._write_partial_pool()  # claim this incarnation's fence before anything else can be lost
        self.trajectories.clear_partial(self.run_id, self.replica_id, older_than=self.fence)
        last_flush = last_claim = last_poll = last_beat = 0.0
        claim_every = 0.0
        asked = 0  # groups the claim in flight asked for
        while True:
            now = self.clock()
            if self.control.cancelled():
                self._write_partial_pool()
                self._write_profile()
                raise InterruptedError(f"replica {self.replica_id} cancelled")
            if now - last_poll >= (VERSION_WAIT_POLL_S if self._waiting_for_version() else VERSION_POLL_S):
                with self.profile.measure("poll_relay"):
                    self._poll_relay()
                last_poll = now
            action = load_action(self.policy, self.engine.policy_version, self.newest_at_relay, self.engine.in_flight())
            if action == "load" and self._hold_version == self.engine.policy_version:
                action = None  # repack: the groups coming to this replica continue under this version
            if action:
                with self.profile.measure("load_weights" if action == "load" else "interrupt"):
                    self._load_newest(interrupt=action == "interrupt")
            answer = self._collect(wait=False)
            if answer is not None:
                kind, res = answer
                if kind == "claim":
                    self.relays = res.relays or self.relays
                    self.newest_known = max(self.newest_known, res.newest_policy_version)
                    if res.stop or res.handover:
                        return self._hand_over(res.stop)
                    self.pending += res.leases
                    claim_every = _next_claim_interval(claim_every, asked, len(res.leases), res.paused)
                elif res.stop or res.handover:
                    return self._hand_over(res.stop)
                self._hold_version = res.hold_version
                self._trainer_starved = res.trainer_starved
                self._on_repack(res.migrate, res.incoming)
            if self.pending:
                self._admit_startable()
            want = self._admissible_groups()
            busy = self.engine.in_flight() > 0
            # no weights yet: learn relays that join later; holding for a migration: learn when it arrives
            waiting = busy or self.engine.policy_version is None or self._hold_version >= 0
            enough = 1 if not self.groups else min(CLAIM_MIN_GROUPS, self.cfg.rollout.max_inflight_groups)
            claim_due = (want >= enough and now - last_claim >= claim_every) or (
                waiting and not self.completed and now - last_claim >= (
                    CLAIM_POLL_S if self._hold_version >= 0 else CONTACT_S)) or (
                self._handoff is not None or bool(self._taken))  # repack: hand off / acknowledge at once
            report_due = len(self.completed) >= REPORT_MIN_GROUPS or bool(self.completed) and (
                not self.groups or self._trainer_starved or now - self._completed_since >= REPORT_MAX_WAIT_S)
            if self._call is not None:
                pass  # one control call at a time: its answer comes first
            elif report_due and (not claim_due or self._last_call == "claim"):
                self._start_report()  # claims and reports take turns: neither waits behind a run of the other
                last_claim = now  # a report is a contact
            elif claim_due:
                asked = want
                request = ClaimPromptsInput(report=self._report(), max_groups=max(0, want), attempt=self.attempt,
                                            request_id=self._request_id(), handoff=self._handoff,
                                            taken=self._taken)
                self._handoff, self._taken = None, []
                self._start("claim", self.control.claim, request)
                last_claim = now
            if in_flight := self.engine.in_flight():
                self.unsaved_tokens += in_flight  # one token per sequence per engine step
                t0 = self.profile.clock()
                finished = self.engine.step()
                # draining: a newer version waits, so nothing is admitted until these finish
                draining = self._newer_available() and not self.policy.interrupts
                self.profile.add("drain" if draining else "generate", self.profile.clock() - t0, in_flight)
                self.metrics.tokens.inc(in_flight)
                self._record(finished)
            else:
                # idle: waiting for weights, for a claim's answer, or for work (paused, back-pressure: empty
                # claims); wake for an answer
                if self.engine.policy_version is None or self._waiting_for_version():
                    idle = "wait_weights"
                elif self._call is not None and self._call[0] == "claim":
                    idle = "idle_claim_in_flight"
                else:
                    idle = "idle_no_work" if claim_every > 0 else "idle"
                with self.profile.measure(idle):
                    if self._call is not None:
                        wait_futures([self._call[1]], timeout=0.05)
                    else:
                        time.sleep(0.05)
            if now - last_flush >= self.cfg.rollout.flush_interval_s:
                self._write_partial_pool()
                last_flush = now
            if now - last_beat >= HEARTBEAT_EVERY_S:
                with self.profile.measure("heartbeat"):
                    self.control.heartbeat(self._heartbeat_details())
                last_beat = now
            if self.profile.clock() - self._profile_written >= PROFILE_EVERY_S:
                self._write_profile()

    # -- weights -------------------------------------------------------------------------------

    def _relay_order(self) -> list[str]:
        """Own host's relay first, then the others (a rollout whose relay is gone pulls elsewhere)."""
        local = self._local_relays()
        return sorted(local) + [r.address for r in self.relays if r.address not in local]

    def _poll_relay(self) -> None:
        """Newest version at the first relay that holds one (own host first; an empty, just restarted
        relay serves nothing until it has caught up)."""
        for addr in self._relay_order():
            try:
                version = relay_client.latest_version(addr, run=self.run_id, token=self.relay_token)
            except RelayError as e:
                log.warning("relay_poll_failed", replica_id=self.replica_id, address=addr, error=str(e))
                continue
            if version is not None:
                self.newest_at_relay = version
                return

    def _newer_available(self) -> bool:
        current = self.engine.policy_version
        return self.newest_at_relay is not None and (current is None or self.newest_at_relay > current)

    def _waiting_for_version(self) -> bool:
        """Leases wait for a version this replica does not hold yet (a barrier mode's next batch), or an idle
        replica knows from the workflow of a version newer than its own: poll the relay often."""
        v = -1 if self.engine.policy_version is None else self.engine.policy_version
        return (self.engine.in_flight() == 0 and self.newest_known > v) or any(
            min_version(self.policy, lease.prompt_id) > v for lease in self.pending)

    def _load_newest(self, interrupt: bool = False) -> None:
        """Own host's relay: map the version from its shared memory (no copy through a socket); any other
        relay (own one gone): fetch it over TCP. interrupt (partial rollout): in-flight trajectories stop,
        the version loads, and they continue under it (their prefixes are prefilled again, counted)."""
        for addr in self._relay_order():
            try:
                if addr in self._local_relays():
                    # None: this host's relay holds no version (restarted empty): fetch from the next one
                    pulled = relay_client.pull_local(addr, run=self.run_id, token=self.relay_token)
                    if pulled is not None:
                        with pulled:
                            self._load_tensors(pulled.policy_version, state_dict_from_buffer(pulled.buffer),
                                               pulled.buffer.nbytes, "shared_memory", interrupt)
                            return
                version, payload = relay_client.fetch_latest(addr, run=self.run_id, token=self.relay_token)
            except RelayError as e:
                log.warning("relay_pull_failed", replica_id=self.replica_id, address=addr, error=str(e))
                continue
            if version is not None and payload is not None:
                self._load(version, payload, interrupt)
                return

    def _local_relays(self) -> set[str]:
        return {r.address for r in self.relays if r.host_id == self.host_id}

    def _load(self, version: int, payload: bytes, interrupt: bool = False) -> None:
        self._load_tensors(version, bytes_to_state_dict(payload), len(payload), "tcp", interrupt)

    def _load_tensors(self, version: int, tensors: dict, size: int, via: str, interrupt: bool = False) -> None:
        t0 = time.perf_counter()
        self.engine.note_pull(local=via == "shared_memory")
        if interrupt and self.engine.in_flight():
            tokens = self.engine.interrupt_and_load(tensors, version)
            self.reprefill_tokens += tokens
            self.reprefill_unreported += tokens
            log.info("policy_loaded_interrupting", replica_id=self.replica_id, policy_version=version,
                     in_flight=self.engine.in_flight(), reprefill_tokens=tokens)
        else:
            self.engine.load_weights(tensors, version)
        self.metrics.loaded(via, time.perf_counter() - t0)
        log.info("policy_loaded", replica_id=self.replica_id, policy_version=version, bytes=size, via=via,
                 load_s=round(time.perf_counter() - t0, 3))

    def _admissible_groups(self) -> int:
        """Free group slots not yet leased, or 0 while weights are missing. While a newer version waits
        (drain), slots are claimed too: their leases wait in `pending` for the new version."""
        if self.engine.policy_version is None:
            return 0
        return self.engine.free_slots() // self.cfg.rollout.group_size - len(self.pending)

    # -- generation ----------------------------------------------------------------------------

    def _admit_startable(self) -> None:
        """Start the pending leases the run mode lets this replica start now; the others keep waiting (for
        the drain to end, or for the version their batch needs)."""
        newer = self._newer_available()
        start = [lease for lease in self.pending
                 if may_start(self.policy, min_version(self.policy, lease.prompt_id), self.engine.policy_version,
                              newer)]
        if start:
            self.pending = [lease for lease in self.pending if lease not in start]
            self._admit(start)

    def _admit(self, leases: list[Lease]) -> None:
        for lease in leases:
            prompt = self.task.prompt(lease.prompt_id)
            self.groups[lease.group_id] = _Group(lease, prompt, self.clock(), int(self.engine.policy_version or 0))
            for i in range(self.cfg.rollout.group_size):
                self.engine.add(f"{lease.group_id}/{i}", prompt.token_ids)

    def _record(self, finished: list[Finished]) -> None:
        now = self.clock()
        for f in finished:
            group_id, index = f.request_id.rsplit("/", 1)
            group = self.groups[group_id]
            reward = self.task.reward(group.prompt, f.response_ids)
            group.done[int(index)] = self._trajectory(group, int(index), f.response_ids, f.logprobs, reward,
                                                      f.finish_reason, now)
            if len(group.done) == self.cfg.rollout.group_size:
                if not self.completed:
                    self._completed_since = now
                self.completed.append(self.groups.pop(group_id))

    def _trajectory(self, group: _Group, index: int, response: list[int], logprobs: list[float],
                    reward: float, finish: str, now: float) -> Trajectory:
        return Trajectory(
            run_id=self.run_id, prompt_id=group.lease.prompt_id, group_id=group.lease.group_id,
            sample_index=index, prompt_ids=list(group.prompt.token_ids), response_ids=list(response),
            logprobs=list(logprobs), reward=reward, policy_version=group.start_version,
            replica_id=self.replica_id, started_at=group.started_at, ended_at=now, finish_reason=finish,
        )

    # -- control calls on the control thread -------------------------------------------------------

    def _start(self, kind: str, fn: Callable, *args) -> None:
        """Run fn(*args) on the control thread, in the activity's context (its heartbeats and cancellation)."""
        clock, t0 = self.profile.clock, self.profile.clock()

        def timed():
            return fn(*args), clock() - t0

        self._call = (kind, self._control_thread.submit(contextvars.copy_context().run, timed))
        self._last_call = kind

    def _collect(self, wait: bool) -> tuple[str, ClaimPromptsResult | AddExperienceResult] | None:
        """The answer of the control call in flight, once done (or waiting for it); a failed call raises here."""
        if self._call is None or not (wait or self._call[1].done()):
            return None
        kind, future = self._call
        with self.profile.measure("wait_control"):
            res, latency = future.result()
        self._call = None
        self.profile.latency(kind, latency)
        self.metrics.update(kind, latency)
        if kind == "report":
            self._reported(self.reporting, res)
            self.reporting = []
        return kind, res

    def _start_report(self) -> None:
        """Report the complete groups: write them as one segment, then `add_experience`, on the control thread."""
        self.reporting, self.completed = self.completed, []
        rows = [t for g in self.reporting for _, t in sorted(g.done.items())]
        seq, regenerated, report = f"{self.segment_prefix}-{self.seq:06d}", self.tokens_regenerated, self._report()
        self.seq += 1
        self.tokens_regenerated = 0
        reprefill, self.reprefill_unreported = self.reprefill_unreported, 0

        def send() -> AddExperienceResult:
            ref = self.trajectories.write_segment(self.run_id, self.replica_id, seq, rows)
            return self.control.add_experience(AddExperienceInput(report=report, segment=ref,
                                                                  tokens_regenerated=regenerated,
                                                                  reprefill_tokens=reprefill))

        self._start("report", send)

    def _reported(self, groups: list[_Group], res: AddExperienceResult) -> None:
        self.groups_completed += len(res.accepted)
        self.tokens_generated += sum(len(t.response_ids) for g in groups for t in g.done.values())
        log.info("experience_reported", replica_id=self.replica_id, groups=len(groups),
                 policy_version=max(t.policy_version for g in groups for t in g.done.values()),
                 duplicates=len(res.duplicates))

    def _flush_completed(self) -> AddExperienceResult | None:
        """Report the complete groups and wait for the answer (hand-over); None if nothing to report."""
        if not self.completed:
            return None
        self._start_report()
        answer = self._collect(wait=True)
        return None if answer is None else answer[1]

    # -- partial-response pool ------------------------------------------------------------------

    def _write_partial_pool(self) -> None:
        """All samples of every in-flight group: finished ones as they are, the rest as prefixes."""
        now = self.clock()
        rows = [t for g in self.groups.values() for t in g.done.values()]
        for request_id, _prompt, response, logprobs in self.engine.snapshot_inflight():
            group_id, index = request_id.rsplit("/", 1)
            group = self.groups[group_id]
            rows.append(self._trajectory(group, int(index), response, logprobs, 0.0, "partial", now))
        rows += [t for g in self.reporting + self.completed for t in g.done.values()]  # complete, not yet reported
        if not rows and self._pool_empty:
            return  # an idle replica does not rewrite an empty pool every flush interval
        with self.profile.measure("flush_pool"):
            self.trajectories.write_partial(self.run_id, self.replica_id, self.fence, rows)
        self._pool_empty = not rows
        self.unsaved_tokens = 0

    def _read_partial_pool(self) -> dict[str, list[Trajectory]]:
        """The previous incarnation's in-flight groups by group id. A corrupt pool is dropped, not retried
        forever: its groups' leases go back to the pool at the first claim and are generated again."""
        try:
            rows = self.trajectories.read_partial(self.run_id, self.replica_id)
        except CorruptDataError as e:
            log.error("partial_pool_corrupt", replica_id=self.replica_id, error=str(e))
            rows = []
        by_group: dict[str, list[Trajectory]] = {}
        for t in rows:
            by_group.setdefault(t.group_id, []).append(t)
        return by_group

    def _resume(self, resumed: dict[str, list[Trajectory]]) -> None:
        """Continue each resumed group under the policy version it started on, else restart it fresh."""
        if not resumed:
            return
        versions = {t.policy_version for rows in resumed.values() for t in rows}
        version = max(versions)
        payload = self._fetch_version(version)
        if payload is None or len(versions) > 1:
            self._restart_fresh(resumed)
            return
        self._load(version, payload)
        self._continue(resumed, version)
        log.info("partial_groups_resumed", replica_id=self.replica_id, groups=len(resumed), policy_version=version)

    def _continue(self, groups: dict[str, list[Trajectory]], version: int) -> None:
        """Continue these groups under `version` (the one loaded): partial samples from their prefixes (prefilled
        again), missing samples from the prompt; finished samples are kept as they are."""
        for group_id, rows in groups.items():
            first = rows[0]
            group = _Group(Lease(group_id, first.prompt_id), self.task.prompt(first.prompt_id), first.started_at,
                           version)
            self.groups[group_id] = group
            for t in rows:
                if t.finish_reason == "partial":
                    self.engine.add(f"{group_id}/{t.sample_index}", t.prompt_ids,
                                    prefix_ids=t.response_ids, prefix_logprobs=t.logprobs)
                else:
                    group.done[t.sample_index] = t
            missing = set(range(self.cfg.rollout.group_size)) - {t.sample_index for t in rows}
            for i in sorted(missing):
                self.engine.add(f"{group_id}/{i}", first.prompt_ids)
            if len(group.done) == self.cfg.rollout.group_size:
                self.completed.append(self.groups.pop(group_id))

    # -- dynamic repack (workflows/migrations.py) ---------------------------------------------------------

    def _on_repack(self, order: MigrationOrder | None, incoming: list[Incoming]) -> None:
        """An answer's repack part: an order makes this replica a source, each Incoming a destination. Each
        migration is handled once: answers repeat it until the workflow has this replica's hand-off or
        acknowledgement, so an id is remembered only while answers still carry it."""
        if order is not None and order.migration_id not in self._repack_seen:
            self._repack_seen.add(order.migration_id)
            self._hand_off(order)
        for inc in incoming:
            if inc.migration_id not in self._repack_seen:
                self._repack_seen.add(inc.migration_id)
                self._take(inc)
        self._repack_seen &= {inc.migration_id for inc in incoming} | ({order.migration_id} if order else set())

    def _hand_off(self, order: MigrationOrder) -> None:
        """Stop every unfinished group, write them (prefixes and log-probs) as one segment, and hand them over
        on the next claim; declines when its version is no longer the order's or nothing is left in flight.
        The leases stay this replica's until the workflow records the hand-off, so a death before that
        recovers them as any other in-flight group."""
        t0 = time.perf_counter()
        if self.engine.policy_version != order.policy_version or not self.groups:
            self._handoff = Handoff(order.migration_id)
            log.info("repack_declined_as_source", replica_id=self.replica_id, migration=order.migration_id,
                     policy_version=self.engine.policy_version, groups=len(self.groups))
            return
        now = self.clock()
        moving, self.groups = self.groups, {}  # every in-flight request belongs to one of these groups
        rows = [t for g in moving.values() for t in g.done.values()]
        stopped = self.engine.abort()
        for request_id, _prompt, response, logprobs in stopped:
            group_id, index = request_id.rsplit("/", 1)
            rows.append(self._trajectory(moving[group_id], int(index), response, logprobs, 0.0, "partial", now))
        with self.profile.measure("repack_out"):
            ref = self.trajectories.write_migration(self.run_id, order.migration_id, rows)
        self._handoff = Handoff(order.migration_id, ref, overhead_s=time.perf_counter() - t0)
        log.info("repack_handed_off", replica_id=self.replica_id, migration=order.migration_id,
                 destination=order.destination, groups=len(moving), sequences=len(stopped),
                 policy_version=order.policy_version)

    def _take(self, inc: Incoming) -> None:
        """Continue a source's groups under their version if this replica still holds it and has the slots;
        else decline (the workflow sends them back to the pool). Acknowledged on the next claim."""
        t0 = time.perf_counter()
        ok = self.engine.policy_version == inc.policy_version
        by_group: dict[str, list[Trajectory]] = {}
        if ok:
            try:
                with self.profile.measure("repack_in"):
                    rows = self.trajectories.read_segment(inc.segment)
            except CorruptDataError as e:
                log.error("repack_segment_corrupt", replica_id=self.replica_id, migration=inc.migration_id,
                          error=str(e))
                rows = []
            wanted = set(inc.segment.group_ids)
            for t in rows:
                if t.group_id in wanted:
                    by_group.setdefault(t.group_id, []).append(t)
            unfinished = sum(self.cfg.rollout.group_size - sum(1 for t in g if t.finish_reason != "partial")
                             for g in by_group.values())
            ok = set(by_group) == wanted and unfinished <= self.engine.free_slots()
        if ok:
            self._continue(by_group, inc.policy_version)
            tokens = sum(len(t.prompt_ids) + len(t.response_ids) for g in by_group.values() for t in g
                         if t.finish_reason == "partial")
            self.reprefill_tokens += tokens
            self.reprefill_unreported += tokens
        self._taken.append(Taken(inc.migration_id, ok, overhead_s=time.perf_counter() - t0))
        log.info("repack_taken" if ok else "repack_declined_as_destination", replica_id=self.replica_id,
                 migration=inc.migration_id, source=inc.source, groups=len(inc.segment.group_ids),
                 policy_version=self.engine.policy_version, wanted_version=inc.policy_version)

    def _fetch_version(self, version: int) -> bytes | None:
        for addr in self._relay_order():
            try:
                got = relay_client.fetch_version(addr, version, run=self.run_id, token=self.relay_token)
            except RelayError:
                continue
            if got is not None:
                return got
        return None

    def _restart_fresh(self, resumed: dict[str, list[Trajectory]]) -> None:
        """The start version can no longer be loaded: regenerate those groups from scratch (counted)."""
        self.tokens_regenerated += sum(len(t.response_ids) for rows in resumed.values() for t in rows)
        self._poll_relay()
        self._load_newest()
        leases = [Lease(g, rows[0].prompt_id) for g, rows in resumed.items()]
        log.warning("partial_groups_restarted", replica_id=self.replica_id, groups=len(leases),
                    tokens_regenerated=self.tokens_regenerated)
        self._admit(leases)

    def _hand_over(self, stop: bool) -> RolloutReplicaResult:
        self._flush_completed()
        self._write_partial_pool()
        self._write_profile()

        log.info("replica_returned", replica_id=self.replica_id, stop=stop, in_flight_groups=len(self.groups))
        return RolloutReplicaResult(replica_id=self.replica_id, groups_completed=self.groups_completed,
                                    tokens_generated=self.tokens_generated, handed_over=len(self.groups))

    # -- reports -------------------------------------------------------------------------------

    def _write_profile(self) -> None:
        """This incarnation's time breakdown, to the store (read by the run summary)."""
        with self.profile.measure("profile_write"):
            key = keys.profile(self.run_id, f"rollout-{self.replica_id}-{self.segment_prefix}")
            self.store.put(key, json.dumps(self.profile.to_dict()).encode())
        self._profile_written = self.profile.clock()

    def _report(self, advance: bool = True) -> ReplicaReport:
        """What this replica holds now; kv_prev is kv_used at the previous report (heartbeats do not advance it)."""
        used, capacity = self.engine.kv_usage()
        version = self.engine.policy_version
        report = ReplicaReport(
            replica_id=self.replica_id, host_id=self.host_id,
            policy_version=-1 if version is None else int(version),
            in_flight=self.engine.in_flight(), kv_used=used, kv_capacity=capacity,
            kv_prev=self._kv_reported, waiting=len(self.pending),
        )
        if advance:
            self._kv_reported = used
        return report

    def _request_id(self) -> str:
        self.claims += 1
        return f"{self.segment_prefix}-c{self.claims}"

    def _heartbeat_details(self) -> dict:
        r = self._report(advance=False)
        self.metrics.state(r.policy_version, r.in_flight, r.kv_used, r.kv_capacity)
        return {"policy_version": r.policy_version, "in_flight": r.in_flight, "kv_used": r.kv_used,
                "kv_capacity": r.kv_capacity, "groups_completed": self.groups_completed,
                "unsaved_tokens": self.unsaved_tokens}

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


def _next_claim_interval(current: float, wanted: int, got: int, paused: bool) -> float:
    """Claim again as soon as slots are free while work comes; back off (doubling from CLAIM_POLL_S) while
    claims come back empty."""
    if got > 0:
        return 0.0
    if wanted == 0:
        return current
    return min(PAUSED_CLAIM_MAX_S if paused else IDLE_CLAIM_MAX_S, max(CLAIM_POLL_S, current * 2))

