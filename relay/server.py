"""A weight relay: holds the newest policy versions in shared memory and streams each one down a chain.

One relay runs per rollout host. The trainer streams a version to the master relay in chunks, which
land straight in the version's shared-memory segment; the master forwards each chunk to chain[0] (with
chain[1:] as that relay's own downstream) from the segment, behind the upload and at the chain's pace,
and replies to the trainer as soon as the whole version is in its segment and checked, so the
trainer's stall is the upload to the master alone, whatever the chain does. A dead relay is skipped: if chain[0]
cannot take the version, chain[1] gets it with chain[2:], and so on. Rollouts on the relay's host map
the newest version from shared memory (relay.segments); others fetch it over TCP.

Threads: `start()` runs a ThreadingTCPServer in its own daemon thread (one more thread per open
connection) plus one forwarder thread, so it never blocks the caller and can live next to a Temporal
worker's asyncio loop. The forwarder coalesces: while it sends version n, a newer version replaces any
still-pending older one (counted as superseded), so a slow chain never queues stale weights.
"""

from __future__ import annotations

import os
import socket
import socketserver
import threading
import time
from typing import Any

from laminar import metrics as prom
from laminar.errors import RelayError
from laminar.listeners import check_bind
from laminar.logs import get_logger
from laminar.relay import auth, protocol, segments
from laminar.relay.forwarder import Forwarder
from laminar.relay.versions import Version, VersionStore

log = get_logger("relay")

IDLE_EVICT_S = 600.0  # a run nobody asked about for this long has finished (its replicas poll every 0.5 s)
DRAIN_AFTER_REJECT_S = 2.0  # after rejecting a put, read what the sender still streams for this long


def _drain(sock: socket.socket, seconds: float) -> None:
    """Read and drop until EOF or `seconds` pass, so the sender can read our error before we close."""
    deadline = time.monotonic() + seconds
    sink = bytearray(1 << 20)
    try:
        sock.shutdown(socket.SHUT_WR)
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if sock.recv_into(sink) == 0:
                return
    except OSError:
        return


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
            try:
                auth.serve_handshake(sock, relay.relay_id, relay.token)
            except RelayError as exc:
                log.warning("relay_connection_refused", relay_id=relay.relay_id, peer=str(self.client_address),
                            error=str(exc))
                return
            while self._serve_one(relay, sock):
                pass
        finally:
            relay._track(sock, add=False)

    def _serve_one(self, relay: RelayServer, sock: socket.socket) -> bool:
        """Serve one request; False when the connection is done (closed, or a put was rejected)."""
        try:
            header = protocol.recv_header(sock, allow_eof=True)
            if header is None:
                return False
            if "proto" not in header:  # every request names its version (relay/client.py): nothing older is served
                raise RelayError(f"the request names no relay protocol version and this relay speaks "
                                 f"{protocol.PROTOCOL_VERSION}; send \"proto\": {protocol.PROTOCOL_VERSION} in "
                                 "every request header (relay/client.py does), or run the same laminar version "
                                 "on the trainer, the relays and the rollout hosts")
            if header["proto"] != protocol.PROTOCOL_VERSION:
                raise RelayError(f"the client speaks relay protocol {header.get('proto')!r} and this relay "
                                 f"{protocol.PROTOCOL_VERSION}; run the same laminar version on the trainer, the "
                                 "relays and the rollout hosts")
            body: bytes | memoryview | Version = b""
            if header.get("op") == protocol.OP_PUT:
                reply = relay._receive_put(sock, header)
                if not reply.get("ok"):  # the sender may still be streaming: answer, then stop reading
                    self._reply_error(sock, reply["error"])
                    _drain(sock, DRAIN_AFTER_REJECT_S)
                    return False
            else:
                reply, body = relay._dispatch(header, protocol.recv_payload(sock, header))
        except RelayError as exc:
            log.warning("relay_frame_rejected", relay_id=relay.relay_id, peer=str(self.client_address),
                        error=str(exc))
            self._reply_error(sock, str(exc))
            return False
        try:
            if isinstance(body, Version):  # a held version's bytes: sendfile from its segment, no copy
                if not body.segment.acquire(body.generation):
                    self._reply_error(sock, f"policy_version {body.policy_version} was evicted while being "
                                            "sent; ask again")
                    return True
                try:
                    if protocol.session_of(sock) is not None:  # the tags checked on receipt (protocol.Session)
                        reply = {**reply, "tags": _tags_of(body, sock), "tag_bytes": body.chunk_bytes}
                    protocol.send_frame_from_file(sock, reply, body.segment.fd, 0, body.size)
                finally:
                    body.segment.release()
            else:
                protocol.send_frame(sock, reply, body)
        except RelayError as exc:
            log.warning("relay_reply_failed", relay_id=relay.relay_id, op=header.get("op"), error=str(exc))
            return False
        return True

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


