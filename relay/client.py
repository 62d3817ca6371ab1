"""Blocking client of a weight relay: push a version, fetch the newest or a given one, pull from shared
memory on the relay's host, poll, stats.

Every call opens one TCP connection, runs the handshake (relay.auth; pass the run token when relays
require one), sends one request and reads one reply. Calls block; from an asyncio loop run them with
`asyncio.to_thread`. Every failure raises laminar.errors.RelayError naming the relay address.

Two timeouts bound every call, both sized to the network, not to the transfer: the connect timeout (a relay whose
port drops packets costs this, once; relay.breaker then skips it) and the idle timeout (each socket read or write;
a stream that makes progress never hits it, however large the version). `configure()` sets the process's defaults
(workers read LAMINAR_RELAY_CONNECT_TIMEOUT_S and LAMINAR_RELAY_IO_TIMEOUT_S); a call's `timeout_s` overrides the
idle timeout.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from laminar.errors import RelayError
from laminar.relay import auth, macs, protocol, segments

DEFAULT_CONNECT_TIMEOUT_S = 1.0  # a LAN connect takes well under 1 ms; 1 s leaves room for a loaded host
DEFAULT_IO_TIMEOUT_S = 2.0  # idle: a peer that neither reads nor writes for this long is gone or wedged


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = DEFAULT_CONNECT_TIMEOUT_S
    io_s: float = DEFAULT_IO_TIMEOUT_S


TIMEOUTS = Timeouts()  # this process's; configure() replaces it


def configure(connect_timeout_s: float, io_timeout_s: float) -> Timeouts:
    """Set this process's relay timeouts (seconds); ValueError naming the bad one."""
    global TIMEOUTS
    for name, value in (("connect_timeout_s", connect_timeout_s), ("io_timeout_s", io_timeout_s)):
        if not (isinstance(value, int | float) and math.isfinite(value) and 0.01 <= value <= 600):
            raise ValueError(f"relay {name}={value!r}: use seconds between 0.01 and 600 (about 1 s on a LAN)")
    TIMEOUTS = Timeouts(float(connect_timeout_s), float(io_timeout_s))
    return TIMEOUTS


def _connect(addr: str, timeout_s: float) -> socket.socket:
    host, port = protocol.parse_addr(addr)
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except TimeoutError:
        raise RelayError(
            f"relay {addr}: connecting timed out after {timeout_s} s; check that the relay host is up and "
            "that no firewall drops the port"
        ) from None
    except OSError as exc:
        raise RelayError(
            f"relay {addr} could not be reached ({exc}); check that the relay process is running and "
            "that host:port is the address it reported when it started"
        ) from exc
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def open_connection(addr: str, timeout_s: float | None = None, *, token: str | None = None,
                    connect_timeout_s: float | None = None) -> socket.socket:
    """A connected, authenticated socket to the relay at addr (the caller closes it). connect_timeout_s bounds the
    connect, timeout_s each later read or write (the handshake's too); None: this process's TIMEOUTS."""
    sock = _connect(addr, connect_timeout_s or TIMEOUTS.connect_s)
    sock.settimeout(timeout_s or TIMEOUTS.io_s)
    try:
        auth.client_handshake(sock, addr, token)
    except RelayError as exc:
        sock.close()
        if str(exc).startswith(f"relay {addr}"):
            raise
        raise RelayError(f"relay {addr}, handshake: {exc}") from exc
    except BaseException:
        sock.close()
        raise
    return sock


def _reply(sock: socket.socket, addr: str, op: str) -> tuple[dict[str, Any], bytes]:
    try:
        frame = protocol.recv_frame(sock)
    except RelayError as exc:
        raise RelayError(f"relay {addr}, op {op!r}: {exc}") from exc
    assert frame is not None  # recv_frame without allow_eof never returns None
    reply, body = frame
    if not reply.get("ok"):
        raise RelayError(f"relay {addr} refused op {op!r}: {reply.get('error', 'no error given')}")
    return reply, body


def request(
    addr: str, header: dict[str, Any], payload: bytes | memoryview = b"", timeout_s: float | None = None,
    *, token: str | None = None,
) -> tuple[dict[str, Any], bytes]:
    """Send one request frame and return the reply (header, payload); ok=false replies raise RelayError.

    The connect is bounded by TIMEOUTS.connect_s; timeout_s (default TIMEOUTS.io_s) bounds each socket read or
    write (an idle timeout, not a total one).
    """
    sock = open_connection(addr, timeout_s, token=token)
    try:
        try:
            protocol.send_frame(sock, {"proto": protocol.PROTOCOL_VERSION, **header}, payload)
        except RelayError as exc:
            raise RelayError(f"relay {addr}, op {header.get('op')!r}: {exc}") from exc
        return _reply(sock, addr, str(header.get("op")))
    finally:
        sock.close()


ChunkSource = Callable[[int], tuple[memoryview, str] | tuple[memoryview, str, str | None]]


