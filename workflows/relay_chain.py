"""Relay-chain supervision: which relays the run has, which of them joined, and the chain the trainer pushes to.

Deterministic like workflows/ledger.py: it changes `RunState` (relays, relay_ids) and its own per-segment fields, and
reaches Temporal only through what it is given, a `Runtime` (workflows/commands.py: time, timers, conditions, tasks)
and `run_relay(relay_id, generation)`, one relay activity; tests/test_relay_chain_supervision.py drives it with fakes.

- Every relay the run has (relay.relays of them, `host-<i>`, until a `laminar scale --relays`) gets a watcher
  that keeps one `run_relay` activity. Its heartbeat timeout is the relay's failure detector: a relay whose
  activity ends leaves the chain at once (a new master is simply the next relay), and the watcher starts a new
  attempt after 1 s, or 2, 4, 8 ... s while attempts keep ending fast; that attempt waits on the relay's queue
  until its worker is back. The relay joins again by signal (`joined`).
- A relay on notice leaves at once (`leaving`); a new incarnation (same id, new address) replaces the old one.
- A continued segment keeps the chain it inherited (relay servers outlive the activities that watch them); an
  inherited relay that does not re-join within RELAY_REJOIN_HEARTBEATS heartbeat timeouts leaves it.
- The chain is the joined relays, by relay id, less those out for failing the trainer's data-plane checks
  (workflows/relay_health.py).
- A change that may have cost the chain a version (a relay lost or new, or back from a failed check) sets
  `republish_wanted`: the workflow has the trainer push its current version again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from temporalio.exceptions import ActivityError

from laminar.config import RunConfig
from laminar.contract import RelayInfo, TrainStepResult
from laminar.workflows import timeouts
from laminar.workflows.commands import Runtime
from laminar.workflows.ledger import Ledger
from laminar.workflows.relay_health import RelayHealth
from laminar.workflows.scale import plan_relays, relay_ids, replica_index
from laminar.workflows.state import RunState


class RelayChain:
    def __init__(self, state: RunState, ledger: Ledger, cfg: RunConfig | None, rt: Runtime,
                 run_relay: Callable[[str, int], Awaitable[Any]], closing: Callable[[], bool]) -> None:
        self.state, self.ledger, self.cfg, self.rt = state, ledger, cfg, rt
        self.run_relay = run_relay
        self.closing = closing  # the segment drains (continue-as-new or finish): watchers stop
        self.tasks: dict[str, asyncio.Task[Any]] = {}  # relay id (or "<id>/rejoin") -> its watcher
        self.rejoined: set[str] = set()  # relays that joined in this segment
        self.health = RelayHealth()  # relays out of the chain for failing data-plane checks (this segment)
        self.republish_wanted = False  # the chain changed: the trainer pushes the current version again

    # -- which relays -------------------------------------------------------------------------

    def ids(self) -> list[str]:
        """The relays the run should have: relay.relays of them until a `laminar scale --relays`."""
        assert self.cfg is not None
        return list(self.state.relay_ids) or relay_ids(self.cfg.relay.relays)

    def joined(self) -> list[str]:
        """The addresses of the relays that joined, by relay id."""
        return [r.address for _, r in sorted(self.state.relays.items())]

    def chain(self) -> list[str]:
        """The relays that joined, by relay id, less those out for failing data-plane checks (relay_health)."""
        return self.health.chain(self.joined())

    def members(self) -> list[RelayInfo]:
        """The chain's relays, as a replica is told them."""
        return [r for _, r in sorted(self.state.relays.items()) if r.address in self.chain()]

    def relays_out(self) -> list[str]:
        """Joined relays out of the chain for failing checks (each trainer step probes them)."""
        return self.health.relays_out(self.joined())

    # -- supervision --------------------------------------------------------------------------

    def start(self) -> None:
        """A watcher for every relay; an inherited relay (from the previous segment) must also re-join in time."""
        for relay_id in self.ids():
            self.tasks[relay_id] = self.rt.spawn(self._watch(relay_id))
            if relay_id in self.state.relays:
                self.tasks[f"{relay_id}/rejoin"] = self.rt.spawn(self._expect_rejoin(relay_id))

    async def wait_for_relays(self) -> None:
        """A new run waits (bounded) for every relay before publishing version 0; a continued run needs only one (it
        normally inherits the whole chain), and the others rejoin the chain as they come (a dead relay never stalls
        training)."""
        want = len(self.ids()) if not self.state.trainer_ready else 1
        try:
            await self.rt.wait(lambda: len(self.state.relays) >= want, timeout=timeouts.RELAY_JOIN)
        except TimeoutError:
            self.rt.logger.warning("relays_missing", extra={"joined": sorted(self.state.relays), "wanted": want})
            await self.rt.wait(lambda: len(self.state.relays) >= 1)

    async def _watch(self, relay_id: str) -> None:
        """Keep one `run_relay` activity for the relay while the segment runs; back off while it keeps failing fast
        (history grows with failures, never spins)."""
        generation = failures = 0
        while not self.closing():
            generation += 1
            started = self.rt.now()
            try:
                await self.run_relay(relay_id, generation)
            except ActivityError:
                if self.closing():  # cancelled by the drain
                    return
            except asyncio.CancelledError:
                return
            self.lose(relay_id)
            failures = failures + 1 if self.rt.now() - started < timeouts.RELAY_FAILING_FAST_S else 0
            await self.rt.sleep(min(timeouts.RELAY_BACKOFF_MAX_S, 2**failures))

    async def _expect_rejoin(self, relay_id: str) -> None:
        """An inherited relay that does not re-join within two heartbeat timeouts is gone: it leaves the chain."""
        assert self.cfg is not None
        wait_s = timeouts.RELAY_REJOIN_HEARTBEATS * self.cfg.relay.heartbeat_timeout_s
        try:
            await self.rt.wait(lambda: relay_id in self.rejoined or self.closing(), timeout=timedelta(seconds=wait_s))
        except TimeoutError:
            self.lose(relay_id)

    def lose(self, relay_id: str, republish: bool = True) -> None:
        """The relay leaves the chain (its activity ended, a new incarnation replaced it, or it was removed)."""
        if (lost := self.state.relays.pop(relay_id, None)) is not None:
            self.health.forget(lost.address)
            # the master may have died mid-broadcast (a relay that leaves on notice first forwards what it holds)
            self.republish_wanted = self.republish_wanted or (republish and self.state.trainer_ready)
            self.ledger.note_event("relay_lost", relay_id, self.rt.now())
            self.rt.logger.warning("relay_lost", extra={"relay_id": relay_id})

    # -- what relays and the trainer tell the run ---------------------------------------------

    def joined_signal(self, info: RelayInfo) -> None:
        """A relay's worker joined (or, after a hand-over, re-joined) the chain."""
        if self.cfg is not None and info.relay_id not in self.ids():
            return  # `laminar scale --relays` removed it: a late join does not put it back in the chain
        known = self.state.relays.get(info.relay_id)
        if known is not None and known.address != info.address:
            # a new incarnation of the relay (its process restarted): the old one is gone
            self.lose(info.relay_id)
        if known is None or known.address != info.address:  # new to the chain (not a hand-over's rejoin)
            self.republish_wanted = self.state.trainer_ready
        self.state.relays[info.relay_id] = info
        self.rejoined.add(info.relay_id)
        self.ledger.note_event("relay_joined", info.relay_id, self.rt.now())

    def leaving(self, info: RelayInfo) -> bool:
        """A relay on notice leaves at once, with no republish (it forwards what it was sent before it stops). False:
        that incarnation had left already."""
        known = self.state.relays.get(info.relay_id)
        if known is None or known.address != info.address:
            return False
        self.lose(info.relay_id, republish=False)
        self.ledger.note_event("relay_leaving", info.relay_id, self.rt.now())
        return True

    def note_checks(self, results: list[TrainStepResult]) -> None:
        """The trainer's data-plane checks: a relay it could not reach leaves the chain even while it heartbeats; one
        that passes again comes back, and the trainer pushes the current version again so that it holds it. (Only
        trainers of this code report checks; a recorded history's results carry none.)"""
        joined = self.joined()
        for res in results:
            if not (res.relays_failed or res.relays_passed):
                continue
            taken, back = self.health.report(joined, res.relays_failed, res.relays_passed, self.rt.now())
            for address in taken:
                self.ledger.note_event("relay_out", address, self.rt.now())
                self.rt.logger.warning("relay_out", extra={"address": address, "reason": "failed data-plane check"})
            for address in back:
                self.ledger.note_event("relay_back", address, self.rt.now())
                self.rt.logger.info("relay_back", extra={"address": address})
                self.republish_wanted = self.state.trainer_ready

    def scale(self, target: int, start_watchers: bool) -> tuple[list[str], list[str]]:
        """`laminar scale --relays`: new hosts' relays are watched (each joins the chain when its relay worker polls),
        unless the segment is ending (the next one watches them); removed ones leave the chain at once (their
        watcher and activity are cancelled, the trainer republishes to the chain that remains). (started, removed)."""
        start, remove = plan_relays(self.ids(), target)
        at = self.rt.now()
        self.state.relay_ids = sorted([r for r in self.ids() if r not in remove] + start, key=replica_index)
        for relay_id in remove:
            for key in (relay_id, f"{relay_id}/rejoin"):
                task = self.tasks.pop(key, None)
                if task is not None and not task.done():
                    task.cancel()
            self.lose(relay_id)
            self.ledger.note_event("relay_removed", relay_id, at)
        if start_watchers:
            for relay_id in start:
                self.tasks[relay_id] = self.rt.spawn(self._watch(relay_id))
                self.ledger.note_event("relay_added", relay_id, at)
        return start, remove
