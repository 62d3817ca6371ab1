"""Wire format of the relay data plane: length-prefixed frames over TCP.

A frame is

    4 bytes   big-endian unsigned length of the header
    N bytes   UTF-8 JSON object (the header); `payload_bytes` says how many payload bytes follow
    M bytes   raw payload (opaque weight bytes, e.g. a safetensors file made by the caller)

Nothing is ever pickled: headers are JSON, payloads are bytes the relay never interprets.

Every connection opens with a handshake (relay.auth): the relay sends
{"op": "hello", "proto", "relay_id", "nonce", "auth": bool}; when auth is true the client answers
{"op": "auth", "nonce", "mac"} and the relay replies {"ok": true, "mac"} (mutual HMAC-SHA256 over both
nonces with the run token) or {"ok": false, "error"} and closes.

After an authenticated handshake every frame, both ways, is authenticated too (a `Session` per
connection): its header carries "mac", HMAC-SHA256 under the connection's frame key (derived from the
run token and both nonces) over the direction, the frame's sequence number on the connection and the
rest of the header (canonical JSON); a frame with a payload also carries "tags" and "tag_bytes": tag j is
keyed BLAKE3 (32 bytes) under the run's data key of payload bytes j*tag_bytes..(j+1)*tag_bytes (a MAC
2.2 times faster than HMAC-SHA256 here, where every receiving hop hashes every byte once). So a peer in the
middle can alter no header and no byte of weights, and can neither replay, drop nor reorder frames,
without the receiver's check failing: the receiver raises RelayError ("failed its MAC check"), the
relay drops the connection and the version is never admitted, the client never uses the bytes. A
chunk's tag depends on its bytes alone, so a relay checks it as the chunk lands, keeps it with the
chunk, and forwards the chunk (sendfile, no second hash) and serves gets with the tags it checked.
Tags are hashed on worker threads beside the socket (relay.macs): a sender hashes the next chunks' tags
while it sends one, a receiver hashes each piece as it lands while it reads the next, and hands a chunk on
only once its tag is checked; the wire format is the same either way.
Without a token there is no session and frames carry neither field.

Then requests follow; every request is answered by exactly one reply frame:

    client -> relay   {"op": "put", "policy_version", "run", "chain": ["host:port", ...], "size",
                       "chunk_bytes", "digest": str | null}                      (no payload)
    client -> relay   {"op": "chunk", "index": i, "digest": d_i} + chunk i   (ceil(size / chunk_bytes) times)
                      (authenticated: tags [t_i], tag_bytes = this chunk's length)
    client -> relay   {"op": "end", "chunks": n, "digest"}                    (digest of the whole version)
    relay  -> client  {"ok": true, "stored": bool, "newest": int, "replaced": bool}
    client -> relay   {"op": "latest", "run"}
    relay  -> client  {"ok": true, "policy_version": int | null, "digest": str | null} + payload
    client -> relay   {"op": "get", "policy_version", "run"}
    relay  -> client  {"ok": true, "policy_version", "digest"} + payload    (or ok=false if not held)
                      (authenticated: the version's chunk tags t_0.., tag_bytes = its chunk_bytes; also latest)
    client -> relay   {"op": "version", "run"}
    relay  -> client  {"ok": true, "policy_version": int | null}
    client -> relay   {"op": "local", "policy_version": int | null, "run"}
    relay  -> client  {"ok": true, "policy_version", "digest", "path", "size"}   (a shared-memory file)
    client -> relay   {"op": "stats"}
    relay  -> client  {"ok": true, "relay_id", "run", "versions", "bytes_held", "completed_at": {version: unix s},
                       "receiving": [[version, chunks landed, chunks], ...], "forwards_done", ...,
                       "runs": {run: {"versions", "bytes", "idle_s"}}, "max_bytes", "idle_evict_s",
                       "evicted": [[run, version, "bytes" | "idle"], ...]}
                      (run, versions, completed_at: the latest put's run; bytes_held: all runs')

A relay holds every run's versions side by side (relay/versions.py); a request sees only its own run's.

Any reply may be {"ok": false, "error": "..."}. A relay that rejects a put part way (bad chunk digest,
whole-version digest mismatch) replies the error at once and closes the connection.

Digests are XXH3-128 (hex). One running hash covers the stream: d_i, carried by chunk i, is the digest
of the version's bytes from 0 to the end of chunk i, so the last chunk's d_i is the whole version's
digest (`digest_hex(payload)`, whatever the chunk size). Each byte is hashed once, as it lands: the
per-chunk check (d_i) and the whole-version check (the end frame's digest, and the put header's when
the sender knew it) come from the same pass.

A put streams: the relay receives each chunk straight into the version's shared-memory segment,
hashing each piece while it is still in cache, checks d_i, forwards chunk i downstream from the segment
(sendfile, no user-space copy) while chunk i+1 is still arriving, checks the whole version's digest
after the last chunk, and only then serves the version.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import select
import socket
import struct
import weakref
from typing import Any

import xxhash

from laminar.errors import RelayError
from laminar.relay import macs

# 5: payload tags are keyed BLAKE3; 4: authenticated frames, HMAC-SHA256 payload tags; 3: XXH3-128 running digests
PROTOCOL_VERSION = 5
HEADER_LEN = struct.Struct(">I")
MAX_HEADER_BYTES = 1 << 20  # 1 MiB: headers are small JSON objects; anything larger is a bad frame
MAX_PAYLOAD_BYTES = 1 << 40  # 1 TiB: a sanity bound so a garbage header cannot ask for absurd memory
RECV_CHUNK_BYTES = 4 << 20  # 4 MiB per recv_into call

OP_PUT = "put"
OP_LATEST = "latest"
OP_GET = "get"
OP_VERSION = "version"
OP_STATS = "stats"
OP_LOCAL = "local"
OP_CHUNK = "chunk"
OP_END = "end"
OP_HELLO = "hello"
OP_AUTH = "auth"
OPS = (OP_PUT, OP_LATEST, OP_GET, OP_VERSION, OP_LOCAL, OP_STATS)

MIN_CHUNK_BYTES = 1 << 20  # 1 MiB: below this the per-chunk cost of a Python hop (~50-100 us) dominates
MAX_CHUNK_BYTES = 64 << 20  # 64 MiB: bounds how late the first byte reaches the next hop
DEFAULT_LINK_BYTES_PER_S = 1.25e9  # 10 Gbit/s: the link the default chunk size is chosen for
DEFAULT_T_START_S = 200e-6  # per-chunk start-up cost of one hop (frame + Python), measured order


def chunk_bytes_for(size: int, hops: int, bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S,
                    t_start_s: float = DEFAULT_T_START_S) -> int:
    """Chunk size minimising the chain model's time for `size` bytes over `hops` hops (docs/relay.md).

    T(p, k) = (p + k - 2) * (M/k / B + t_start) is smallest at k* = sqrt((p - 2) * M / B / t_start), so a
    chunk is M / k* = sqrt(M * B * t_start / (p - 2)), clamped to MIN_CHUNK_BYTES..MAX_CHUNK_BYTES. With
    p = hops + 1 nodes; p <= 2 (one hop) gains nothing from pipelining and gets the largest chunk.
    """
    p = hops + 1
    if p <= 2 or size <= 0:
        best = MAX_CHUNK_BYTES
    else:
        best = int(math.sqrt(size * bytes_per_s * t_start_s / (p - 2)))
    return max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, best))


DIGEST_ALGORITHM = "xxh3-128"
DIGEST_HEX_CHARS = 32  # 128 bits in hex


class RunningDigest:
    """The stream's running XXH3-128: update() with each piece as it lands, hexdigest() at any point.

    hexdigest() does not end the stream, so after chunk i it is that chunk's d_i (the digest of bytes
    0..end of chunk i) and after the last chunk it is the whole version's digest.
    """

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def chain_model_s(size: int, nodes: int, bytes_per_s: float, t_start_s: float) -> float:
    """T = M/B + (p-2)*t_start + 2*sqrt((p-2)*M/B*t_start): the optimal chain broadcast time, p nodes."""
    m_over_b = size / bytes_per_s
    extra = max(nodes - 2, 0)
    return m_over_b + extra * t_start_s + 2 * math.sqrt(extra * m_over_b * t_start_s)


def digest_hex(payload: bytes | bytearray | memoryview) -> str:
    """The whole version's digest (XXH3-128, hex): what every put ends with and every relay verifies."""
    return xxhash.xxh3_128_hexdigest(payload)