def send_version(
    sock: socket.socket, addr: str, header: dict[str, Any], chunk: ChunkSource, n_chunks: int,
    final_digest: Callable[[], str], *, fd: int | None = None,
) -> dict[str, Any]:
    """Stream one put: the put header, n_chunks chunk frames (chunk(i) -> (bytes, d_i[, tag])), the end frame.

    chunk(i) may block until chunk i exists (a relay forwarding what it is still receiving) and raise to
    abort; the connection is then closed without an end frame and the receiver discards the partial
    version. With `fd` (a relay's segment file), chunk i's bytes go out with sendfile(2) from offset
    i * chunk_bytes of that file instead of from the view: no copy through user space. Returns the
    relay's reply; RelayError if the relay refuses or the connection breaks. On an authenticated connection
    each chunk frame carries its tag (protocol.Session): chunk(i)'s third item (a relay forwards the tag it
    checked), else computed here from the bytes.
    """
    chunk_bytes = header["chunk_bytes"]
    session = protocol.session_of(sock)
    try:
        sock.sendall(protocol.frame_header(sock, {"proto": protocol.PROTOCOL_VERSION, **header}, 0))
        for i in range(n_chunks):
            view, digest, *tag = chunk(i)
            fields = {"op": protocol.OP_CHUNK, "index": i, "digest": digest}
            if session is not None:
                fields.update(tags=[tag[0] if tag and tag[0] else session.tag(view)], tag_bytes=len(view))
            frame = protocol.frame_header(sock, fields, len(view))
            sock.sendall(frame, socket.MSG_MORE)  # the frame header leaves with the chunk's first bytes
            if fd is None:
                sock.sendall(view)
                continue
            try:
                protocol.sendfile_all(sock, fd, i * chunk_bytes, len(view), f"chunk {i}")
            except RelayError as exc:  # a socket error inside sendfile (chunk(i)'s own errors pass through)
                raise _put_failed(sock, addr, header, exc) from exc
        end = {"op": protocol.OP_END, "chunks": n_chunks, "digest": final_digest()}
        sock.sendall(protocol.frame_header(sock, end, 0))
    except OSError as exc:
        raise _put_failed(sock, addr, header, exc) from exc
    reply, _ = _reply(sock, addr, protocol.OP_PUT)
    return reply


def _put_failed(sock: socket.socket, addr: str, header: dict[str, Any], exc: Exception) -> RelayError:
    """The error for a put whose stream broke: the relay's own error reply when it sent one."""
    # The relay may have refused part way (bad chunk) and closed: its error reply explains why.
    try:
        sock.settimeout(1.0)
        frame = protocol.recv_frame(sock, allow_eof=True)
    except RelayError:
        frame = None
    if frame is not None and not frame[0].get("ok"):
        return RelayError(f"relay {addr} refused op 'put': {frame[0].get('error')}")
    return RelayError(f"relay {addr}: streaming policy_version {header.get('policy_version')} failed "
                      f"({exc}); the relay may have died")