# What relay workers retain older versions for (relay.versions.VersionStore retain_s): a replica that resumes
# groups started on a version (a departed replica's, a restarted one's pool) restarts within this, even when a fast
# run publishes a version every few hundred milliseconds.
RETAIN_S = 60.0


class RelayServer:
    """A relay holding the newest `keep_versions` policy versions in shared memory and forwarding new ones.

    token: the run token clients (and upstream relays) must prove (relay.auth); None disables auth, and then
    `start()` refuses a bind_host off loopback (laminar.listeners) unless insecure accepts the risk (logged).
    shm_dir: where version segments live (relay.segments); readers on this host map them from there.
    spare_segments: dropped versions' segments kept to receive new versions into (segments.SparePool),
    so a new version takes no page faults; 0 unlinks every dropped segment at once.
    retain_s: older versions stay this long after they were stored, within max_bytes (VersionStore; workers use
    RETAIN_S). max_bytes: bound on the version bytes held across all runs (relay.versions.VersionStore); None is half
    the size of the file system under shm_dir, 0 no bound. idle_evict_s: a run with no get, put or poll
    for this long has finished as far as the relay knows; its versions are dropped (0: never).
    """

    def __init__(
        self,
        relay_id: str,
        bind_host: str = "127.0.0.1",
        port: int = 0,
        keep_versions: int = 2,
        *,
        forward_timeout_s: float = 30.0,
        io_timeout_s: float = 60.0,
        token: str | None = None,
        shm_dir: str = segments.DEFAULT_SHM_DIR,
        spare_segments: int = 2,
        max_bytes: int | None = None,
        idle_evict_s: float = IDLE_EVICT_S,
        retain_s: float = 0.0,
        insecure: bool = False,
    ) -> None:
        if keep_versions < 1:
            raise ValueError(f"keep_versions={keep_versions} must be at least 1 (the newest version)")
        if token is not None and not token:
            raise ValueError("token must be a non-empty string, or None to disable authentication")
        self.relay_id = relay_id
        self.bind_host = bind_host
        self.port = port
        self.keep_versions = keep_versions
        self.io_timeout_s = io_timeout_s
        self.token = token
        self.insecure = insecure
        self.shm_dir = shm_dir
        self._spares = segments.SparePool(shm_dir, limit=spare_segments)
        if max_bytes is None:
            max_bytes = _half_of(shm_dir)
        self.max_bytes = max_bytes
        self.idle_evict_s = idle_evict_s
        self._store = VersionStore(keep_versions, retire=self._spares.retire, max_bytes=max_bytes,
                                   idle_evict_s=idle_evict_s, retain_s=retain_s)
        self._receiving: set[Version] = set()
        self._receiving_lock = threading.Lock()
        self._puts_rejected = 0
        self._forwarder = Forwarder(relay_id, forward_timeout_s, token)
        self._server: _TCPServer | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self.addr: str | None = None

    def start(self) -> str:
        """Bind, serve in background threads and return the bound "host:port"."""
        if self._server is not None:
            raise RelayError(f"relay {self.relay_id} is already serving at {self.addr}")
        check_bind(f"relay {self.relay_id}", self.bind_host, secret=self.token, variable="LAMINAR_RELAY_TOKEN",
                   insecure=self.insecure, risk=auth.RELAY_RISK)
        try:
            server = _TCPServer((self.bind_host, self.port), _Handler, bind_and_activate=True)
        except OSError as exc:
            raise RelayError(
                f"relay {self.relay_id} could not bind {self.bind_host}:{self.port} ({exc}); "
                "pick a free port or port=0 for any"
            ) from exc
        server.relay = self
        self._server = server
        orphans = segments.sweep_orphans(self.shm_dir)
        if orphans:
            log.info("relay_orphan_segments_removed", relay_id=self.relay_id, count=len(orphans))
        host, port = server.server_address[:2]
        self.addr = f"{host}:{port}"
        self._forwarder.start()
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"relay-{self.relay_id}-server", daemon=True)
        self._thread.start()
        log.info("relay_started", relay_id=self.relay_id, addr=self.addr, keep_versions=self.keep_versions,
                 auth=self.token is not None)
        return self.addr

    def stop(self) -> None:
        """Stop serving, close open connections and the forwarder; held versions are unlinked."""
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
        with self._receiving_lock:
            for version in self._receiving:
                version.fail("relay stopped")
                version.segment.unlink()
        self._store.clear()
        self._spares.clear()
        log.info("relay_stopped", relay_id=self.relay_id, addr=self.addr)

    def busy(self) -> bool:
        """A put is arriving, a version is being forwarded or waits to be, or a request is being served: a relay
        leaving on notice (activities/relay.py) keeps serving until this is False."""
        with self._forwarder.counters.lock:
            forwarding = self._forwarder.counters.in_flight or self._forwarder.counters.pending > 0
        with self._receiving_lock, self._conns_lock:
            return forwarding or bool(self._receiving) or bool(self._conns)

    def __enter__(self) -> RelayServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _track(self, sock: socket.socket, *, add: bool) -> None:
        with self._conns_lock:
            (self._conns.add if add else self._conns.discard)(sock)

    # Receiving a put: chunks land in the version's segment and are forwarded as they land.

    def _receive_put(self, sock: socket.socket, header: dict[str, Any]) -> dict[str, Any]:
        """Receive a streamed put; returns the reply (ok=false replies close the connection)."""
        try:
            version, chain = self._begin_put(header)
        except RelayError as exc:
            self._puts_rejected += 1
            return _error(str(exc))
        newest = self._store.newest(version.run)
        stale = newest is not None and version.policy_version < newest.policy_version
        if not stale:
            self._forwarder.submit(version, chain)
        with self._receiving_lock:
            self._receiving.add(version)
        try:
            digest = self._receive_chunks(sock, version, header.get("digest"))
        except RelayError as exc:
            version.fail(str(exc))
            version.segment.unlink()
            self._puts_rejected += 1
            log.warning("relay_put_rejected", relay_id=self.relay_id, policy_version=version.policy_version,
                        error=str(exc))
            return _error(str(exc))
        finally:
            with self._receiving_lock:
                self._receiving.discard(version)
        version.complete(digest)
        prom.RELAY_RECEIVED.labels(self.relay_id).inc(version.size)
        outcome = self._store.put(version)
        prom.RELAY_VERSIONS.labels(self.relay_id).set(len(self._store.summary()[0]))
        self._log_evicted(outcome.evicted)
        if outcome.stored:
            log.info("relay_version_stored", relay_id=self.relay_id, run=version.run,
                     policy_version=version.policy_version, bytes=version.size, replaced=outcome.replaced)
            over = self._store.over_bytes()
            if over:
                log.warning("relay_over_max_bytes", relay_id=self.relay_id, over_bytes=over, max_bytes=self.max_bytes,
                            runs=self._store.runs(),
                            fix="every live run keeps its newest version; raise max_bytes or run fewer runs")
        else:
            log.info("relay_version_ignored", relay_id=self.relay_id, policy_version=version.policy_version,
                     newest=outcome.newest, reason="stale" if outcome.stale else "duplicate")
        return {"ok": True, "stored": outcome.stored, "newest": outcome.newest, "replaced": outcome.replaced}

    def _begin_put(self, header: dict[str, Any]) -> tuple[Version, list[str]]:
        number = _require_version(header)
        run, chain, digest = header.get("run", ""), header.get("chain", []), header.get("digest")
        size, chunk_bytes = header.get("size"), header.get("chunk_bytes")
        if not isinstance(run, str):
            raise RelayError(f"put policy_version {number}: run={run!r} is not a string")
        if not isinstance(chain, list) or not all(isinstance(a, str) for a in chain):
            raise RelayError(f"put policy_version {number}: chain={chain!r} is not a list of host:port strings")
        if digest is not None and (not isinstance(digest, str) or len(digest) != protocol.DIGEST_HEX_CHARS):
            raise RelayError(f"put policy_version {number}: digest={digest!r} is not a "
                             f"{protocol.DIGEST_HEX_CHARS}-character hex {protocol.DIGEST_ALGORITHM} digest "
                             "(protocol.digest_hex), or null")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= protocol.MAX_PAYLOAD_BYTES:
            raise RelayError(f"put policy_version {number}: size={size!r} is not a byte count")
        if (isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int)
                or not 0 < chunk_bytes <= protocol.MAX_CHUNK_BYTES):
            raise RelayError(f"put policy_version {number}: chunk_bytes={chunk_bytes!r} is not in "
                             f"1..{protocol.MAX_CHUNK_BYTES}")
        name = segments.segment_name(self.relay_id, run, number)
        segment = self._spares.take(name, size) or segments.Segment(self.shm_dir, name, size)
        return Version(number, run, segment, chunk_bytes, digest), chain

    def _receive_chunks(self, sock: socket.socket, version: Version, expected: str | None) -> str:
        """Read every chunk into the segment, checking each d_i, then the end frame; returns the digest.

        One running digest: each piece is hashed as it lands (still in cache), d_i is read off it after
        chunk i, and after the last chunk it is the whole version's digest. On an authenticated connection
        the chunks' tags are checked on worker threads while the next chunks arrive (relay.macs.TagCheck):
        chunk i lands (and may be forwarded) only once its tag and its d_i are both checked, and the version
        completes only once every tag is.
        """
        n = version.policy_version
        running = protocol.RunningDigest()
        check = protocol.tag_check(sock, noted=True,
                                   on_block=lambda i, tag, digest: version.chunk_landed(i, digest, tag))
        try:
            for i in range(version.n_chunks):
                frame = protocol.recv_header(sock)
                assert frame is not None
                view = version.chunk_view(i)
                if frame.get("op") != protocol.OP_CHUNK or frame.get("index") != i or frame["payload_bytes"] != len(view):
                    raise RelayError(f"put policy_version {n}: expected chunk {i} of {len(view)} bytes, got op "
                                     f"{frame.get('op')!r} index {frame.get('index')!r} of {frame['payload_bytes']} "
                                     "bytes")
                if "tags" in frame and frame.get("tag_bytes") != len(view):
                    raise RelayError(f"put policy_version {n}: chunk {i} is tagged in pieces of "
                                     f"{frame.get('tag_bytes')!r} bytes, expected one tag over its {len(view)} bytes")
                protocol.recv_payload_into(sock, frame, view, running, check)
                got = running.hexdigest()
                if got != frame.get("digest"):
                    if check is not None:
                        check.wait()  # bytes that fail their MAC check say so first: that is the cause
                    raise RelayError(f"put policy_version {n}: chunk {i} digest mismatch (expected "
                                     f"{str(frame.get('digest'))[:12]}.., got {got[:12]}..); the chunk was corrupted "
                                     "in transit, push again")
                if check is None:
                    version.chunk_landed(i, got, None)
                else:
                    check.note(i, got)  # lands once its tag is checked too (maybe at once, from here)
            end = protocol.recv_header(sock)
            assert end is not None
            protocol.recv_payload(sock, end)
            if check is not None:
                check.wait()
        finally:
            if check is not None:
                check.abort()  # no worker reads the segment after this (the caller may unlink it)
        if end.get("op") != protocol.OP_END or end.get("chunks") != version.n_chunks:
            raise RelayError(f"put policy_version {n}: expected the end frame after {version.n_chunks} chunks, "
                             f"got op {end.get('op')!r} chunks={end.get('chunks')!r}")
        claimed = end.get("digest")
        got = running.hexdigest()
        if not isinstance(claimed, str) or (expected is not None and claimed != expected) or got != claimed:
            raise RelayError(
                f"put policy_version {n}: whole-version digest mismatch (expected {str(expected or claimed)[:12]}.., "
                f"got {got[:12]}.. over {version.size} bytes); the payload was corrupted in transit, push it again"
            )
        return got

    # Other requests: each op returns (reply header, reply payload); never raises on bad input.

    def _dispatch(self, header: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes | Version]:
        op = header.get("op")
        handlers = {
            protocol.OP_LATEST: self._op_latest,
            protocol.OP_GET: self._op_get,
            protocol.OP_VERSION: self._op_version,
            protocol.OP_LOCAL: self._op_local,
            protocol.OP_STATS: self._op_stats,
        }
        handler = handlers.get(op)
        if handler is None:
            return _error(f"unknown op {op!r}; this relay serves {', '.join(protocol.OPS)}"), b""
        run = header.get("run", "")
        if not isinstance(run, str):
            return _error(f"op {op!r}: run={run!r} is not a string"), b""
        try:
            return handler(header)
        except RelayError as exc:
            return _error(str(exc)), b""

    def _held(self, header: dict[str, Any]) -> Version | None:
        """The version a read asks for: the given policy_version (must be held) or the newest (may be None)."""
        if header.get("op") != protocol.OP_GET and header.get("policy_version") is None:
            return self._store.newest(header.get("run", ""))
        version = _require_version(header)
        held = self._store.get(version, header.get("run", ""))
        if held is None:
            versions, _ = self._store.summary(header.get("run", ""))
            raise RelayError(
                f"relay {self.relay_id} does not hold policy_version {version} (holds {versions} of run "
                f"{header.get('run', '')!r}, keeps the newest "
                f"{self.keep_versions} per run); fetch the latest version instead"
            )
        return held

    def _op_latest(self, header: dict[str, Any]) -> tuple[dict[str, Any], bytes | Version]:
        newest = self._store.newest(header.get("run", ""))
        if newest is None:
            return {"ok": True, "policy_version": None, "digest": None}, b""
        return {"ok": True, "policy_version": newest.policy_version, "digest": newest.digest}, newest

    def _op_get(self, header: dict[str, Any]) -> tuple[dict[str, Any], bytes | Version]:
        held = self._held(header)
        assert held is not None
        return {"ok": True, "policy_version": held.policy_version, "digest": held.digest}, held

    def _op_local(self, header: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        held = self._held(header)
        if held is None:
            return {"ok": True, "policy_version": None}, b""
        return {"ok": True, "policy_version": held.policy_version, "digest": held.digest,
                "path": str(held.segment.path), "size": held.size}, b""

    def _op_version(self, header: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        newest = self._store.newest(header.get("run", ""))
        return {"ok": True, "policy_version": None if newest is None else newest.policy_version}, b""

    def _log_evicted(self, evicted: list[tuple[str, int, str]]) -> None:
        for run, number, why in evicted:
            log.info("relay_version_evicted", relay_id=self.relay_id, run=run, policy_version=number, reason=why)

    def _op_stats(self, header: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
        self._log_evicted(self._store.sweep())
        versions, bytes_held = self._store.summary()
        c = self._forwarder.counters
        with c.lock:
            forwards = {"forwards_done": c.done, "forwards_failed": c.failed, "forwards_superseded": c.superseded,
                        "forwards_aborted": c.aborted, "forwards_pending": c.pending + int(c.in_flight)}
        completed = {str(n): t for n, t in self._store.completed_at().items()}
        with self._receiving_lock:
            receiving = sorted([v.policy_version, len(v.digests), v.n_chunks] for v in self._receiving)
        return {"ok": True, "relay_id": self.relay_id, "run": self._store.run, "versions": versions,
                "bytes_held": bytes_held, "completed_at": completed, "puts_rejected": self._puts_rejected,
                "receiving": receiving, "runs": self._store.runs(), "max_bytes": self.max_bytes,
                "idle_evict_s": self.idle_evict_s, "evicted": [list(e) for e in self._store.evicted],
                **forwards}, b""


def _require_version(header: dict[str, Any]) -> int:
    version = header.get("policy_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise RelayError(f"op {header.get('op')!r}: policy_version={version!r} is not a non-negative integer")
    return version


def _tags_of(version: Version, sock: socket.socket) -> list[str]:
    """The chunk tags a get reply carries: those checked on receipt; computed from the segment for a version that
    came without (none does on a relay with a token: every put to it is authenticated)."""
    if all(t is not None for t in version.tags) and len(version.tags) == version.n_chunks:
        return version.tags  # type: ignore[return-value]
    session = protocol.session_of(sock)
    assert session is not None
    version.tags = list(session.tags(version.payload[:version.size], version.chunk_bytes))  # once per version
    return version.tags  # type: ignore[return-value]


def _half_of(path: str) -> int:
    """Half the size of the file system under `path` (the default bound on held bytes); 0 if unknown."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_blocks * st.f_frsize // 2


def _error(message: str) -> dict[str, Any]:
    return {"ok": False, "error": message}