def parse_addr(addr: str) -> tuple[str, int]:
    """Split "host:port" (or "[v6]:port") into (host, port); raise RelayError on anything else."""
    if not isinstance(addr, str) or ":" not in addr:
        raise RelayError(f"relay address {addr!r} is not of the form host:port")
    host, _, port_text = addr.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        port = int(port_text)
    except ValueError:
        raise RelayError(f"relay address {addr!r}: port {port_text!r} is not an integer") from None
    if not host or not 0 < port < 65536:
        raise RelayError(f"relay address {addr!r} needs a host and a port in 1..65535")
    return host, port


MAC_HEX_CHARS = 64  # a frame's HMAC-SHA256 and a payload's keyed BLAKE3 tag, in hex
MAC_HINT = macs.MAC_HINT


class Session:
    """An authenticated connection (relay.auth sets it up after the handshake): keys and frame counters.

    frame_key: per connection (run token + both nonces), so a frame recorded on one connection fails on any
    other; `sent`/`received` number the frames each way, so a dropped, repeated or reordered frame fails
    too. data_key: per run (run token alone), so a chunk's tag is the same on every hop and a relay forwards
    the tags it checked instead of hashing the bytes again. Not thread-safe: one thread per connection.
    """

    def __init__(self, frame_key: bytes, data_key: bytes, *, send_label: bytes, recv_label: bytes) -> None:
        self.frame_key = frame_key
        self.data_key = data_key
        self.send_label = send_label
        self.recv_label = recv_label
        self.sent = 0
        self.received = 0

    def frame_mac(self, label: bytes, seq: int, header: dict[str, Any]) -> str:
        canonical = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        return hmac.new(self.frame_key, label + seq.to_bytes(8, "big") + canonical, hashlib.sha256).hexdigest()

    def tagger(self) -> Any:
        """A fresh payload tag hasher (update(), hexdigest())."""
        return macs.tagger(self.data_key)

    def tag(self, data: bytes | bytearray | memoryview) -> str:
        return macs.tag(self.data_key, data)

    def tags(self, payload: bytes | bytearray | memoryview, tag_bytes: int) -> list[str]:
        view = memoryview(payload).cast("B")
        return [self.tag(view[i:i + tag_bytes]) for i in range(0, len(view), tag_bytes)]


