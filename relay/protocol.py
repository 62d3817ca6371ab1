"""Wire format of the relay data plane: length-prefixed frames over TCP.

A frame is

    4 bytes   big-endian unsigned length of the header
    N bytes   UTF-8 JSON object (the header); `payload_bytes` says how many payload bytes follow
    M bytes   raw payload (opaque weight bytes, e.g. a safetensors file made by the caller)

Nothing is ever pickled: headers are JSON, payloads are bytes the relay never interprets.

Every connection opens with a handshake (relay.auth): the relay sends
{"op": "hello", "proto", "relay_id", "nonce", "auth": bool}; when auth is true the client answers
{"op": "auth", "nonce", "mac"} and the relay replies {"ok": true, "mac"} (mutual HMAC-SHA256 over both
nonces with the run token) or {"ok": false, "error"} and closes. Then requests follow; every request is
answered by exactly one reply frame:

    client -> relay   {"op": "put", "policy_version", "run", "chain": ["host:port", ...], "size",
                       "chunk_bytes", "digest": str | null}                      (no payload)
    client -> relay   {"op": "chunk", "index": i, "digest": d_i} + chunk i   (ceil(size / chunk_bytes) times)
    client -> relay   {"op": "end", "chunks": n, "digest"}                    (digest of the whole version)
    relay  -> client  {"ok": true, "stored": bool, "newest": int, "replaced": bool}
    client -> relay   {"op": "latest", "run"}
    relay  -> client  {"ok": true, "policy_version": int | null, "digest": str | null} + payload
    client -> relay   {"op": "get", "policy_version", "run"}
    relay  -> client  {"ok": true, "policy_version", "digest"} + payload    (or ok=false if not held)
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

import json
import math
import os
import select
import socket
import struct
from collections.abc import Iterator
from typing import Any

import xxhash

from laminar.errors import RelayError

PROTOCOL_VERSION = 3  # 3: XXH3-128 running digests (2: crc32 per chunk + sha256 of the whole version)
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


def chunk_digests(payload: bytes | bytearray | memoryview, chunk_bytes: int) -> list[str]:
    """d_i of every chunk of `payload` (one pass): what a sender puts in its chunk frames."""
    view = memoryview(payload).cast("B")
    running = RunningDigest()
    out = []
    for start in range(0, len(view), chunk_bytes):
        running.update(view[start:start + chunk_bytes])
        out.append(running.hexdigest())
    return out


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


def encode_header(header: dict[str, Any], payload_bytes: int) -> bytes:
    """Length prefix + JSON header with `payload_bytes` set; the payload itself is sent separately."""
    body = json.dumps({**header, "payload_bytes": payload_bytes}, separators=(",", ":")).encode()
    if len(body) > MAX_HEADER_BYTES:
        raise RelayError(f"frame header is {len(body)} bytes, above the {MAX_HEADER_BYTES}-byte limit")
    return HEADER_LEN.pack(len(body)) + body


def send_frame(sock: socket.socket, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
    """Send one frame; socket errors and timeouts become RelayError."""
    data = encode_header(header, len(payload))
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


def recv_exact_into(sock: socket.socket, view: memoryview, what: str, digest: RunningDigest | None = None) -> None:
    """Fill `view` completely from the socket; EOF, timeout or socket error raise RelayError.

    With `digest`, each piece is hashed right after it lands, while it is still in cache (no second pass).
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
    data = encode_header(header, count)
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
    return header


def recv_payload_into(sock: socket.socket, header: dict[str, Any], view: memoryview,
                      digest: RunningDigest | None = None) -> None:
    """Read the payload announced by `header` straight into `view` (which must be exactly that long),
    feeding `digest` piece by piece as it lands."""
    n = header["payload_bytes"]
    if n != len(view):
        raise RelayError(f"bad frame: payload_bytes={n}, expected {len(view)}")
    if n:
        recv_exact_into(sock, view, f"{n}-byte payload", digest)


def recv_payload(sock: socket.socket, header: dict[str, Any]) -> bytes:
    """Read the whole payload announced by `header`."""
    n = header["payload_bytes"]
    if n == 0:
        return b""
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf), f"{n}-byte payload")
    return bytes(buf)


def iter_payload(sock: socket.socket, header: dict[str, Any], chunk_bytes: int = RECV_CHUNK_BYTES) -> Iterator[bytes]:
    """Yield the payload announced by `header` in chunks of at most chunk_bytes (for pipelining)."""
    left = header["payload_bytes"]
    while left > 0:
        chunk = bytearray(min(left, chunk_bytes))
        recv_exact_into(sock, memoryview(chunk), f"payload chunk ({left} bytes left)")
        left -= len(chunk)
        yield bytes(chunk)


def recv_frame(sock: socket.socket, *, allow_eof: bool = False) -> tuple[dict[str, Any], bytes] | None:
    """Read one whole frame (header, payload); None only with allow_eof on a clean close."""
    header = recv_header(sock, allow_eof=allow_eof)
    if header is None:
        return None
    return header, recv_payload(sock, header)
