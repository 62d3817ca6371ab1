"""Weight loading: which relay to ask (own host's first), when a newer version is there, and loading it
between batches or, in partial rollout, under in-flight sequences.

Every relay call goes through the process's circuit breakers (relay.breaker.BREAKERS, shared by every replica of
the worker): a relay that fails one poll or pull (connect or idle timeout of about a second, relay.client.TIMEOUTS)
is skipped at once, by this replica's next poll and by the other replicas, for the next relay in the order, and
probed again in the background with backoff until it passes."""

from __future__ import annotations

import time

from laminar import metrics as prom
from laminar.contract import Lease, RelayInfo
from laminar.errors import RelayError
from laminar.logs import get_logger
from laminar.policy import Policy, load_action, min_version
from laminar.relay import client as relay_client
from laminar.relay.breaker import BREAKERS
from laminar.relay.weights import state_dict_from_buffer
from laminar.rl.engine_api import Engine
from laminar.rl.model import bytes_to_state_dict
from laminar.services.rollout.batch import Counters
from laminar.services.rollout.timing import ReplicaTiming
from laminar.timing import TimeBreakdown

log = get_logger(__name__)


class Weights:
    def __init__(self, engine: Engine, policy: Policy, run_id: str, replica_id: str, host_id: str,
                 relay_token: str | None, counters: Counters, metrics: prom.ReplicaMetrics) -> None:
        self.engine, self.policy, self.counters, self.metrics = engine, policy, counters, metrics
        self.run_id, self.replica_id, self.host_id, self.relay_token = run_id, replica_id, host_id, relay_token
        self.relays: list[RelayInfo] = []
        self.newest_at_relay: int | None = None
        self.newest_known = -1  # the newest version the workflow announced (claims answer with it)
        self.hold_version = -1  # a migration to this replica is on its way: do not load past this version
        self.last_poll = 0.0
        self.none_held = False  # the last poll reached a relay and no relay held any version of this run

    def refresh(self, now: float, pending: list[Lease], timing: ReplicaTiming, profile: TimeBreakdown,
                awaited: int | None = None) -> None:
        """Poll the relay when due (often while waiting for a version: `waiting_for_version`, or, idle, for
        `awaited`, the version that wakes a starved replica's next claim), then load (or interrupt and load) what
        the run mode says."""
        fast = self.waiting_for_version(pending) or (
            awaited is not None and self.engine.in_flight() == 0
            and (self.newest_at_relay is None or self.newest_at_relay < awaited))
        if now - self.last_poll >= (timing.version_wait_poll_s if fast else timing.version_poll_s):
            with profile.measure("poll_relay"):
                self.poll()
            self.last_poll = now
        action = load_action(self.policy, self.engine.policy_version, self.newest_at_relay, self.engine.in_flight())
        if action == "load" and self.hold_version == self.engine.policy_version:
            action = None  # repack: the groups coming to this replica continue under this version
        if action:
            with profile.measure("load_weights" if action == "load" else "interrupt"):
                self.load_newest(interrupt=action == "interrupt")

    def relay_order(self) -> list[str]:
        """Own host's relay first, then the others (a rollout whose relay is gone pulls elsewhere); relays whose
        breaker is open are left out (and probed in the background when due), unless every relay's is."""
        local = self.local_relays()
        order = sorted(local) + [r.address for r in self.relays if r.address not in local]
        return [a for a in order if BREAKERS.usable(a, self._probe)] or order

    def _probe(self, addr: str) -> None:
        relay_client.latest_version(addr, token=self.relay_token)

    def local_relays(self) -> set[str]:
        return {r.address for r in self.relays if r.host_id == self.host_id}

    def poll(self) -> None:
        """Newest version at the first relay that holds one (own host first; an empty, just restarted
        relay serves nothing until it has caught up)."""
        reached = False
        for addr in self.relay_order():
            try:
                version = relay_client.latest_version(addr, run=self.run_id, token=self.relay_token)
            except RelayError as e:
                BREAKERS.failure(addr)
                log.warning("relay_poll_failed", replica_id=self.replica_id, address=addr, error=str(e))
                continue
            BREAKERS.success(addr)
            reached = True
            if version is not None:
                self.newest_at_relay, self.none_held = version, False
                return
        self.none_held = reached

    def version_missing(self) -> bool:
        """It needs a version (holds none, or the workflow announced a newer one) and no relay it reached holds
        any version of its run (evicted, or every relay restarted): the workflow has it published again."""
        current = self.engine.policy_version
        return self.none_held and (current is None or self.newest_known > current)

    def newer_available(self) -> bool:
        current = self.engine.policy_version
        return self.newest_at_relay is not None and (current is None or self.newest_at_relay > current)

    def waiting_for_version(self, pending: list[Lease]) -> bool:
        """Leases wait for a version this replica does not hold yet (a barrier mode's next batch), or an idle
        replica knows from the workflow of a version newer than its own: poll the relay often."""
        v = -1 if self.engine.policy_version is None else self.engine.policy_version
        return (self.engine.in_flight() == 0 and self.newest_known > v) or any(
            min_version(self.policy, lease.prompt_id) > v for lease in pending)

    def fetch(self, version: int) -> bytes | None:
        """One given version, over TCP from the first relay that still holds it."""
        for addr in self.relay_order():
            try:
                got = relay_client.fetch_version(addr, version, run=self.run_id, token=self.relay_token)
            except RelayError as e:
                if not str(e).startswith(f"relay {addr} refused"):  # not held there is no failure of the relay
                    BREAKERS.failure(addr)
                continue
            if got is not None:
                return got
        return None

    def load_version(self, version: int) -> bool:
        """Load one given (older) version to continue groups that started on it; False when no relay holds it."""
        payload = self.fetch(version)
        if payload is None:
            return False
        self.load(version, payload)
        return True

    def load_newest(self, interrupt: bool = False) -> None:
        """Own host's relay: map the version from its shared memory (no copy through a socket); any other
        relay (own one gone): fetch it over TCP. interrupt (partial rollout): in-flight trajectories stop,
        the version loads, and they continue under it (their prefixes are prefilled again, counted)."""
        for addr in self.relay_order():
            try:
                if addr in self.local_relays():
                    # None: this host's relay holds no version (restarted empty): fetch from the next one
                    pulled = relay_client.pull_local(addr, run=self.run_id, token=self.relay_token)
                    if pulled is not None:
                        with pulled:
                            self._load(pulled.policy_version, state_dict_from_buffer(pulled.buffer),
                                       pulled.buffer.nbytes, "shared_memory", interrupt)
                            return
                version, payload = relay_client.fetch_latest(addr, run=self.run_id, token=self.relay_token)
            except RelayError as e:
                if not str(e).startswith(f"relay {addr} refused"):
                    BREAKERS.failure(addr)
                log.warning("relay_pull_failed", replica_id=self.replica_id, address=addr, error=str(e))
                continue
            if version is not None and payload is not None:
                self.load(version, payload, interrupt)
                return

    def load(self, version: int, payload: bytes, interrupt: bool = False) -> None:
        self._load(version, bytes_to_state_dict(payload), len(payload), "tcp", interrupt)

    def _load(self, version: int, tensors: dict, size: int, via: str, interrupt: bool) -> None:
        t0 = time.perf_counter()
        self.engine.note_pull(local=via == "shared_memory")
        if interrupt and self.engine.in_flight():
            tokens = self.engine.interrupt_and_load(tensors, version)
            self.counters.reprefilled(tokens)
            log.info("policy_loaded_interrupting", replica_id=self.replica_id, policy_version=version,
                     in_flight=self.engine.in_flight(), reprefill_tokens=tokens)
        else:
            self.engine.load_weights(tensors, version)
        self.metrics.loaded(via, time.perf_counter() - t0)
        log.info("policy_loaded", replica_id=self.replica_id, policy_version=version, bytes=size, via=via,
                 load_s=round(time.perf_counter() - t0, 3))