_sessions: weakref.WeakKeyDictionary[socket.socket, Session] = weakref.WeakKeyDictionary()


def set_session(sock: socket.socket, session: Session) -> None:
    """From now on every frame sent or read on `sock` is authenticated with `session` (laminar.relay.auth)."""
    _sessions[sock] = session


def session_of(sock: socket.socket) -> Session | None:
    """The connection's Session, or None when it is not authenticated (no run token)."""
    return _sessions.get(sock)


def encode_header(header: dict[str, Any], payload_bytes: int) -> bytes:
    """Length prefix + JSON header with `payload_bytes` set; the payload itself is sent separately."""
    body = json.dumps({**header, "payload_bytes": payload_bytes}, separators=(",", ":")).encode()
    if len(body) > MAX_HEADER_BYTES:
        raise RelayError(f"frame header is {len(body)} bytes, above the {MAX_HEADER_BYTES}-byte limit")
    return HEADER_LEN.pack(len(body)) + body


def frame_header(sock: socket.socket, header: dict[str, Any], payload_bytes: int) -> bytes:
    """encode_header for this connection: on an authenticated one, with the frame's "mac" (the next sequence
    number). A header announcing a payload must then carry its "tags" and "tag_bytes" (Session.tags)."""
    session = session_of(sock)
    if session is None:
        return encode_header(header, payload_bytes)
    full = {**header, "payload_bytes": payload_bytes}
    if payload_bytes and not isinstance(full.get("tags"), list):
        raise RelayError(f"frame {header.get('op')!r} with {payload_bytes} payload bytes has no payload tags on an "
                         "authenticated connection")
    mac = session.frame_mac(session.send_label, session.sent, full)
    session.sent += 1
    return encode_header({**full, "mac": mac}, payload_bytes)


