"""The relay authenticates the bytes, not only the handshake (relay.protocol.Session).

A real TCP proxy sits between a real client and a real relay and rewrites frames the way a peer in the
middle would: it flips one byte of a chunk of weights and fixes up every XXH3-128 digest that would
betray it (each chunk's running d_i and the end frame's; the reply's whole-version digest). Without a
run token that succeeds, which is the attack (the controls below); with one the receiver's MAC check
fails, the relay drops the connection and never admits the version, the client never returns the bytes,
and the version sent again without the proxy arrives intact.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from laminar.errors import RelayError
from laminar.relay import client, protocol
from laminar.relay.server import RelayServer

CHUNK = 1 << 20  # protocol.MIN_CHUNK_BYTES: a 3 MiB version is chunks of 1, 1 and 1 MiB
Frame = tuple[dict, bytearray]
Tamper = Callable[[dict, bytearray], list[Frame]]  # the frames to send instead (none: dropped)


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        got = sock.recv(n - len(buf))
        if not got:
            return None
        buf += got
    return bytes(buf)


class FrameProxy:
    """Listens on 127.0.0.1, forwards each connection to `upstream` frame by frame, letting `up` (client to
    relay) and `down` (relay to client) rewrite, drop, repeat or hold back each frame."""

    def __init__(self, upstream: str, up: Tamper | None = None, down: Tamper | None = None) -> None:
        self.upstream, self.up, self.down = protocol.parse_addr(upstream), up, down
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.tampered = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self.listener.accept()
            except OSError:
                return
            far = socket.create_connection(self.upstream)
            threading.Thread(target=self._pipe, args=(near, far, self.up), daemon=True).start()
            threading.Thread(target=self._pipe, args=(far, near, self.down), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, tamper: Tamper | None) -> None:
        try:
            while (prefix := _read_exact(src, 4)) is not None:
                header = json.loads(_read_exact(src, protocol.HEADER_LEN.unpack(prefix)[0]) or b"")
                payload = bytearray(_read_exact(src, header["payload_bytes"]) or b"")
                for out_header, out_payload in tamper(header, payload) if tamper else [(header, payload)]:
                    body = json.dumps(out_header, separators=(",", ":")).encode()
                    dst.sendall(protocol.HEADER_LEN.pack(len(body)) + body + out_payload)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def flip_chunk(proxy_box: list[FrameProxy], fix_digests: bool) -> Tamper:
    """Client to relay: flip byte 1000 of chunk 1; with fix_digests also put the running digest of the altered
    stream into every chunk header and the end frame, so the relay's digest checks pass."""
    running = protocol.RunningDigest()

    def tamper(header: dict, payload: bytearray) -> list[Frame]:
        if header.get("op") == protocol.OP_CHUNK:
            if header["index"] == 1:
                payload[1000] ^= 0x01
                proxy_box[0].tampered += 1
            running.update(payload)
            if fix_digests:
                header["digest"] = running.hexdigest()
        elif header.get("op") == protocol.OP_END and fix_digests:
            header["digest"] = running.hexdigest()
        return [(header, payload)]

    return tamper


def flip_reply(proxy_box: list[FrameProxy], fix_digest: bool) -> Tamper:
    """Relay to client: flip one byte of chunk 1 of a version in a reply; with fix_digest also put the altered
    bytes' digest into the reply's header, so the client's digest check passes."""

    def tamper(header: dict, payload: bytearray) -> list[Frame]:
        if header.get("ok") and len(payload) > 2 * CHUNK:
            payload[CHUNK + 1000] ^= 0x01
            if fix_digest:
                header["digest"] = protocol.digest_hex(payload)
            proxy_box[0].tampered += 1
        return [(header, payload)]

    return tamper


@pytest.fixture
def payload() -> bytes:
    return os.urandom(3 * CHUNK)


