"""Worker process entry points: one process per role (`laminar worker {control,trainer,rollout,relay}`).

- control: TrainingRunWorkflow (and the slot pool, workflows/pool.py) on `laminar-control` (workflow tasks only; never waits behind GPU work).
- trainer: `init_trainer` / `train_step` on `laminar-trainer`, three slots (the running step and the two scheduled
  behind it, which wait their turn in the service), model kept in memory.
- rollout: `run_rollout_replica` on the shared `laminar-rollout` queue and on the process's own
  (`laminar-rollout@<host>-<pid>-<random>`, where a replica it parked at a continue-as-new is started again), `slots`
  replicas at once on both, parked ones included (workers/rollout_slots.py).
- relay: a RelayServer (data plane) plus `run_relay` on `laminar-relay-<host_id>`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from datetime import timedelta

from temporalio.worker import Worker

from laminar import contract
from laminar.activities.evaluation import EvalActivities
from laminar.activities.heartbeat import HEARTBEAT_THROTTLE
from laminar.activities.relay import RelayActivities
from laminar.client.connect import connect, store_for
from laminar.client.settings import Settings
from laminar.contract import (
    CONTROL_QUEUE,
    CONTROL_UNCACHED_QUEUE,
    ROLLOUT_QUEUE,
    TRAINER_QUEUE,
    fault_queue,
    relay_queue,
    rollout_process_queue,
    workflow_id_for,
)
from laminar.drills.faults import FaultActivities
from laminar.drills.workflow import RecoveryDrillWorkflow
from laminar.logs import get_logger
from laminar.notice import NOTICE
from laminar.workflows.pool import SlotPoolWorkflow
from laminar.workflows.training_run import TrainingRunWorkflow

log = get_logger(__name__)


def _relay_timeouts(settings: Settings) -> None:
    """This process's relay connect and idle timeouts (laminar.relay.client.TIMEOUTS), from the settings."""
    from laminar.relay import client as relay_client

    relay_client.configure(settings.relay_connect_timeout_s, settings.relay_io_timeout_s)


def _on_notice(stop: asyncio.Event, notice_s: float, role: str, sig: int) -> None:
    """SIGTERM/SIGINT: the notice (laminar/notice.py). The worker stops polling at once and its running
    activities leave cleanly within notice_s (the Worker's graceful_shutdown_timeout); then it exits 0. A second
    signal does not wait: the process exits at once (what it has not written is recovered as after a crash)."""
    name = signal.Signals(sig).name
    if NOTICE.give(notice_s, name):
        log.warning("notice_received", role=role, signal=name, notice_s=notice_s)
        stop.set()
        return
    log.warning("second_signal_exit_now", role=role, signal=name)
    os._exit(1)