def send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    """Send one frame; socket errors and timeouts become RelayError. On an authenticated connection the
    payload's tag is computed here (one tag over the whole payload) unless the header has its tags."""
    session = session_of(sock)
    if session is not None and len(payload) and "tags" not in header:
        header = {**header, "tags": [session.tag(payload)], "tag_bytes": len(payload)}
    data = frame_header(sock, header, len(payload))
    try:
        if len(payload) <= 64 << 10:
            sock.sendall(data + bytes(payload))
        else:
            sock.sendall(data)
            sock.sendall(memoryview(payload))
    except TimeoutError:
        raise RelayError(f"sending a {len(payload)}-byte frame timed out after {sock.gettimeout()} s") from None
    except OSError as exc:
        raise RelayError(f"sending a {len(payload)}-byte frame failed: {exc}") from exc


def recv_exact_into(sock: socket.socket, view: memoryview, what: str, digest: Any = None) -> None:
    """Fill `view` completely from the socket; EOF, timeout or socket error raise RelayError.

    With `digest` (anything with update(): a RunningDigest, a relay.macs.TagCheck), each piece is handed to it
    right after it lands, while it is still in cache (no second pass).
    """
    got, total = 0, len(view)
    while got < total:
        try:
            n = sock.recv_into(view[got:], min(total - got, RECV_CHUNK_BYTES))
        except TimeoutError:
            raise RelayError(
                f"timed out after {sock.gettimeout()} s reading {what} ({got} of {total} bytes received)"
            ) from None
        except OSError as exc:
            raise RelayError(f"reading {what} failed after {got} of {total} bytes: {exc}") from exc
        if n == 0:
            raise RelayError(f"connection closed while reading {what}: got {got} of {total} bytes (truncated frame)")
        if digest is not None:
            digest.update(view[got:got + n])
        got += n


def sendfile_all(sock: socket.socket, fd: int, offset: int, count: int, what: str) -> None:
    """Send `count` bytes of file `fd` from `offset` with sendfile(2): the kernel reads the (shared-memory)
    file's pages itself, so no byte is copied through user space; timeouts and errors raise RelayError."""
    timeout = sock.gettimeout()
    sent = 0
    while sent < count:
        try:
            n = os.sendfile(sock.fileno(), fd, offset + sent, count - sent)
        except BlockingIOError:  # a socket with a timeout is non-blocking underneath: wait until writable
            _, writable, _ = select.select([], [sock], [], timeout)
            if not writable:
                raise RelayError(f"sending {what} timed out after {timeout} s ({sent} of {count} bytes sent)") from None
            continue
        except OSError as exc:
            raise RelayError(f"sending {what} failed after {sent} of {count} bytes: {exc}") from exc
        if n == 0:
            raise RelayError(f"sending {what}: the file ended after {sent} of {count} bytes")
        sent += n


def send_frame_from_file(sock: socket.socket, header: dict[str, Any], fd: int, offset: int, count: int) -> None:
    """Send one frame whose payload is `count` bytes of file `fd` from `offset` (sendfile, zero copy)."""
    data = frame_header(sock, header, count)
    try:
        sock.sendall(data, socket.MSG_MORE if count else 0)  # MSG_MORE: the header rides with the payload
    except TimeoutError:
        raise RelayError(f"sending a frame header timed out after {sock.gettimeout()} s") from None
    except OSError as exc:
        raise RelayError(f"sending a frame header failed: {exc}") from exc
    sendfile_all(sock, fd, offset, count, f"a {count}-byte payload")


def recv_header(sock: socket.socket, *, allow_eof: bool = False) -> dict[str, Any] | None:
    """Read a frame's length prefix and JSON header, leaving the payload on the socket.

    With allow_eof, a connection closed cleanly before the first byte of a frame returns None (the
    peer is done); a close anywhere else is a truncated frame and raises RelayError.
    """
    prefix = bytearray(HEADER_LEN.size)
    view = memoryview(prefix)
    try:
        first = sock.recv_into(view, HEADER_LEN.size)
    except TimeoutError:
        raise RelayError(f"timed out after {sock.gettimeout()} s waiting for a frame") from None
    except OSError as exc:
        raise RelayError(f"reading a frame header failed: {exc}") from exc
    if first == 0:
        if allow_eof:
            return None
        raise RelayError("connection closed before a reply frame arrived; the relay may have crashed")
    recv_exact_into(sock, view[first:], "frame length prefix")
    (length,) = HEADER_LEN.unpack(prefix)
    if length == 0 or length > MAX_HEADER_BYTES:
        raise RelayError(
            f"bad frame: header length {length} is outside 1..{MAX_HEADER_BYTES}; "
            "the peer is not speaking the relay protocol"
        )
    body = bytearray(length)
    recv_exact_into(sock, memoryview(body), "frame header")
    try:
        header = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RelayError(f"bad frame: header is not valid UTF-8 JSON ({exc})") from None
    if not isinstance(header, dict):
        raise RelayError(f"bad frame: header is a JSON {type(header).__name__}, expected an object")
    n = header.get("payload_bytes")
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_PAYLOAD_BYTES:
        raise RelayError(f"bad frame: payload_bytes={n!r} is not an integer in 0..{MAX_PAYLOAD_BYTES}")
    session = session_of(sock)
    if session is not None:
        _check_frame(session, header)
    return header