def push(
    addr: str,
    policy_version: int,
    payload: bytes,
    chain: list[str],
    timeout_s: float | None = None,
    *,
    digest: str | None = None,
    run: str = "",
    token: str | None = None,
    chunk_bytes: int | None = None,
) -> float:
    """Hand `payload` as `policy_version` to the relay at addr, which forwards it down `chain`.

    Returns the seconds spent (the trainer's stall): the relay replies as soon as it holds and has
    checked the whole version (its chunks are in its segment); forwarding down the chain runs behind, from
    the master's segment, and continues after this returns. A version older than the relay's newest is
    acknowledged but not stored. digest (protocol.digest_hex of the payload), when given, goes in the
    put header and the relay refuses the version unless the bytes it received hash to it. chunk_bytes
    defaults to the chain model's optimum for len(chain) + 1 hops (protocol.chunk_bytes_for).
    """
    start = time.perf_counter()
    view = memoryview(payload).cast("B")
    size = len(view)
    chunk_bytes = chunk_bytes or protocol.chunk_bytes_for(size, len(chain) + 1)
    n_chunks = -(-size // chunk_bytes)
    running = protocol.RunningDigest()
    header = {"op": protocol.OP_PUT, "policy_version": policy_version, "run": run, "chain": list(chain),
              "size": size, "chunk_bytes": chunk_bytes, "digest": digest}
    sock = open_connection(addr, timeout_s, token=token)
    session = protocol.session_of(sock)
    # The chunks' tags are hashed on worker threads a few chunks ahead of the one being sent (relay.macs).
    ahead = macs.TagAhead(session.data_key, view, chunk_bytes) if session is not None and size else None

    def chunk(i: int) -> tuple[memoryview, str, str | None]:
        piece = view[i * chunk_bytes:(i + 1) * chunk_bytes]
        running.update(piece)  # hashed just before it is sent: one pass, the chunk is in cache for the send
        return piece, running.hexdigest(), None if ahead is None else ahead.tag(i)

    try:
        send_version(sock, addr, header, chunk, n_chunks, lambda: digest or running.hexdigest())
    finally:
        if ahead is not None:
            ahead.close()
        sock.close()
    return time.perf_counter() - start


def _verified(addr: str, reply: dict[str, Any], body: bytes) -> bytes:
    expected = reply.get("digest")
    got = protocol.digest_hex(body)
    if got != expected:
        raise RelayError(
            f"relay {addr} sent policy_version {reply.get('policy_version')} with digest {got[:12]}.., "
            f"but its header says {str(expected)[:12]}..; the transfer was corrupted, fetch again"
        )
    return body


def fetch_latest(addr: str, timeout_s: float | None = None, *, run: str = "",
                 token: str | None = None) -> tuple[int | None, bytes | None]:
    """(policy_version, payload) of the newest complete version of `run` the relay holds, or (None, None)."""
    reply, body = request(addr, {"op": protocol.OP_LATEST, "run": run}, timeout_s=timeout_s, token=token)
    if reply.get("policy_version") is None:
        return None, None
    return reply["policy_version"], _verified(addr, reply, body)


def fetch_version(addr: str, policy_version: int, timeout_s: float | None = None, *, run: str = "",
                  token: str | None = None) -> bytes:
    """Payload of `policy_version` of `run`; RelayError if the relay no longer (or never) held it."""
    header = {"op": protocol.OP_GET, "policy_version": policy_version, "run": run}
    reply, body = request(addr, header, timeout_s=timeout_s, token=token)
    return _verified(addr, reply, body)


def latest_version(addr: str, timeout_s: float | None = None, *, run: str = "", token: str | None = None) -> int | None:
    """Newest complete policy_version of `run` the relay holds (None if none); a cheap poll, no payload."""
    reply, _ = request(addr, {"op": protocol.OP_VERSION, "run": run}, timeout_s=timeout_s, token=token)
    return reply.get("policy_version")


def stats(addr: str, timeout_s: float | None = None, *, token: str | None = None) -> dict[str, Any]:
    """The relay's counters: relay_id, versions, bytes_held, completed_at, forwards_done/failed/..."""
    reply, _ = request(addr, {"op": protocol.OP_STATS}, timeout_s=timeout_s, token=token)
    return {k: v for k, v in reply.items() if k not in ("ok", "payload_bytes")}


class LocalPull:
    """A version mapped read-only from the local relay's shared memory; `buffer` is a zero-copy view.

    Close it (or use it as a context manager) once the weights are loaded into the engine; the bytes
    stay valid until then even if the relay evicts the version meanwhile (relay.segments). To load
    into existing CPU parameters, `readinto` (or relay.weights.load_into) copies each byte once, with
    memcpy from this process's kept mapping of the segment (segments.ReaderMappings: the relay reuses
    the same few segments, so a new version arrives in pages this reader has mapped already).
    """

    def __init__(self, policy_version: int, digest: str, mapped: segments.Mapped) -> None:
        self.policy_version = policy_version
        self.digest = digest
        self.path = str(mapped.path)
        self.size = mapped.size
        self.buffer = mapped.view
        self._mapped = mapped

    def readinto(self, dest: memoryview, offset: int = 0) -> None:
        """Copy len(dest) bytes of the version from `offset` into dest."""
        self._mapped.readinto(dest, offset)

    def verify(self) -> None:
        """Re-hash the mapped bytes against the relay's digest (the relay already verified them on receipt)."""
        got = protocol.digest_hex(self.buffer)
        if got != self.digest:
            raise RelayError(f"shared-memory segment {self.path}: digest {got[:12]}.. differs from the "
                             f"relay's {self.digest[:12]}..; pull again")

    def close(self) -> None:
        """Unmap now, or, while tensors made from `buffer` are still alive, as soon as the last one dies."""
        self._mapped.close()

    def __enter__(self) -> LocalPull:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def pull_local(addr: str, *, run: str = "", token: str | None = None, policy_version: int | None = None,
               timeout_s: float | None = None) -> LocalPull | None:
    """Map the newest (or the given) version of `run` from the shared memory of the relay on this host.

    No bytes cross the socket: the relay names its segment and this process maps it read-only. Returns
    None when the relay holds no version of `run`; RelayError when it does not hold policy_version.
    The process keeps its mapping of the segment for later pulls (segments.reader_mappings; `clear()` it
    when this process stops pulling, to unpin segments the relay dropped meanwhile).
    """
    header = {"op": protocol.OP_LOCAL, "run": run, "policy_version": policy_version}
    for attempt in range(3):
        reply, _ = request(addr, header, timeout_s=timeout_s, token=token)
        if reply.get("policy_version") is None:
            return None
        try:
            mapped = segments.open_readonly(reply["path"], reply["size"])
        except RelayError:
            if attempt == 2:
                raise
            continue  # evicted between the reply and the open: ask again
        return LocalPull(reply["policy_version"], reply["digest"], mapped)
    raise AssertionError("unreachable")
