"""Passing a version down the relay chain, chunk by chunk, skipping dead relays, from one background thread.

The forwarder starts as soon as a put's header arrives: it sends chunk i downstream while chunk i+1 is
still arriving (it waits on the Version for each chunk), so hops overlap. It sends from the version's
shared-memory segment with sendfile(2), so the relay copies no byte through user space on the way out,
and it never holds up the receiving side: the upstream sender is acknowledged when the version is in
the segment, however far behind the forwarder is. If the next relay fails part
way (connection reset, timeout, refusal), the forwarder skips it and streams the version from chunk 0 to
the one after it, which gets the rest of the chain. If the version itself fails upstream, the downstream
connection is closed without an end frame and every relay below discards its partial copy.

Downstream connections use the process's relay timeouts (relay.client.TIMEOUTS: about 1 s to connect, a few
seconds idle), and the process's circuit breakers (relay.breaker.BREAKERS): a next relay that failed is skipped at
once for the one after it, and probed again in the background with backoff, so a relay whose port drops packets
costs the chain one connect timeout, not one per version. The forwarder's own timeout_s bounds only the wait for
the chunks still arriving from upstream.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from laminar import metrics as prom
from laminar.errors import RelayError
from laminar.logs import get_logger
from laminar.relay import client, protocol
from laminar.relay.breaker import BREAKERS
from laminar.relay.versions import UpstreamFailedError, Version

log = get_logger("relay")


@dataclass
class ForwardCounters:
    """Forwarding counters reported by `stats`; pending counts the queued and the in-flight version."""

    done: int = 0
    failed: int = 0
    superseded: int = 0
    aborted: int = 0  # the version failed upstream while being forwarded
    pending: int = 0
    in_flight: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class Forwarder:
    """One background thread that streams the newest pending version down its chain."""

    def __init__(self, relay_id: str, timeout_s: float, token: str | None = None) -> None:
        self._relay_id = relay_id
        self._timeout_s = timeout_s
        self._token = token
        self._cond = threading.Condition()
        self._pending: tuple[Version, list[str]] | None = None
        self._stopping = False
        self.counters = ForwardCounters()
        self._thread = threading.Thread(target=self._run, name=f"relay-{relay_id}-forwarder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def submit(self, version: Version, chain: list[str]) -> None:
        """Queue `version` for forwarding, replacing an older pending one."""
        if not chain:
            return
        with self._cond:
            if self._pending is not None:
                old = self._pending[0].policy_version
                if old > version.policy_version:
                    return  # a newer version is already waiting; this one is stale
                with self.counters.lock:
                    self.counters.superseded += 1
                log.info("relay_forward_superseded", relay_id=self._relay_id, policy_version=old,
                         by_policy_version=version.policy_version)
            self._pending = (version, list(chain))
            with self.counters.lock:
                self.counters.pending = 1
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                version, chain = self._pending
                self._pending = None
                with self.counters.lock:
                    self.counters.pending = 0
                    self.counters.in_flight = True
            try:
                self._forward(version, chain)
            finally:
                with self.counters.lock:
                    self.counters.in_flight = False

    def _probe(self, addr: str) -> None:
        client.latest_version(addr, token=self._token)

    def _forward(self, version: Version, chain: list[str]) -> None:
        usable = [a for a in chain if BREAKERS.usable(a, self._probe)]
        if not usable:  # every next relay failed lately: try them all rather than drop the version
            usable = list(chain)
        for i, target in enumerate(usable):
            downstream = usable[i + 1:]
            start = time.perf_counter()
            try:
                self._stream(version, target, downstream)
            except UpstreamFailedError as exc:
                with self.counters.lock:
                    self.counters.aborted += 1
                log.warning("relay_forward_aborted", relay_id=self._relay_id, target=target,
                            policy_version=version.policy_version, error=str(exc))
                return
            except RelayError as exc:
                BREAKERS.failure(target)
                with self.counters.lock:
                    self.counters.failed += 1
                log.warning("relay_forward_failed", relay_id=self._relay_id, target=target,
                            policy_version=version.policy_version, error=str(exc),
                            next_target=downstream[0] if downstream else None)
                continue
            BREAKERS.success(target)
            with self.counters.lock:
                self.counters.done += 1
            prom.RELAY_FORWARDED.labels(self._relay_id).inc(version.size)
            log.info("relay_version_forwarded", relay_id=self._relay_id, target=target,
                     policy_version=version.policy_version, bytes=version.size, skipped=len(chain) - len(usable) + i,
                     spent_s=round(time.perf_counter() - start, 4))
            return
        log.error("relay_chain_exhausted", relay_id=self._relay_id, policy_version=version.policy_version,
                  chain=chain)

    def _stream(self, version: Version, target: str, downstream: list[str]) -> None:
        header = {"op": protocol.OP_PUT, "policy_version": version.policy_version, "run": version.run,
                  "chain": downstream, "size": version.size, "chunk_bytes": version.chunk_bytes,
                  "digest": version.digest}
        if not version.segment.acquire(version.generation):  # pinned: its segment is not reused meanwhile
            raise UpstreamFailedError(f"policy_version {version.policy_version} was dropped before it was forwarded")
        try:
            sock = client.open_connection(target, token=self._token)  # the network's timeouts (client.TIMEOUTS)
            try:
                client.send_version(sock, target, header, lambda i: version.wait_chunk(i, self._timeout_s),
                                    version.n_chunks, lambda: version.wait_complete(self._timeout_s),
                                    fd=version.segment.fd)
            finally:
                sock.close()
        finally:
            version.segment.release()