# With a token, the flip is caught by the frame MAC when the proxy rewrote a header (the digests), else by the
# payload tag of the chunk frame it altered (a chunk frame's tag covers its own payload, bytes 0..1 MiB of it).
PUT_CASES = {"no-token-control": (None, True, None),
             "token, digests fixed": (True, True, r"frame \d+ \('chunk'\) failed its MAC check"),
             "token, bytes only": (True, False, r"bytes 0\.\.1048576 failed their MAC check")}


@pytest.mark.parametrize("case", PUT_CASES)
def test_altered_chunk_of_a_put(payload: bytes, case: str):
    with_token, fix, error = PUT_CASES[case]
    token = secrets.token_hex(16) if with_token else None
    with RelayServer("r-mitm", token=token) as relay:
        assert relay.addr is not None
        box: list[FrameProxy] = []
        box.append(FrameProxy(relay.addr, up=flip_chunk(box, fix)))
        try:
            if token is None:  # the control: digests alone do not stop a peer in the middle
                client.push(box[0].addr, 1, payload, [], token=None, chunk_bytes=CHUNK)
                _, held = client.fetch_latest(relay.addr)
                assert box[0].tampered == 1 and held is not None and held != payload
                assert sum(a != b for a, b in zip(held, payload, strict=True)) == 1
                return
            with pytest.raises(RelayError, match=error):
                client.push(box[0].addr, 1, payload, [], token=token, chunk_bytes=CHUNK)
            assert box[0].tampered == 1
            assert client.latest_version(relay.addr, token=token) is None  # the altered version was never admitted
            assert client.stats(relay.addr, token=token)["puts_rejected"] == 1
            client.push(relay.addr, 1, payload, [], token=token, chunk_bytes=CHUNK)  # sent again, not through it
            assert client.fetch_latest(relay.addr, token=token) == (1, payload)
        finally:
            box[0].close()


GET_CASES = {"no-token-control": (None, True, None),
             "token, digest fixed": (True, True, r"frame 0 \('reply'\) failed its MAC check"),
             "token, bytes only": (True, False, r"bytes 1048576\.\.2097152 failed their MAC check")}


@pytest.mark.parametrize("case", GET_CASES)
def test_altered_bytes_of_a_fetch(payload: bytes, case: str):
    with_token, fix, error = GET_CASES[case]
    token = secrets.token_hex(16) if with_token else None
    with RelayServer("r-mitm-get", token=token) as relay:
        assert relay.addr is not None
        client.push(relay.addr, 4, payload, [], token=token, chunk_bytes=CHUNK)
        box: list[FrameProxy] = []
        box.append(FrameProxy(relay.addr, down=flip_reply(box, fix)))
        try:
            if token is None:  # the control: the client's digest check alone takes the altered bytes
                version, got = client.fetch_latest(box[0].addr)
                assert version == 4 and got is not None and got != payload and box[0].tampered == 1
                return
            with pytest.raises(RelayError, match=error):
                client.fetch_latest(box[0].addr, token=token)
            with pytest.raises(RelayError, match=error):
                client.fetch_version(box[0].addr, 4, token=token)
            assert box[0].tampered == 2
            assert client.fetch_latest(relay.addr, token=token) == (4, payload)  # fetched again, intact
        finally:
            box[0].close()


@pytest.mark.parametrize("fault", ["repeat", "drop", "reorder"])
def test_replayed_dropped_or_reordered_frames_fail(payload: bytes, fault: str):
    """Whole frames, each with its own valid MAC, repeated, dropped or swapped on an authenticated put: each
    frame's MAC covers its sequence number on the connection, so the relay's check fails at once."""
    token = secrets.token_hex(16)
    held: list[Frame] = []

    def tamper(header: dict, body: bytearray) -> list[Frame]:
        if header.get("op") != protocol.OP_CHUNK:
            return [(header, body)]
        if header["index"] == 0:
            held.append((header, body))
            return {"repeat": [(header, body), (header, body)], "drop": [], "reorder": []}[fault]
        if header["index"] == 1 and fault == "reorder":
            return [(header, body), *held]  # chunk 1 before chunk 0
        return [(header, body)]

    with RelayServer(f"r-{fault}", token=token) as relay:
        assert relay.addr is not None
        proxy = FrameProxy(relay.addr, up=tamper)
        try:
            with pytest.raises(RelayError, match=r"frame \d+ \('chunk'\) failed its MAC check"):
                client.push(proxy.addr, 1, payload, [], token=token, chunk_bytes=CHUNK)
            assert held  # the proxy did see chunk 0
            assert client.latest_version(relay.addr, token=token) is None
        finally:
            proxy.close()


