"""What a training run shows of itself: its phase, the `status` query's answer, its search attributes
(laminar/search.py), and the stall watchdog (laminar/watchdog.py) that notes what a stalled run waits for.

Deterministic: it reads the run's parts (RunState through the Ledger, the Trainer, the ReplicaSet, the RelayChain,
the SlotGrants) and reaches Temporal only through what it is given: a `Runtime` (workflows/commands.py), the
history's length, whether the run was started with the search attributes, the `search-attributes` patch and the
upsert; tests/test_status.py passes stand-ins.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from laminar import search, watchdog
from laminar.config import RunConfig
from laminar.contract import RunStatus
from laminar.workflows.commands import Runtime
from laminar.workflows.grants import SlotGrants
from laminar.workflows.ledger import Ledger
from laminar.workflows.relay_chain import RelayChain
from laminar.workflows.replica_set import ReplicaSet
from laminar.workflows.segment import Segment
from laminar.workflows.state import RunState
from laminar.workflows.trainer import Trainer

SEARCH_ATTRIBUTES_EVERY_S = 5.0  # step, version and reward are upserted at most this often (a phase change: at once)


class StatusBoard:
    def __init__(self, state: RunState, ledger: Ledger, cfg: RunConfig | None, rt: Runtime, segment: Segment,
                 trainer: Trainer, replicas: ReplicaSet, relays: RelayChain, grants: SlotGrants, *,
                 history_length: Callable[[], int], has_search_attributes: Callable[[], bool],
                 search_patched: Callable[[], bool], upsert: Callable[[list[Any]], None]) -> None:
        self.state, self.ledger, self.cfg, self.rt, self.segment = state, ledger, cfg, rt, segment
        self.trainer, self.replicas, self.relays, self.grants = trainer, replicas, relays, grants
        self.history_length = history_length
        self.has_search_attributes = has_search_attributes  # the run was started with them (laminar/search.py)
        self.search_patched = search_patched  # workflow.patched("search-attributes"), asked only to upsert
        self.upsert = upsert  # workflow.upsert_search_attributes
        self.search_upserted: tuple[str, float] = ("", 0.0)  # (phase, workflow time) of the last upsert
        self.watchdog_task: asyncio.Task[Any] | None = None  # the watchdog's timer loop (patch `watchdog`)

    def phase(self) -> str:
        if self.segment.error is not None:
            return "failed"
        if self.segment.finished:
            return "finished"
        if self.state.stopping or self.state.step >= (self.cfg.run.steps if self.cfg else 0):
            return "stopping"
        if self.state.paused:
            return "paused"
        return "running" if self.state.trainer_ready else "starting"

    def status(self) -> RunStatus:
        """The `status` query's answer: the ledger's counters, and what the run's parts run and are asked for."""
        st = self.ledger.status(
            phase=self.phase(),
            total_steps=self.cfg.run.steps if self.cfg else 0,
            history_events=self.history_length(),
            training=self.trainer.training,
            **self._watchdog_facts(),
        )
        if self.cfg is None:
            return st
        return dataclasses.replace(
            st, replicas_target=self.grants.ask() if self.state.pool else len(self.replicas.ids()),
            replicas_running=self.replicas.running(),
            scale_groups_returned=self.state.scale_groups_returned, relays_target=len(self.relays.ids()))

    def _watchdog_facts(self) -> dict[str, Any]:
        if self.cfg is None:
            return {}
        return {"stall_warn_s": self.cfg.run.stall_warn_s, "replicas_wanted": self.cfg.rollout.replicas,
                "has_batch": self.trainer.has_batch(), **self.grants.facts()}

    def upsert_search_attributes(self) -> None:
        """Keep the run's search attributes current: at once on a phase change, else at most every
        SEARCH_ATTRIBUTES_EVERY_S. Only for a run started with them (the starter sets them where the namespace has
        them registered; an unregistered one would fail the workflow task), behind a patch."""
        phase, now = self.phase(), self.rt.now()
        last_phase, last_at = self.search_upserted
        if (not self.has_search_attributes()
                or (phase == last_phase and now - last_at < SEARCH_ATTRIBUTES_EVERY_S)
                or not self.search_patched()):
            return
        self.search_upserted = (phase, now)
        reward = [search.REWARD.value_set(self.state.reward_recent[-1])] if self.state.reward_recent else []
        self.upsert([search.PHASE.value_set(phase), search.STEP.value_set(self.state.step),
                     search.POLICY_VERSION.value_set(self.state.policy_version), *reward])

    async def watchdog(self) -> None:
        """Look every run.stall_warn_s / 2 even while nothing reaches the workflow (every worker silent): a timer
        is the only thing that wakes a run that waits on processes that are gone or stopped."""
        assert self.cfg is not None
        while not self.segment.closing:
            try:
                await self.rt.sleep(self.cfg.run.stall_warn_s / 2)
            except asyncio.CancelledError:
                return
            self.watch()

    def watch(self) -> None:
        """The watchdog at a tick, in workflow time: a stall that starts appends one `stall` run event naming what
        the run waits for (a change of what it waits for is a new one). A batch that is there with no step in flight
        is not looked at: the main loop starts that step in this same workflow task (an update just completed the
        batch), so it is no wait."""
        if self.cfg is None or (self.trainer.has_batch() and not self.trainer.training):
            return
        d = watchdog.diagnose(watchdog.facts_of_status(self.status(), self.rt.now()))
        waits_for = d[0] if d is not None else ""
        if waits_for and waits_for != self.state.stall:
            self.ledger.note_event("stall", waits_for, self.rt.now())
            self.rt.logger.warning("stall", extra={"waits_for": waits_for, "reason": d[1] if d else ""})
        self.state.stall = waits_for
