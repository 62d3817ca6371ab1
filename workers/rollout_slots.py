"""One rollout process's replica slots, shared by its two workers (workers/processes.py `rollout`): the one on the
shared rollout queue, which starts replicas, and the one on the process's own queue, which only adopts replicas
parked here at a continue-as-new (services/rollout/attach.py; docs/decisions/kept-replica-routing.md, "A kept replica's next activity
comes back to its process").

A parked replica keeps its engine, so it holds its slot while it waits: the shared worker polls for a new replica only
while the activities running on both workers plus the replicas parked here leave a slot free (`Slots.free`). An
adoption turns a parked replica into a running one, so the own-queue worker takes its tasks without waiting. Without
this, a process of one slot could start a second engine beside a parked one (it was closed for it, and its groups
generated again elsewhere), or run a fresh and an adopted replica at once.

Of the slots, `spare` are for a replica whose process died (workers/launcher.py `rollout_slots`): the shared worker
polls with a spare permit only after waiting SPARE_WAIT_S for it, so that the run's fresh replicas spread over the
processes first. Without it, the process that polled first took every replica it had slots for (the default run's
two replicas in one process of its two, sharing one interpreter: the trainer waited on the control plane 10.5-15.4 %
of its wall instead of 4.8-6.1 %; docs/decisions/replica-spread.md, "Fresh replicas spread over the rollout workers first").

`Slots` is the count, pure and clock-free (tests/test_handover_route.py); `SharedQueueSlots` and `OwnQueueSlots`
are its two views as Temporal's slot suppliers (temporalio.worker.CustomSlotSupplier), which the worker asks for a
permit before each poll and gives back when the task is done (or the poll ended without one).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from temporalio.worker import (
    CustomSlotSupplier,
    FixedSizeSlotSupplier,
    SlotMarkUsedContext,
    SlotPermit,
    SlotReleaseContext,
    SlotReserveContext,
    WorkerTuner,
)

POLL_S = 0.2  # a waiting poll looks again this often (a replica parked or adopted in an activity's thread)
EXPIRE_EVERY = 25  # ... and every this many looks (5 s) closes the parked replicas that expired (PARK_S is 300 s)
# a spare permit waits this long: longer than the gap between processes started together beginning to poll (0.02-0.25
# s measured on the default run). A spare's poll, once started, holds its permit until a task or the long poll's end,
# so a dead replica's retry (after its heartbeat timeout, 3 s by default) mostly finds it polling, at worst 2 s later
SPARE_WAIT_S = 2.0  # `laminar worker --spare`'s help shows it; docs/guides/deployment.md and drills.md say 2 s


class Slots:
    """`slots` replicas at once in this process: running on either worker, or parked here (`parked()`); the last
    `spare` of them are taken only by a caller that says `spare_ok`."""

    def __init__(self, slots: int, parked: Callable[[], int], spare: int = 0) -> None:
        if slots < 1:
            raise ValueError(f"slots={slots} must be at least 1")
        if not 0 <= spare < slots:
            raise ValueError(f"spare={spare} must be at least 0 and below slots={slots}")
        self.slots, self.parked, self.spare = slots, parked, spare
        self.shared = 0  # permits the shared-queue worker holds (a poll waiting for a task, or a running replica)
        self.own = 0  # permits the own-queue worker holds
        self.adopting = 0  # ... of which running a task (an adoption)
        self._lock = threading.Lock()

    def free(self) -> bool:
        """A slot is free for the shared-queue worker to poll with."""
        return self.shared + self.adopting + self.parked() < self.slots

    def take_shared(self, spare_ok: bool = False) -> bool:
        """A permit for the shared-queue worker: while a slot is free, and a spare one only when spare_ok."""
        with self._lock:
            used = self.shared + self.adopting + self.parked()
            if used >= (self.slots if spare_ok else self.slots - self.spare):
                return False
            self.shared += 1
            return True

    def give_shared(self) -> None:
        with self._lock:
            self.shared -= 1

    def take_own(self) -> bool:
        with self._lock:
            if self.own >= self.slots:  # no more adoptions at once than there are slots
                return False
            self.own += 1
            return True

    def used_own(self) -> None:
        with self._lock:
            self.adopting += 1

    def give_own(self, used: bool) -> None:
        with self._lock:
            self.own -= 1
            self.adopting -= 1 if used else 0


class _Permit(SlotPermit):
    def __init__(self) -> None:
        self.used = False


class SharedQueueSlots(CustomSlotSupplier):
    """The shared-queue worker's permits: only while `Slots.free`, a spare one after `spare_wait_s` of waiting.
    `waiting()` runs while a poll waits (the process closes the parked replicas that expired there, which frees their
    slots)."""

    def __init__(self, slots: Slots, waiting: Callable[[], None] = lambda: None,
                 spare_wait_s: float = SPARE_WAIT_S) -> None:
        self.slots, self.waiting, self.spare_wait_s = slots, waiting, spare_wait_s

    async def reserve_slot(self, ctx: SlotReserveContext) -> SlotPermit:
        loop = asyncio.get_running_loop()
        since, looks = loop.time(), 0
        while not self.slots.take_shared(spare_ok=loop.time() - since >= self.spare_wait_s):
            if looks % EXPIRE_EVERY == 0:
                await asyncio.to_thread(self.waiting)
            looks += 1
            await asyncio.sleep(POLL_S)
        return _Permit()

    def try_reserve_slot(self, ctx: SlotReserveContext) -> SlotPermit | None:
        return _Permit() if self.slots.take_shared() else None

    def mark_slot_used(self, ctx: SlotMarkUsedContext) -> None:
        pass

    def release_slot(self, ctx: SlotReleaseContext) -> None:
        self.slots.give_shared()


class OwnQueueSlots(CustomSlotSupplier):
    """The own-queue worker's permits: up to `slots` at once; a used one counts as a running replica."""

    def __init__(self, slots: Slots) -> None:
        self.slots = slots

    async def reserve_slot(self, ctx: SlotReserveContext) -> SlotPermit:
        while not self.slots.take_own():
            await asyncio.sleep(POLL_S)
        return _Permit()

    def try_reserve_slot(self, ctx: SlotReserveContext) -> SlotPermit | None:
        return _Permit() if self.slots.take_own() else None

    def mark_slot_used(self, ctx: SlotMarkUsedContext) -> None:
        if isinstance(ctx.permit, _Permit) and not ctx.permit.used:
            ctx.permit.used = True
            self.slots.used_own()

    def release_slot(self, ctx: SlotReleaseContext) -> None:
        self.slots.give_own(isinstance(ctx.permit, _Permit) and ctx.permit.used)


def tuner(activity_slots: CustomSlotSupplier) -> WorkerTuner:
    """A worker tuner with these activity permits (the rollout workers run no workflows, local activities or Nexus)."""
    one = FixedSizeSlotSupplier(1)
    return WorkerTuner.create_composite(workflow_supplier=one, activity_supplier=activity_slots,
                                        local_activity_supplier=one, nexus_supplier=one)