def _one_version_older(when: Callable[[dict], bool]) -> Callable[[dict, bytearray], list[Frame]]:
    """A FrameProxy rewrite: a frame whose header `when` picks names the protocol version before this one."""

    def older(header: dict, body: bytearray) -> list[Frame]:
        if when(header):
            header["proto"] = protocol.PROTOCOL_VERSION - 1
        return [(header, body)]

    return older


@contextmanager
def _through_proxy(name: str, token: str | None, **rewrite) -> Iterator[tuple[RelayServer, FrameProxy]]:
    """A relay, and a FrameProxy in front of it rewriting frames (`up=` client to relay, `down=` relay to client)."""
    with RelayServer(name, token=token) as relay:
        assert relay.addr is not None
        proxy = FrameProxy(relay.addr, **rewrite)
        try:
            yield relay, proxy
        finally:
            proxy.close()


def test_a_relay_of_another_protocol_version_is_refused_by_name(payload: bytes):
    """A relay that greets with another protocol version (an older laminar: HMAC-SHA256 payload tags, not keyed
    BLAKE3) is refused at the hello, naming both versions, before any tag could fail as if bytes were altered."""
    token = secrets.token_hex(16)
    older = _one_version_older(lambda header: header.get("op") == protocol.OP_HELLO)
    with _through_proxy("r-older", token, down=older) as (relay, proxy):
        want = (rf"speaks relay protocol {protocol.PROTOCOL_VERSION - 1} and this client "
                rf"{protocol.PROTOCOL_VERSION}; run the same laminar version")
        with pytest.raises(RelayError, match=want):
            client.push(proxy.addr, 1, payload, [], token=token, chunk_bytes=CHUNK)
        with pytest.raises(RelayError, match=want):
            client.latest_version(proxy.addr, token=token)
        assert client.latest_version(relay.addr, token=token) is None  # nothing was sent through it


def test_a_client_of_another_protocol_version_is_refused_by_name(payload: bytes):
    """The other way round: a request that names another protocol version (an older trainer or replica) gets an
    error naming both versions from the relay, which admits nothing from it. Without a token: with one, the proxy's
    rewrite of the header would fail the frame MAC first (a real older client's MAC would hold)."""
    with _through_proxy("r-older-client", None, up=_one_version_older(lambda header: "proto" in header)) as (
            relay, proxy):
        want = (rf"the client speaks relay protocol {protocol.PROTOCOL_VERSION - 1} and this relay "
                rf"{protocol.PROTOCOL_VERSION}")
        with pytest.raises(RelayError, match=want):
            client.latest_version(proxy.addr, token=None)
        assert client.latest_version(relay.addr, token=None) is None


def test_a_request_that_names_no_protocol_version_is_refused():
    """A request header without "proto" (something that is not this laminar's client) is refused with what to
    send, not served as if it spoke the current version."""

    def unversioned(header: dict, body: bytearray) -> list[Frame]:
        header.pop("proto", None)
        return [(header, body)]

    with _through_proxy("r-unversioned", None, up=unversioned) as (relay, proxy):
        with pytest.raises(RelayError, match=rf'names no relay protocol version .* send "proto": '
                                             rf'{protocol.PROTOCOL_VERSION}'):
            client.latest_version(proxy.addr, token=None)
        assert client.latest_version(relay.addr, token=None) is None
