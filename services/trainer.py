"""The trainer process's domain service: one policy and optimizer kept in memory between steps.

`train_step` is idempotent by construction (docs/architecture/invariants.md): the input names the step the policy
must be at; a trainer elsewhere (fresh process, zombie-completed step) restores the committed checkpoint
and replays the batches consumed since, then steps. A committed checkpoint that fails verification is
skipped for the newest older one the workflow retains, replaying from there. The consumed-group set is part of the checkpoint, so a
group consumed twice is detected and counted (it must stay 0), never silently trained on again.
After each step the new version is pushed to the master relay, which broadcasts it down the chain
while the trainer goes back to work.

On notice (laminar/notice.py: SIGTERM, a preemption warning), the step in flight finishes and writes a deadline
checkpoint, which its result carries, so the workflow commits it as any other; a trainer told while no step
runs writes one when its worker has stopped (`deadline_checkpoint`) and the process signals it to the workflow.
Either way the successor restores the step the workflow is at and redoes none; a step the workflow scheduled
before the signal reached it names the older restore point, and the successor then finds the deadline checkpoint
at the step asked for and uses it once it checks it against the batches it would replay (_deadline_checkpoint_for).

A relay that fails once (connect or idle timeout of about a second, relay.client.TIMEOUTS) is skipped at once for
the next one in the chain, and skipped by later pushes until a background probe passes (relay.breaker); the step
reports the relays it could not reach, and those taken out of the chain whose probe passed, for the workflow to
take out or back (workflows/relay_health.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from laminar import metrics as prom
from laminar.config import RunConfig
from laminar.contract import (
    BatchPart,
    RepublishInput,
    StepMetrics,
    TrainerInitInput,
    TrainerInitResult,
    TrainStepInput,
    TrainStepResult,
)
from laminar.envs.tools import turn_counts
from laminar.errors import (
    CorruptDataError,
    InconsistentStateError,
    RelayError,
    StepOutOfTurnError,
    StoreError,
    TrainerLeavingError,
)
from laminar.logs import get_logger
from laminar.notice import NOTICE, Notice
from laminar.records import Trajectory
from laminar.refs import CheckpointRef
from laminar.relay import client as relay_client
from laminar.relay.breaker import BREAKERS
from laminar.rl.factory import build_trainer
from laminar.rl.model import state_dict_to_bytes
from laminar.timing import TimeBreakdown

if TYPE_CHECKING:
    from laminar.rl.engine_api import PolicyTrainer
from laminar.policy import policy_for, publishes, staleness_bound, version_of
from laminar.services.model_files import publish_base_weights, publish_model_files, resolve_model_dir
from laminar.services.tracking import Trackers, step_scalars
from laminar.services.turns import Turns
from laminar.storage import keys
from laminar.storage.checkpoints import CheckpointStore, LoadedCheckpoint
from laminar.storage.objects import ObjectStore
from laminar.storage.trajectories import TrajectoryStore

log = get_logger(__name__)

PUBLISHED_RUNS_KEPT = 4  # runs whose last published version this process keeps to republish (one payload each)
MAX_CATCH_UP = 4  # steps a trainer takes ahead of their own activity (_catch_up); the workflow schedules 2 ahead
PROFILE_EVERY_S = 5.0  # how often the trainer writes its time breakdown to the store (and at the last step)


class TrainerService:
    def __init__(self, store: ObjectStore, home: Path, relay_token: str | None = None,
                 notice: Notice = NOTICE) -> None:
        self.notice = notice  # the process's (tests pass their own)
        self._turns = Turns()  # a step, or the deadline checkpoint: never both at once; waiting steps in step order
        self.checkpointed_step = -1  # the step of the newest checkpoint of the in-memory policy (saved or loaded)
        self.relay_token = relay_token
        self.store = store
        self.home = home
        self.checkpoints = CheckpointStore(store)
        self.trajectories = TrajectoryStore(store)
        self.run_id: str | None = None
        self.cfg: RunConfig | None = None
        self.trainer: PolicyTrainer | None = None
        self.step = -1  # steps applied to the in-memory policy; -1: nothing loaded
        self.policy = policy_for(RunConfig())  # the run mode's; set with the run by _restore
        self.consumed: set[str] = set()
        self.last_step_end: float | None = None
        self.profile = TimeBreakdown()  # where this process's time goes (laminar.timing)
        self._profile_written = self.profile.started
        # run_id -> (step, policy_version, payload) of its last publish, least recently published first: one worker
        # set serves several runs, and a run's version may need publishing again after this process moved on
        self._published: OrderedDict[str, tuple[int, int, bytes]] = OrderedDict()
        self.trackers: Trackers | None = None  # the run's experiment trackers: this process is their one writer
        # (run_id, step) -> (its batch's group ids, its result) of steps taken ahead of their own activity
        # (_catch_up); cleared whenever the in-memory policy is rebuilt
        self._ahead: dict[tuple[str, int], tuple[frozenset[str], TrainStepResult]] = {}

    # -- lifecycle -----------------------------------------------------------------------------

    def init(self, inp: TrainerInitInput) -> TrainerInitResult:
        cfg = RunConfig.from_json(inp.config)
        with self._turn():
            self._restore(inp.run_id, cfg, self.checkpoints.load(inp.checkpoint) if inp.checkpoint else None)
            size = len(self._publish(inp.relay_chain)[1]) if publishes(self.policy, self.step) else 0
            return TrainerInitResult(step=self.step, policy_version=self._version(), published_bytes=size)

    def republish(self, inp: RepublishInput) -> int:
        """Push the current version again to the chain the workflow knows now; the version pushed, or -1 when
        this process's policy is not at inp.step (restarted, or another run: its next step publishes) or is
        between versions (stream, mid-batch). A barrier mode needs this: it waits for a version the replicas
        load, and a master relay that died with it would otherwise leave no one to publish it."""
        with self._turn():
            return self._republish(inp)

    def _republish(self, inp: RepublishInput) -> int:
        if self.run_id != inp.run_id or self.step != inp.step or not publishes(self.policy, self.step):
            kept = self._published.get(inp.run_id)
            if kept is not None and kept[0] == inp.step:  # this process moved on to another run: push what it kept
                self._push(inp.relay_chain, inp.run_id, kept[1], kept[2])
                return kept[1]
            log.info("republish_skipped", run_id=inp.run_id, step=inp.step, trainer_step=self.step)
            return -1
        self._publish(inp.relay_chain)
        return self._version()

    def _version(self) -> int:
        """The policy version of the in-memory weights (stream: one per batch of minibatch steps)."""
        return version_of(self.policy, self.step)

    def _restore(self, run_id: str, cfg: RunConfig, loaded: LoadedCheckpoint | None) -> None:
        """Build the run's trainer (rl.factory; one with real weights resolves the model directory and publishes
        its model files for the rollout replicas), then load the verified checkpoint (weights, optimizer, step,
        consumed groups) if any. Samples staler than laminar.policy.staleness_bound(cfg) are dropped
        (partial_rollout bounds staleness even when trainer.max_staleness is -1)."""
        policy = policy_for(cfg)

        def model_dir() -> Path:
            path = resolve_model_dir(cfg, self.home)
            publish_model_files(self.store, run_id, path)
            if cfg.trainer.lora is not None:  # versions are adapters: replicas read the base once (rl/lora.py)
                publish_base_weights(self.store, run_id, path)
            return path

        if self.trainer is not None:  # an FSDP trainer's other ranks go before new ones start
            self.step = -1  # a build that fails below leaves nothing loaded, not a closed trainer at its old step
            self.trainer.close()
        trainer = build_trainer(cfg, policy=policy, max_staleness=staleness_bound(cfg), model_dir=model_dir)
        step, consumed = 0, set()
        if loaded is not None:
            trainer.load_state_parts(loaded.parts)
            step, consumed = int(loaded.meta["step"]), set(loaded.meta.get("consumed", []))
        elif cfg.run.parent:  # a fork's step 0 is its parent's checkpoint: weights and optimizer, nothing else
            trainer.load_state_parts(self._parent_checkpoint(cfg).parts)
        if run_id != self.run_id:  # a worker that serves another run profiles it from scratch
            self.profile, self._profile_written = TimeBreakdown(), time.perf_counter()
        if self.trackers is None or run_id != self.run_id:
            if self.trackers is not None:
                self.trackers.close(finished=False)
            self.trackers = Trackers(run_id, cfg, self.home)
        self.run_id, self.cfg, self.trainer, self.step, self.consumed = run_id, cfg, trainer, step, consumed
        self._ahead.clear()
        self.checkpointed_step = step if loaded is not None else -1
        self.policy = policy
        log.info("trainer_restored", run_id=run_id, step=step, checkpoint=loaded.ref.step if loaded else None)

    def _parent_checkpoint(self, cfg: RunConfig) -> LoadedCheckpoint:
        """The checkpoint a forked run starts from (run.parent at run.parent_step), verified file by file. Its
        consumed groups are the parent's, whose group ids the fork issues afresh, so they are not carried."""
        parent, at = cfg.run.parent, cfg.run.parent_step
        ref = self.checkpoints.verified_at(parent, at)
        if ref is None:
            raise CorruptDataError(
                f"run {cfg.run.run_id} is forked from run {parent} at step {at}, but that checkpoint is not in the "
                f"store or does not verify ({self.checkpoints.verify(parent, at)}); fork again from a checkpoint "
                f"that verifies: `laminar fork {parent}` picks the newest")
        log.info("parent_checkpoint_loaded", run_id=cfg.run.run_id, parent=parent, parent_step=at)
        return self.checkpoints.load(ref)

    # -- one step ------------------------------------------------------------------------------

    def train_step(self, inp: TrainStepInput, heartbeat=lambda: None,
                   schedule_to_start_s: float | None = None, scheduled_at: float | None = None,
                   last: bool = True, attempt: int = 1) -> TrainStepResult:
        """schedule_to_start_s: how long the activity waited on the task queue (control-plane latency);
        scheduled_at: when the workflow scheduled the step (its record carries it: a drill of the control
        worker counts only steps scheduled after the fault). last: the activity's last step; after a notice it
        writes the deadline checkpoint. attempt: the activity's; a step scheduled ahead (inp.ahead) that reaches a
        trainer not at the step before it raises StepOutOfTurnError on its first attempt: a trainer that replaced
        one on notice, or a killed one, lets the step before it run first (the leaving trainer finishes it and its
        deadline checkpoint names this step; a killed one's retry comes), instead of replaying from an older
        restore point now and again for the step before it.

        The trainer's worker runs three activities at once (workers/processes.py), so the steps scheduled ahead are
        already here while the one before them computes: each reads its segments now, then waits its turn (_turn,
        lowest step first)."""
        rows = self._prefetch(inp.batch)
        with self._turn(heartbeat, (inp.run_id, inp.step)) as waited:
            if (done := self._taken_ahead(inp)) is not None:
                if schedule_to_start_s is not None:  # one queue wait per activity, this one's too (its step was
                    # trained by _catch_up: the task queue handed the steps over out of order)
                    self.profile.latency("train_step_schedule_to_start", schedule_to_start_s)
                return done
            if waited and self.notice.given:
                # queued behind the step that was running at the notice: that one ended with a deadline
                # checkpoint; this one goes to the successor (retried) instead of running past the notice
                raise TrainerLeavingError(f"run {inp.run_id} step {inp.step}: this trainer is leaving on notice "
                                          f"({self.notice.reason}); the step is retried on the next trainer")
            self._catch_up(inp, heartbeat, scheduled_at)
            if inp.ahead and inp.replay and (self.run_id != inp.run_id or self.step != inp.step):
                if attempt == 1:
                    raise StepOutOfTurnError(
                        f"run {inp.run_id} step {inp.step}: scheduled ahead of step {inp.step - 1}, but this trainer "
                        f"is at step {self.step} of run {self.run_id}; retried, so that step {inp.step - 1} runs first")
                if self.checkpoints.verified_at(inp.run_id, inp.step) is None:  # else: a deadline checkpoint
                    rewound = self._steps_before(inp, heartbeat, scheduled_at)
                    res = self._train_step(inp, heartbeat, schedule_to_start_s, scheduled_at, last, rows)
                    # this step's result reports the restore (the step before it may have committed already, on
                    # the trainer that died, and then never asks for the result kept for it)
                    return dataclasses.replace(res, restored=True, steps_redone=res.steps_redone + rewound.steps_redone,
                                               corrupt_checkpoints=[*rewound.corrupt_checkpoints,
                                                                    *res.corrupt_checkpoints])
            return self._train_step(inp, heartbeat, schedule_to_start_s, scheduled_at, last, rows)

    @contextmanager
    def _turn(self, heartbeat=lambda: None, step: tuple[str, int] | None = None) -> Iterator[bool]:
        """One call at a time touches the policy (a step, an init, a republish, the deadline checkpoint), the waiting
        steps of a run lowest first (services/turns.py); a call waiting for the one before it keeps its activity's
        heartbeat going (waiting is not a hang). Yields whether it had to wait."""
        _, waited = self._turns.acquire(step, on_wait=heartbeat)
        try:
            yield waited
        finally:
            self._turns.release()

    def _prefetch(self, batch: list[BatchPart]) -> dict[str, list[Trajectory]]:
        """The batch's segments, read before the step's turn (segments are immutable: attempt-scoped keys). A
        read that fails here is left to the step, which reads again and fails or succeeds as it would have."""
        rows: dict[str, list[Trajectory]] = {}
        if self.cfg is None or self.trainer is None:  # nothing loaded yet: the step restores first
            return rows
        t0 = time.monotonic()
        for part in batch:
            try:
                rows[part.segment.key] = self.trajectories.read_segment(part.segment)
            except Exception as e:  # noqa: BLE001 - the step's own read reports it
                log.info("segment_prefetch_failed", segment=part.segment.key, error=str(e))
        # a latency, not a bucket: it overlaps the step before it, and buckets add up to the process's wall
        self.profile.latency("prefetch_segments", time.monotonic() - t0)
        return rows

    def _catch_up(self, inp: TrainStepInput, heartbeat, scheduled_at: float | None) -> None:
        """The workflow schedules the next step while one runs (workflows/trainer.py, train-ahead), and the
        task queue may hand them over out of order: a step a few ahead of the in-memory policy whose replay holds
        the batches in between, on top of exactly what this process trained, trains those batches first (as
        their own steps would) and keeps their results for their activities (_taken_ahead), instead of a rewind
        now and another when the skipped step arrives."""
        if self.run_id != inp.run_id or self.trainer is None or not 0 < inp.step - self.step <= MAX_CATCH_UP:
            return
        start = inp.checkpoint.step if inp.checkpoint is not None else 0
        done, todo = inp.replay[:self.step - start], inp.replay[self.step - start:]
        trained = {g for batch in done for part in batch for g in part.group_ids}
        later = {g for batch in todo for part in batch for g in part.group_ids} | {
            g for part in inp.batch for g in part.group_ids}
        if self.step < start or not trained <= self.consumed or later & self.consumed:
            return
        log.info("trainer_caught_up", run_id=inp.run_id, from_step=self.step, to_step=inp.step)
        for i, batch in enumerate(todo):
            step_inp = dataclasses.replace(inp, step=self.step, batch=batch, replay=inp.replay[:len(done) + i])
            res = self._train_step(step_inp, heartbeat, None, scheduled_at, last=False)
            self._ahead[(inp.run_id, step_inp.step)] = (_group_ids(batch), res)
        while len(self._ahead) > MAX_CATCH_UP:
            self._ahead.pop(next(iter(self._ahead)))

    def _steps_before(self, inp: TrainStepInput, heartbeat, scheduled_at: float | None) -> TrainStepResult:
        """A step scheduled ahead still out of turn on its retry, with no checkpoint at its step (a trainer that left
        on notice writes one once the step before it is done): take the steps that were in flight before it first
        (`inp.behind` of them, 1 for older inputs: their batches end the replay; the first rewinds as its own
        activity would, replaying only the batches before them, and its steps redone are counted in its result) and
        keep each result for that step's own activity (_taken_ahead), so that none of them rewinds again. A checkpoint
        at one of those steps (a trainer that left on notice wrote one once its step was done) is where they start
        instead: the steps before it were done. Returns the first one's result (the rewind)."""
        first = None
        most = min(max(inp.behind, 1), len(inp.replay))
        start = next((b for b in range(1, most) if self.checkpoints.verified_at(inp.run_id, inp.step - b)), most)
        for back in range(start, 0, -1):
            before = dataclasses.replace(inp, step=inp.step - back, batch=inp.replay[-back], replay=inp.replay[:-back],
                                         ahead=False, behind=0)
            res = self._train_step(before, heartbeat, None, scheduled_at, last=False)
            first = first or res
            # the restore is reported once, by the step that asked for it (train_step); the kept result says none
            self._ahead[(inp.run_id, before.step)] = (_group_ids(before.batch), dataclasses.replace(
                res, restored=False, steps_redone=0, corrupt_checkpoints=[]))
        assert first is not None  # inp.replay is not empty (train_step's condition)
        return first

    def _taken_ahead(self, inp: TrainStepInput) -> TrainStepResult | None:
        """The result of this very step (same run, step and batch) if _catch_up took it already, on the policy
        in memory now; None otherwise."""
        kept = self._ahead.pop((inp.run_id, inp.step), None)
        if kept is None or kept[0] != _group_ids(inp.batch) or self.run_id != inp.run_id or self.step <= inp.step:
            return None
        log.info("train_step_taken_ahead", run_id=inp.run_id, step=inp.step + 1)
        return kept[1]

    def deadline_checkpoint(self) -> CheckpointRef | None:
        """On notice, with no step in flight: a checkpoint of the in-memory policy unless its step has one
        already (or nothing is loaded); the caller signals it to the workflow, which commits it when it is still
        at that step. Deletes nothing (the workflow's retained checkpoints are the next step's to prune). Waits
        for a step still running at most until the notice's deadline; None if it did not end by then, or if the
        store refused the checkpoint (an outage or a read-only store: the worker still leaves cleanly, exit 0)."""
        if not self._turns.acquire(timeout=min(self.notice.remaining_s(), 3600.0))[0]:
            return None
        try:
            if self.trainer is None or self.run_id is None or self.step <= max(0, self.checkpointed_step):
                return None
            try:
                ref = self._save_checkpoint()
            except StoreError as e:  # a store down or read-only: the successor replays from the last commit instead
                log.warning("deadline_checkpoint_not_written", run_id=self.run_id, step=self.step, error=str(e)[:300])
                return None
            log.info("deadline_checkpoint", run_id=self.run_id, step=self.step, in_step=False)
            return ref
        finally:
            self._turns.release()

    def _train_step(self, inp: TrainStepInput, heartbeat, schedule_to_start_s: float | None,
                    scheduled_at: float | None, last: bool,
                    rows: dict[str, list[Trajectory]] | None = None) -> TrainStepResult:
        t_start = time.time()
        wait_s = 0.0 if self.last_step_end is None else t_start - self.last_step_end
        prof = self.profile
        if schedule_to_start_s is not None:  # part of wait_groups
            prof.latency("train_step_schedule_to_start", schedule_to_start_s)
        redone, restored, corrupt = 0, False, []
        if self.run_id != inp.run_id or self.step != inp.step:
            with prof.measure("rewind"):
                (redone, corrupt), restored = self._rewind(inp, heartbeat), True
        assert self.trainer is not None and self.cfg is not None
        with prof.measure("read_segments"):
            trajectories, twice = self._read_batch(inp.batch, rows or {})
        if self.last_step_end is not None and trajectories:
            # The gap since the last step: until the batch's last trajectory ended, the trainer waited for
            # generation; after that, for the report, the workflow and the activity to reach it.
            for_data = min(wait_s, max(0.0, max(t.ended_at for t in trajectories) - self.last_step_end))
            prof.add("wait_groups", for_data)
            prof.add("wait_control_plane", wait_s - for_data)
        with prof.measure("compute"):
            m = self.trainer.step(trajectories, trainer_version=self._version())
        self.step += 1
        self.consumed.update(g for part in inp.batch for g in part.group_ids)
        try:  # the outputs: a failure leaves a policy the workflow has not got (_disown)
            heartbeat()
            with prof.measure("checkpoint"):
                ckpt = self._maybe_checkpoint(keep_from_step=_replay_base(inp), deadline=last and self.notice.given)
            stall_s = 0.0
            if publishes(self.policy, self.step):  # stream: the version is complete after a batch's last minibatch
                with prof.measure("publish"):
                    stall_s, _ = self._publish(inp.relay_chain)
            metrics = StepMetrics(
                reward_mean=m.reward_mean, loss=m.loss, grad_norm=m.grad_norm, samples=m.samples, tokens=m.tokens,
                response_len_mean=m.response_len_mean, staleness={str(k): v for k, v in m.staleness.items()},
                dropped_stale=m.dropped_stale, clip_fraction=m.clip_fraction, consumed_twice=twice,
                is_weight_mean=m.is_weight_mean, is_weight_max=m.is_weight_max,
                is_capped_fraction=m.is_capped_fraction, kl_behaviour=m.kl_behaviour,
            )
            busy_s = time.time() - t_start
            with prof.measure("write_metrics"):
                record = self._write_metrics(metrics, trajectories, wait_s=wait_s, busy_s=busy_s, stall_s=stall_s,
                                             scheduled_at=scheduled_at, entropy=m.entropy)
            with prof.measure("trackers"):
                self._track(record, restored=restored, redone=redone, corrupt=corrupt)
            prom.observe_train_step(self.step, self._version(), tokens=m.tokens, reward=m.reward_mean, loss=m.loss,
                                    clip_fraction=m.clip_fraction, staleness=metrics.staleness, consumed_twice=twice,
                                    wait_s=wait_s, busy_s=busy_s, stall_s=stall_s, published=publishes(self.policy, self.step))
            if self.step >= self.cfg.run.steps or prof.clock() - self._profile_written >= PROFILE_EVERY_S:
                self._write_profile()
            self.last_step_end = time.time()
            log.info("train_step_completed", step=self.step, reward=round(m.reward_mean, 4), tokens=m.tokens,
                     staleness=metrics.staleness, stall_s=round(stall_s, 4), checkpoint=ckpt is not None)
            return TrainStepResult(step=self.step, policy_version=self._version(), metrics=metrics, checkpoint=ckpt,
                                   steps_redone=redone, publish_stall_s=stall_s, restored=restored,
                                   corrupt_checkpoints=corrupt, **self._relay_checks(inp))
        except BaseException as e:
            self._disown(inp.run_id, self.step, e)
            raise

    def _disown(self, run_id: str, step: int, error: BaseException) -> None:
        """A step that trained but whose outputs failed (a checkpoint, its metrics record or the profile the store
        refused; a cancelled heartbeat): its activity fails and is retried, while the policy in memory already took
        its batch. Nothing may build on that: the step scheduled ahead would train on it, and the retry, finding the
        policy past its step, would rewind and redo it after, its record written again after the next step's (the
        tools chaos run's step 979). So the policy counts as not loaded: the retry rewinds, the step ahead waits its
        turn (StepOutOfTurnError, then the step before it first), and the steps keep their order."""
        self.step = -1
        self._ahead.clear()
        log.warning("train_step_outputs_failed", run_id=run_id, step=step, error=str(error)[:300])

    def _rewind(self, inp: TrainStepInput, heartbeat) -> tuple[int, list[int]]:
        """Restore the newest retained checkpoint that verifies and replay the batches consumed since it.

        Returns (steps replayed, steps of the committed checkpoints skipped because they failed verification).
        """
        cfg = RunConfig.from_json(inp.config)
        if (deadline := self._deadline_checkpoint_for(inp)) is not None:
            loaded, replay, corrupt = deadline, [], []
        elif inp.checkpoint is None:
            loaded, replay, corrupt = None, inp.replay, []
        else:
            loaded, replay, corrupt = self._newest_verified(inp)
        start = loaded.ref.step if loaded else 0
        if start + len(replay) != inp.step:
            raise InconsistentStateError(
                f"train_step for step {inp.step}: checkpoint at step {start} plus {len(replay)} replay "
                f"batches does not reach it; the workflow's recorded batches are inconsistent"
            )
        self._restore(inp.run_id, cfg, loaded)
        assert self.trainer is not None
        for batch in replay:
            trajectories, _ = self._read_batch(batch)
            self.trainer.step(trajectories, trainer_version=self._version())
            self.step += 1
            self.consumed.update(g for part in batch for g in part.group_ids)
            heartbeat()
        log.info("trainer_replayed", run_id=inp.run_id, from_step=start, to_step=self.step, steps=len(replay))
        return len(replay), corrupt

    def _deadline_checkpoint_for(self, inp: TrainStepInput) -> LoadedCheckpoint | None:
        """The deadline checkpoint a predecessor left on notice at exactly the step asked for, when the input
        names an older restore point: the workflow may have scheduled this step before the checkpoint's signal
        reached it (workers/processes.py). It is used only if it verifies and holds the committed history: its
        consumed set has every group of the batches the input would replay and none of this step's batch, so
        restoring it is what replaying those batches computes. None otherwise (then the input's restore point)."""
        if not inp.replay:
            return None
        ref = self.checkpoints.verified_at(inp.run_id, inp.step)
        if ref is None:
            return None
        try:
            loaded = self.checkpoints.load(ref)
        except CorruptDataError:
            return None
        consumed = set(loaded.meta.get("consumed", []))
        replayed = {g for batch in inp.replay for part in batch for g in part.group_ids}
        now = {g for part in inp.batch for g in part.group_ids}
        if int(loaded.meta.get("step", -1)) != inp.step or not replayed <= consumed or now & consumed:
            log.warning("deadline_checkpoint_unused", run_id=inp.run_id, step=inp.step)
            return None
        log.info("deadline_checkpoint_restored", run_id=inp.run_id, step=inp.step, replay_skipped=len(inp.replay))
        return loaded

    def _newest_verified(self, inp: TrainStepInput) -> tuple[LoadedCheckpoint | None, list[list[BatchPart]], list[int]]:
        """(checkpoint, batches from it to inp.step, corrupt checkpoint steps) for the newest restore point
        the workflow retains that verifies: `checkpoint`, then `fallbacks` newest first, then the base model
        when the workflow still holds every batch since step 0. CorruptDataError when none is left."""
        assert inp.checkpoint is not None
        base = _replay_base(inp)
        corrupt: list[tuple[int, str]] = []
        for ref in [inp.checkpoint, *reversed([f for f in inp.fallbacks if base <= f.step < inp.checkpoint.step])]:
            try:
                loaded = self.checkpoints.load(ref)
            except CorruptDataError as e:
                log.warning("checkpoint_corrupt", run_id=inp.run_id, step=ref.step, error=str(e))
                corrupt.append((ref.step, str(e)))
                continue
            replay = inp.fallback_replay[ref.step - base:] + inp.replay
            if corrupt:
                log.warning("checkpoint_fallback", run_id=inp.run_id, corrupt=[c for c, _ in corrupt], to_step=ref.step)
            return loaded, replay, [c for c, _ in corrupt]
        if base == 0:
            log.warning("checkpoint_fallback", run_id=inp.run_id, corrupt=[c for c, _ in corrupt], to_step=0)
            return None, inp.fallback_replay + inp.replay, [c for c, _ in corrupt]
        raise CorruptDataError(
            f"run {inp.run_id}: no committed checkpoint the workflow retains verifies "
            f"({'; '.join(why for _, why in corrupt)}), and the batches to rebuild from step 0 are no longer "
            f"kept, so training cannot resume at step {inp.step}. Restore the checkpoint objects from a backup, "
            f"or start a new run; trainer.keep_last >= 2 keeps an older checkpoint to fall back to")

    def _read_batch(self, batch: list[BatchPart],
                    rows_read: dict[str, list[Trajectory]] | None = None) -> tuple[list[Trajectory], int]:
        """The batch's trajectories (segments from rows_read when prefetched); groups already consumed are
        dropped and counted."""
        rows_read = rows_read or {}
        out: list[Trajectory] = []
        twice = 0
        for part in batch:
            wanted = set(part.group_ids)
            again = wanted & self.consumed
            if again:
                twice += len(again)
                log.error("groups_consumed_twice", groups=sorted(again), step=self.step)
            rows = rows_read.get(part.segment.key)
            if rows is None:
                rows = self.trajectories.read_segment(part.segment)
            out.extend(t for t in rows if t.group_id in wanted - again)
        return out, twice

    # -- outputs -------------------------------------------------------------------------------

    def _maybe_checkpoint(self, keep_from_step: int, deadline: bool = False) -> CheckpointRef | None:
        """Save a checkpoint every `checkpoint_every` steps, at the last step, and (deadline) after a notice;
        then delete the checkpoints older than `keep_from_step`, the oldest restore point the workflow still
        records."""
        assert self.cfg is not None and self.run_id is not None
        tc = self.cfg.trainer
        if self.step % tc.checkpoint_every != 0 and self.step != self.cfg.run.steps and not deadline:
            return None
        ref = self._save_checkpoint()
        if deadline:
            log.info("deadline_checkpoint", run_id=self.run_id, step=self.step, in_step=True)
        self.checkpoints.retain(self.run_id, keep_from_step)
        return ref

    def _save_checkpoint(self) -> CheckpointRef:
        assert self.trainer is not None and self.run_id is not None
        meta = {"step": self.step, "policy_version": self._version(), "consumed": sorted(self.consumed)}
        ref = self.checkpoints.save(self.run_id, self.step, self.trainer.state_parts(), meta,
                                    policy_version=self._version())
        self.checkpointed_step = self.step
        return ref

    def _publish(self, chain: list[str]) -> tuple[float, bytes]:
        """Push the current version to the first relay of the chain that accepts it (a dead master is
        skipped); returns (trainer stall seconds, payload)."""
        assert self.trainer is not None and self.run_id is not None
        payload = state_dict_to_bytes(self.trainer.policy_state_dict())
        self._published[self.run_id] = (self.step, self._version(), payload)
        self._published.move_to_end(self.run_id)
        while len(self._published) > PUBLISHED_RUNS_KEPT:
            self._published.popitem(last=False)
        stall = self._push(chain, self.run_id, self._version(), payload)
        return (0.0 if stall is None else stall + self.trainer.push_stall(self.policy.global_sync)), payload

    def _probe(self, addr: str) -> None:
        """A relay's data-plane check: a version poll (connect, handshake, one small reply)."""
        relay_client.latest_version(addr, token=self.relay_token)

    def _relay_checks(self, inp: TrainStepInput) -> dict[str, list[str]]:
        """What this process's breakers say of the input's relays: those of the chain or taken out that it cannot
        reach now, and those taken out whose check passed (each taken-out one is probed in the background, with
        backoff, so a healed relay passes within relay.breaker.MAX_BACKOFF_S)."""
        for addr in inp.relays_out:
            BREAKERS.check(addr, self._probe)
        return {"relays_failed": BREAKERS.failing([*inp.relay_chain, *inp.relays_out]),
                "relays_passed": [a for a in inp.relays_out if BREAKERS.passed(a)]}

    def _push(self, chain: list[str], run_id: str, version: int, payload: bytes) -> float | None:
        """Push one version of a run to the first relay of the chain that accepts it; the trainer's stall in
        seconds, None when no relay took it. A relay that fails is skipped at once for the next (one connect
        timeout, about a second); relays whose breaker is open are left out, of the push and of the chain it
        carries, unless every relay's is."""
        if not chain:
            log.warning("publish_skipped", reason="no relays joined", run_id=run_id, policy_version=version)
            return None
        usable = [a for a in chain if BREAKERS.usable(a, self._probe)]
        if len(usable) < len(chain):
            log.info("relays_skipped", run_id=run_id, skipped=[a for a in chain if a not in usable])
        usable = usable or list(chain)  # every relay failed lately: try them all rather than publish nothing
        t0 = time.perf_counter()
        for i, addr in enumerate(usable):  # a dead master is skipped: the next relay becomes master
            try:
                relay_client.push(addr, version, payload, usable[i + 1:], run=run_id, token=self.relay_token)
                stall = time.perf_counter() - t0  # the failed attempts before it included
                BREAKERS.success(addr)
                log.info("weights_published", run_id=run_id, policy_version=version, bytes=len(payload),
                         stall_s=round(stall, 4), address=addr)
                return stall
            except RelayError as e:
                BREAKERS.failure(addr)
                log.warning("relay_push_failed", address=addr, error=str(e))
        # Never fail the step for it: the chain in this input may be stale (a relay restarted on a new port,
        # and a retry would carry the same stale chain forever). Replicas keep generating on the version they
        # hold, and the next step publishes to the chain the workflow knows then.
        log.warning("publish_skipped", reason="no relay in the chain accepted", chain=chain, run_id=run_id,
                    policy_version=version)
        return None

    def _track(self, record: dict, *, restored: bool, redone: int, corrupt: list[int]) -> None:
        """The step's scalars (and a restore, as an event) to the run's trackers (services/tracking.py); a tracker
        that fails is counted in the next step's record (`tracker_skipped`), never raised."""
        assert self.trackers is not None and self.cfg is not None
        if not self.trackers.wanted:
            return
        self.trackers.log_step(self.step, step_scalars(record))  # first: it may mark a resume at this step
        if restored:
            self.trackers.log_event(self.step, "trainer_restored",
                                    f"trainer restored at step {self.step - 1 - redone} and replayed {redone} steps")
        if corrupt:
            self.trackers.log_event(self.step, "checkpoint_fallback", f"corrupt checkpoints at steps {corrupt}")
        if self.step >= self.cfg.run.steps:
            self.trackers.close(finished=True)

    def _write_metrics(self, m: StepMetrics, trajectories: list[Trajectory], **timing: float | None) -> dict:
        assert self.run_id is not None
        lengths = sorted(len(t.response_ids) for t in trajectories)
        record = {"step": self.step, **asdict(m), **timing, "response_lengths": lengths,
                  "policy_versions": sorted({t.policy_version for t in trajectories}), "time": time.time()}
        counts = [turn_counts(t.extra) for t in trajectories]  # multi-turn tool calls (envs/tools/__init__.py)
        record |= {"trajectories": len(trajectories), "tool_calls": sum(c[1] for c in counts),
                   "multi_turn": sum(1 for c in counts if c[0] >= 2),
                   "tool_latency_s": [round(x, 6) for c in counts for x in c[2]]}
        versions: dict[str, set[int]] = {}  # the groups this step trained on and their policy versions (chaos checker)
        for t in trajectories:
            versions.setdefault(t.group_id, set()).add(t.policy_version)
        record["groups"] = {g: sorted(v) for g, v in sorted(versions.items())}
        if self.trackers is not None:
            if self.trackers.skipped:
                record["tracker_skipped"] = dict(self.trackers.skipped)  # writes dropped so far, per tracker
            record["tracker_stats"] = self.trackers.stats()  # written, pending, outages, missing steps
        self.store.put(keys.step_metrics(self.run_id, self.step), json.dumps(record).encode())
        return record



    def _write_profile(self) -> None:
        assert self.run_id is not None
        self.store.put(keys.profile(self.run_id, f"trainer-{os.getpid()}"), json.dumps(self.profile.to_dict()).encode())
        self._profile_written = self.profile.clock()


def _group_ids(batch: list[BatchPart]) -> frozenset[str]:
    return frozenset(g for part in batch for g in part.group_ids)


def _replay_base(inp: TrainStepInput) -> int:
    """The oldest step the workflow can rebuild from: its oldest retained restore point (see TrainStepInput)."""
    return inp.checkpoint.step - len(inp.fallback_replay) if inp.checkpoint is not None else 0