async def _serve(worker: Worker, role: str, process: str, allow_faults: bool, notice_s: float = 30.0,
                 extra: list[Worker] | None = None, **context) -> None:
    """Run until SIGTERM/SIGINT (a notice: _on_notice), then shut the worker down gracefully. With allow_faults
    the process also polls its own fault queue (recovery drills deliver faults to exactly this process)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_notice, stop, notice_s, role, sig)
    workers = [worker, *(extra or [])]
    if allow_faults:
        faults = FaultActivities(process)
        workers.append(Worker(worker.client, task_queue=fault_queue(process), activities=[faults.inject_fault]))
    log.info("worker_started", role=role, task_queue=worker.task_queue, process=process, pid=os.getpid(),
             faults=allow_faults, **context)
    async with AsyncExitStack() as stack:
        for w in workers:
            await stack.enter_async_context(w)
        await stop.wait()
    log.info("worker_stopped", role=role, notice=NOTICE.reason or None, **context)


def worker_interceptors(env: dict[str, str] | None = None) -> list:
    """`LAMINAR_WORKER_INTERCEPTORS`: comma-separated `package.module:Class` Temporal interceptors the control
    worker adds (tracing, or a test's fault injection); ConfigError naming the one that does not load."""
    import importlib

    from laminar.errors import ConfigError

    text = (os.environ if env is None else env).get("LAMINAR_WORKER_INTERCEPTORS", "")
    out = []
    for spec in (s.strip() for s in text.split(",") if s.strip()):
        module, _, name = spec.partition(":")
        try:
            out.append(getattr(importlib.import_module(module), name)())
        except Exception as e:
            raise ConfigError(f"LAMINAR_WORKER_INTERCEPTORS={text!r}: {spec!r} does not load ({e}); give "
                              "package.module:Class of a temporalio.worker.Interceptor importable here") from None
    return out


async def control(settings: Settings, allow_faults: bool = False) -> None:
    from laminar.metrics import CONTROL_WORKFLOW_RESETS
    from laminar.services.repair import Repairer

    client = await connect(settings)
    interceptors = worker_interceptors()
    # runs: cached (a run's history is up to a segment of ~1,500 updates; replaying it for every task would cost more
    # than the task). The pool and drills, at a few tasks a minute, replay from scratch instead (max_cached_workflows=0):
    # no cached instance, no window (laminar.contract.WORKFLOW_TASK). They stay registered here too, for those
    # started on this queue before the split.
    # record_eval: a closed eval round's record (activities/evaluation.py), one store write; async, no torch
    worker = Worker(client, task_queue=CONTROL_QUEUE,
                    workflows=[TrainingRunWorkflow, RecoveryDrillWorkflow, SlotPoolWorkflow],
                    activities=[EvalActivities(store_for(settings), settings.home).record_eval], interceptors=interceptors)
    uncached = Worker(client, task_queue=CONTROL_UNCACHED_QUEUE, workflows=[RecoveryDrillWorkflow, SlotPoolWorkflow],
                      max_cached_workflows=0, interceptors=interceptors)
    # the repairer lives as long as the control worker: it resets runs whose workflow is wedged (services/repair.py)
    repairer = Repairer(client, [TrainingRunWorkflow], store=store_for(settings),
                        on_reset=lambda r: CONTROL_WORKFLOW_RESETS.labels(run=r.run_id).inc())
    sweeps = asyncio.create_task(repairer.forever(_repair_sweep_s()))
    try:
        await _serve(worker, "control", "control", allow_faults, settings.notice_s, extra=[uncached])
    finally:
        sweeps.cancel()


def _repair_sweep_s() -> float:
    """`LAMINAR_REPAIR_SWEEP_S`: seconds between the repairer's sweeps (default laminar.services.repair.SWEEP_S)."""
    from laminar.errors import ConfigError
    from laminar.services.repair import SWEEP_S

    text = os.environ.get("LAMINAR_REPAIR_SWEEP_S", "").strip()
    if not text:
        return SWEEP_S
    try:
        value = float(text)
        if not 0.1 <= value <= 3600:
            raise ValueError
    except ValueError:
        raise ConfigError(f"LAMINAR_REPAIR_SWEEP_S={text!r}: give seconds between 0.1 and 3600 (default "
                          f"{SWEEP_S:g})") from None
    return value


TRAINER_SLOTS = 3  # the running step and the two scheduled behind it (workflows/trainer.py TRAIN_AHEAD = 2)


async def trainer(settings: Settings, allow_faults: bool = False) -> None:
    import torch  # only the roles that compute import torch (a control or relay process starts in ~1 s)

    from laminar.activities.trainer import TrainerActivities
    from laminar.services.trainer import TrainerService

    torch.set_num_threads(1)
    _relay_timeouts(settings)
    client = await connect(settings)
    acts = TrainerActivities(TrainerService(store_for(settings), settings.home, relay_token=settings.relay_token))
    worker = Worker(
        client,
        task_queue=TRAINER_QUEUE,
        activities=[acts.init_trainer, acts.train_step, acts.train_steps, acts.republish],
        # Three slots: the steps the workflow schedules ahead (workflows/trainer.py) start while the one before them
        # computes, read their segments, and wait their turn in TrainerService (in step order, services/turns.py);
        # one thread more for heartbeats.
        activity_executor=ThreadPoolExecutor(max_workers=TRAINER_SLOTS + 1),
        max_concurrent_activities=TRAINER_SLOTS,
        max_heartbeat_throttle_interval=HEARTBEAT_THROTTLE,
        graceful_shutdown_timeout=timedelta(seconds=settings.notice_s),
    )
    await _serve(worker, "trainer", "trainer", allow_faults, settings.notice_s, host_id=settings.host_id)
    if NOTICE.given:
        await _leave_trainer(client, acts.service)


async def _leave_trainer(client, service) -> None:
    """The trainer on notice, its worker stopped: a step that was running wrote its deadline checkpoint and
    its result carried it. Otherwise the policy may be steps past its last checkpoint: write one now and signal
    it to the run's workflow, which commits it while it is still at that step (services/trainer.py)."""
    ref = await asyncio.to_thread(service.deadline_checkpoint)
    if ref is None or service.run_id is None:
        return
    try:
        # bounded: with the Temporal server gone the client would retry past the notice
        await asyncio.wait_for(
            client.get_workflow_handle(workflow_id_for(service.run_id)).signal(contract.TRAINER_CHECKPOINTED, ref),
            timeout=max(1.0, min(10.0, NOTICE.remaining_s())))
        log.info("deadline_checkpoint_signalled", run_id=service.run_id, step=ref.step)
    except Exception as e:  # the run ended meanwhile: nothing to commit it to, the successor replays instead
        log.warning("deadline_checkpoint_not_signalled", run_id=service.run_id, step=ref.step, error=str(e))


async def rollout(settings: Settings, allow_faults: bool = False, slots: int = 1, spare: int = 0) -> None:
    import torch

    from laminar.activities.rollout import RolloutActivities
    from laminar.services.rollout.attach import PARKING
    from laminar.workers.rollout_slots import OwnQueueSlots, SharedQueueSlots, Slots, tuner

    torch.set_num_threads(1)
    _relay_timeouts(settings)
    client = await connect(settings)
    # this process's own queue: a replica parked here at a continue-as-new is started here again (services/rollout/
    # attach.py); the pid and a random part make it this process's alone, a restarted one polls another
    own_queue = rollout_process_queue(f"{settings.host_id}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    acts = RolloutActivities(client, asyncio.get_running_loop(), store_for(settings), settings.host_id,
                             relay_token=settings.relay_token, own_queue=own_queue)
    # `slots` replicas at once across both workers, parked ones included; `spare` of them polled for late
    # (workers/rollout_slots.py)
    count = Slots(slots, parked=lambda: len(PARKING), spare=spare)
    executor = ThreadPoolExecutor(max_workers=2 * slots + 1)
    common = dict(activities=[acts.run_rollout_replica], activity_executor=executor,
                  max_heartbeat_throttle_interval=HEARTBEAT_THROTTLE,
                  graceful_shutdown_timeout=timedelta(seconds=settings.notice_s))
    worker = Worker(client, task_queue=ROLLOUT_QUEUE,
                    tuner=tuner(SharedQueueSlots(count, waiting=acts.close_expired)), **common)
    own = Worker(client, task_queue=own_queue, tuner=tuner(OwnQueueSlots(count)), **common)
    await _serve(worker, "rollout", f"rollout-{settings.host_id}", allow_faults, settings.notice_s, extra=[own],
                 host_id=settings.host_id, slots=slots, spare=spare, own_queue=own_queue)


async def relay(settings: Settings, allow_faults: bool = False) -> None:
    from laminar.relay.server import RETAIN_S, RelayServer

    _relay_timeouts(settings)
    server = RelayServer(settings.host_id, bind_host=settings.relay_bind, token=settings.relay_token,
                         retain_s=RETAIN_S, insecure=settings.insecure)
    address = server.start()
    try:
        client = await connect(settings)
        acts = RelayActivities(settings.host_id, settings.host_id, address, busy=server.busy)
        worker = Worker(client, task_queue=relay_queue(settings.host_id), activities=[acts.run_relay],
                        max_heartbeat_throttle_interval=HEARTBEAT_THROTTLE,
                        graceful_shutdown_timeout=timedelta(seconds=settings.notice_s))
        await _serve(worker, "relay", f"relay-{settings.host_id}", allow_faults, settings.notice_s,
                     host_id=settings.host_id, address=address)
    finally:
        server.stop()


ROLES = {"control": control, "trainer": trainer, "rollout": rollout, "relay": relay}