def _check_frame(session: Session, header: dict[str, Any]) -> None:
    """Verify and strip an authenticated frame's "mac"; check its payload tags are well formed."""
    seq = session.received
    session.received += 1
    mac = header.pop("mac", None)
    if not isinstance(mac, str) or not hmac.compare_digest(mac, session.frame_mac(session.recv_label, seq, header)):
        raise RelayError(f"frame {seq} ({header.get('op', 'reply')!r}) failed its MAC check: {MAC_HINT}")
    n = header["payload_bytes"]
    if n:
        tags, tag_bytes = header.get("tags"), header.get("tag_bytes")
        if (isinstance(tag_bytes, bool) or not isinstance(tag_bytes, int) or tag_bytes <= 0
                or not isinstance(tags, list) or len(tags) != -(-n // tag_bytes)):
            raise RelayError(f"frame {seq}: {n} payload bytes with tags for tag_bytes={tag_bytes!r} "
                             f"({len(tags) if isinstance(tags, list) else tags!r} tags); an authenticated "
                             "payload needs one tag per tag_bytes")


class _Sinks:
    """Hands each landed piece to the running digest (if any) and to the payload's tag check."""

    def __init__(self, digest: RunningDigest | None, check: macs.TagCheck) -> None:
        self._digest, self._check = digest, check

    def update(self, data: bytes | bytearray | memoryview) -> None:
        if self._digest is not None:
            self._digest.update(data)
        self._check.update(data)


def tag_check(sock: socket.socket, **kwargs: Any) -> macs.TagCheck | None:
    """A TagCheck under the connection's data key (laminar.relay.macs), or None on a connection without a Session."""
    session = session_of(sock)
    return None if session is None else macs.TagCheck(session.data_key, **kwargs)


def _expect(check: macs.TagCheck, header: dict[str, Any], what: str) -> None:
    check.expect(header["tags"], header["tag_bytes"], header["payload_bytes"], what)


def recv_payload_into(sock: socket.socket, header: dict[str, Any], view: memoryview,
                      digest: RunningDigest | None = None, check: macs.TagCheck | None = None) -> None:
    """Read the payload announced by `header` straight into `view` (which must be exactly that long),
    feeding `digest` piece by piece as it lands.

    On an authenticated connection the payload's tags are checked on worker threads as the bytes land
    (relay.macs.TagCheck): by a fresh check, waited for before this returns, or by the caller's `check`
    (a relay's put: one check across its chunks), which the caller waits for.
    """
    n = header["payload_bytes"]
    if n != len(view):
        raise RelayError(f"bad frame: payload_bytes={n}, expected {len(view)}")
    if not n:
        return
    what = f"{n}-byte payload of {header.get('op', 'a reply')!r}"
    own = check is None
    if own:
        check = tag_check(sock)
    if check is None:
        recv_exact_into(sock, view, f"{n}-byte payload", digest)
        return
    try:
        _expect(check, header, what)
        recv_exact_into(sock, view, f"{n}-byte payload", _Sinks(digest, check))
        if own:
            check.wait()
    finally:
        if own:
            check.abort()


def recv_payload(sock: socket.socket, header: dict[str, Any]) -> bytes:
    """Read the whole payload announced by `header`."""
    n = header["payload_bytes"]
    if n == 0:
        return b""
    buf = bytearray(n)
    recv_payload_into(sock, header, memoryview(buf))
    return bytes(buf)


def recv_frame(sock: socket.socket, *, allow_eof: bool = False) -> tuple[dict[str, Any], bytes] | None:
    """Read one whole frame (header, payload); None only with allow_eof on a clean close."""
    header = recv_header(sock, allow_eof=allow_eof)
    if header is None:
        return None
    return header, recv_payload(sock, header)
