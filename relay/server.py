"""A weight relay: holds the newest policy versions in CPU memory and passes each one down a chain.

One relay runs per rollout host. The trainer pushes a version to the master relay, which replies as
soon as it holds the version and then forwards it to chain[0] (with chain[1:] as that relay's own
downstream) from a background thread. A dead relay is skipped: if chain[0] cannot take the version,
chain[1] gets it with chain[2:], and so on. Rollouts pull the newest version from their local relay.

Threads: `start()` runs a ThreadingTCPServer in its own daemon thread (one more thread per open
connection) plus one forwarder thread, so it never blocks the caller and can live next to a Temporal
worker's asyncio loop. The forwarder coalesces: while it sends version n, a newer version replaces any
still-pending older one (counted as superseded), so a slow chain never queues stale weights.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from typing import Any

from laminar.errors import RelayError
from laminar.logs import get_logger
from relay import protocol
from relay.forwarder import Forwarder
from relay.versions import Version, VersionStore

log = get_logger("relay")


class _Handler(socketserver.BaseRequestHandler):
    """Serves request frames on one connection until the peer closes it."""

    server: _TCPServer

    def handle(self) -> None:
        relay = self.server.relay
        sock: socket.socket = self.request
        sock.settimeout(relay.io_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        relay._track(sock, add=True)
        try:
            while True:
                try:
                    frame = protocol.recv_frame(sock, allow_eof=True)
                except RelayError as exc:
                    log.warning("relay_frame_rejected", relay_id=relay.relay_id, peer=str(self.client_address),
                                error=str(exc))
                    self._reply_error(sock, str(exc))
                    return
                if frame is None:
                    return
                header, payload = frame
                reply, body = relay._dispatch(header, payload)
                try:
                    protocol.send_frame(sock, reply, body)
                except RelayError as exc:
                    log.warning("relay_reply_failed", relay_id=relay.relay_id, op=header.get("op"), error=str(exc))
                    return
        finally:
            relay._track(sock, add=False)

    @staticmethod
    def _reply_error(sock: socket.socket, error: str) -> None:
        try:
            protocol.send_frame(sock, {"ok": False, "error": error})
        except RelayError:
            pass


class _TCPServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    block_on_close = False
    relay: RelayServer


class RelayServer:
    """A relay holding the newest `keep_versions` policy versions in memory and forwarding new ones."""

    def __init__(
        self,
        relay_id: str,
        bind_host: str = "127.0.0.1",
        port: int = 0,
        keep_versions: int = 2,
        *,
        forward_timeout_s: float = 30.0,
        io_timeout_s: float = 60.0,
    ) -> None:
        if keep_versions < 1:
            raise ValueError(f"keep_versions={keep_versions} must be at least 1 (the newest version)")
        self.relay_id = relay_id
        self.bind_host = bind_host
        self.port = port
        self.keep_versions = keep_versions
        self.io_timeout_s = io_timeout_s
        self._store = VersionStore(keep_versions)
        self._run = ""  # the run whose versions this relay holds; a put for another run replaces them
        self._forwarder = Forwarder(relay_id, forward_timeout_s)
        self._server: _TCPServer | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self.addr: str | None = None

    def start(self) -> str:
        """Bind, serve in background threads and return the bound "host:port"."""
        if self._server is not None:
            raise RelayError(f"relay {self.relay_id} is already serving at {self.addr}")
        try:
            server = _TCPServer((self.bind_host, self.port), _Handler, bind_and_activate=True)
        except OSError as exc:
            raise RelayError(
                f"relay {self.relay_id} could not bind {self.bind_host}:{self.port} ({exc}); "
                "pick a free port or port=0 for any"
            ) from exc
        server.relay = self
        self._server = server
        host, port = server.server_address[:2]
        self.addr = f"{host}:{port}"
        self._forwarder.start()
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"relay-{self.relay_id}-server", daemon=True)
        self._thread.start()
        log.info("relay_started", relay_id=self.relay_id, addr=self.addr, keep_versions=self.keep_versions)
        return self.addr

    def stop(self) -> None:
        """Stop serving, close open connections and the forwarder; held versions are dropped."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._forwarder.stop()
        if self._thread is not None:
            self._thread.join(5.0)
        log.info("relay_stopped", relay_id=self.relay_id, addr=self.addr)

    def __enter__(self) -> RelayServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _track(self, sock: socket.socket, *, add: bool) -> None:
        with self._conns_lock:
            (self._conns.add if add else self._conns.discard)(sock)

    # Request handling: each op returns (reply header, reply payload); never raises on bad input.

    def _dispatch(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        op = header.get("op")
        handlers = {
            protocol.OP_PUT: self._op_put,
            protocol.OP_LATEST: self._op_latest,
            protocol.OP_GET: self._op_get,
            protocol.OP_VERSION: self._op_version,
            protocol.OP_STATS: self._op_stats,
        }
        handler = handlers.get(op)
        if handler is None:
            return _error(f"unknown op {op!r}; this relay serves {', '.join(protocol.OPS)}"), b""
        run = header.get("run", "")
        if op != protocol.OP_STATS and run != self._run:
            if op != protocol.OP_PUT:  # versions of another run are never served
                return _no_version(op, run, self._run), b""
            log.info("relay_run_switched", relay_id=self.relay_id, run=run, previous=self._run)
            self._store.clear()
            self._run = run
        try:
            return handler(header, payload)
        except RelayError as exc:
            return _error(str(exc)), b""

    def _op_put(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        version = _require_version(header)
        sha, chain = header.get("sha256"), header.get("chain", [])
        if not isinstance(sha, str) or len(sha) != 64:
            raise RelayError(f"put policy_version {version}: sha256={sha!r} is not a 64-character hex digest")
        if not isinstance(chain, list) or not all(isinstance(a, str) for a in chain):
            raise RelayError(f"put policy_version {version}: chain={chain!r} is not a list of host:port strings")
        got = protocol.sha256_hex(payload)
        if got != sha:
            log.warning("relay_put_rejected", relay_id=self.relay_id, policy_version=version,
                        reason="sha256_mismatch", bytes=len(payload))
            raise RelayError(
                f"put policy_version {version}: sha256 mismatch (expected {sha[:12]}.., got {got[:12]}.. over "
                f"{len(payload)} bytes); the payload was corrupted in transit, push it again"
            )
        entry = Version(version, sha, payload, self._run)
        outcome = self._store.put(entry)
        if outcome.error is not None:
            raise RelayError(outcome.error)
        if outcome.stored:
            log.info("relay_version_stored", relay_id=self.relay_id, policy_version=version, bytes=len(payload))
        else:
            log.info("relay_version_ignored", relay_id=self.relay_id, policy_version=version,
                     newest=outcome.newest, reason="duplicate" if outcome.forward else "stale")
        if outcome.forward:
            self._forwarder.submit(entry, chain)
        return {"ok": True, "stored": outcome.stored, "newest": outcome.newest}, b""

    def _op_latest(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        newest = self._store.newest()
        if newest is None:
            return {"ok": True, "policy_version": None, "sha256": None}, b""
        return {"ok": True, "policy_version": newest.policy_version, "sha256": newest.sha256}, newest.payload

    def _op_get(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        version = _require_version(header)
        held = self._store.get(version)
        if held is None:
            versions, _ = self._store.summary()
            raise RelayError(
                f"relay {self.relay_id} does not hold policy_version {version} (holds {versions}, keeps the "
                f"newest {self.keep_versions}); fetch the latest version instead"
            )
        return {"ok": True, "policy_version": held.policy_version, "sha256": held.sha256}, held.payload

    def _op_version(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        newest = self._store.newest()
        return {"ok": True, "policy_version": None if newest is None else newest.policy_version}, b""

    def _op_stats(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        versions, bytes_held = self._store.summary()
        c = self._forwarder.counters
        with c.lock:
            forwards = {"forwards_done": c.done, "forwards_failed": c.failed, "forwards_superseded": c.superseded,
                        "forwards_pending": c.pending + int(c.in_flight)}
        return {"ok": True, "relay_id": self.relay_id, "versions": versions, "bytes_held": bytes_held,
                **forwards}, b""


def _require_version(header: dict[str, Any]) -> int:
    version = header.get("policy_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise RelayError(f"op {header.get('op')!r}: policy_version={version!r} is not a non-negative integer")
    return version


def _no_version(op: str, run: str, held: str) -> dict[str, Any]:
    if op == protocol.OP_GET:
        return _error(f"relay holds versions of run {held!r}, not of run {run!r}")
    return {"ok": True, "policy_version": None, "sha256": None}


def _error(message: str) -> dict[str, Any]:
    return {"ok": False, "error": message}
