"""Blocking client of a weight relay: push a version, fetch the newest or a given one, poll, stats.

Every call opens one TCP connection, sends one request frame and reads one reply frame. Calls block;
from an asyncio loop run them with `asyncio.to_thread`. Every failure raises laminar.errors.RelayError
naming the relay address.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from laminar.errors import RelayError
from relay import protocol


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


def request(
    addr: str, header: dict[str, Any], payload: bytes | memoryview = b"", timeout_s: float = 30.0
) -> tuple[dict[str, Any], bytes]:
    """Send one request frame and return the reply (header, payload); ok=false replies raise RelayError.

    timeout_s bounds the connect and each socket read or write (an idle timeout, not a total one).
    """
    sock = _connect(addr, timeout_s)
    try:
        try:
            protocol.send_frame(sock, {"proto": protocol.PROTOCOL_VERSION, **header}, payload)
            frame = protocol.recv_frame(sock)
        except RelayError as exc:
            raise RelayError(f"relay {addr}, op {header.get('op')!r}: {exc}") from exc
    finally:
        sock.close()
    assert frame is not None  # recv_frame without allow_eof never returns None
    reply, body = frame
    if not reply.get("ok"):
        raise RelayError(f"relay {addr} refused op {header.get('op')!r}: {reply.get('error', 'no error given')}")
    return reply, body


def push(
    addr: str,
    policy_version: int,
    payload: bytes,
    chain: list[str],
    timeout_s: float = 30.0,
    *,
    sha256: str | None = None,
    run: str = "",
) -> float:
    """Hand `payload` as `policy_version` to the relay at addr, which forwards it down `chain`.

    Returns the seconds spent; the relay replies as soon as it holds the version, before forwarding.
    A version not newer than the relay's newest is acknowledged but not stored as newest. Pass sha256
    when it is already known (a relay forwarding), to avoid hashing again on the sending side.
    """
    start = time.perf_counter()
    header = {
        "op": protocol.OP_PUT,
        "policy_version": policy_version,
        "sha256": sha256 or protocol.sha256_hex(payload),
        "chain": list(chain),
        "run": run,
    }
    request(addr, header, payload, timeout_s)
    return time.perf_counter() - start


def _verified(addr: str, reply: dict[str, Any], body: bytes) -> bytes:
    expected = reply.get("sha256")
    got = protocol.sha256_hex(body)
    if got != expected:
        raise RelayError(
            f"relay {addr} sent policy_version {reply.get('policy_version')} with sha256 {got[:12]}.., "
            f"but its header says {str(expected)[:12]}..; the transfer was corrupted, fetch again"
        )
    return body


def fetch_latest(addr: str, timeout_s: float = 30.0, *, run: str = "") -> tuple[int | None, bytes | None]:
    """(policy_version, payload) of the newest complete version of `run` the relay holds, or (None, None)."""
    reply, body = request(addr, {"op": protocol.OP_LATEST, "run": run}, timeout_s=timeout_s)
    if reply.get("policy_version") is None:
        return None, None
    return reply["policy_version"], _verified(addr, reply, body)


def fetch_version(addr: str, policy_version: int, timeout_s: float = 30.0, *, run: str = "") -> bytes:
    """Payload of `policy_version` of `run`; RelayError if the relay no longer (or never) held it."""
    header = {"op": protocol.OP_GET, "policy_version": policy_version, "run": run}
    reply, body = request(addr, header, timeout_s=timeout_s)
    return _verified(addr, reply, body)


def latest_version(addr: str, timeout_s: float = 5.0, *, run: str = "") -> int | None:
    """Newest complete policy_version of `run` the relay holds (None if none); a cheap poll, no payload."""
    reply, _ = request(addr, {"op": protocol.OP_VERSION, "run": run}, timeout_s=timeout_s)
    return reply.get("policy_version")


def stats(addr: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """The relay's counters: relay_id, versions, bytes_held, forwards_done/failed/superseded/pending."""
    reply, _ = request(addr, {"op": protocol.OP_STATS}, timeout_s=timeout_s)
    return {k: v for k, v in reply.items() if k not in ("ok", "payload_bytes")}
