"""Relay framing: round trips and bad frames over a real socket pair."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from laminar.errors import RelayError
from laminar.relay import protocol
from tests.helpers import iter_payload


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    yield a, b
    a.close()
    b.close()


def test_round_trip_with_payload(pair):
    a, b = pair
    payload = bytes(range(256)) * 1000  # larger than a socket buffer: send from another thread
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(protocol.send_frame, a, {"op": "put", "policy_version": 7}, payload)
        header, got = protocol.recv_frame(b)
        sent.result()
    assert header == {"op": "put", "policy_version": 7, "payload_bytes": len(payload)}
    assert got == payload


def test_header_is_read_before_payload_for_chunked_reading(pair):
    a, b = pair
    payload = b"x" * 10_000
    protocol.send_frame(a, {"op": "put"}, payload)
    header = protocol.recv_header(b)
    # 10_000 bytes in chunks of 4096: 4096 + 4096 + 1808.
    assert [len(c) for c in iter_payload(b, header, chunk_bytes=4096)] == [4096, 4096, 1808]


def test_clean_close_before_a_frame_is_eof_only_when_allowed(pair):
    a, b = pair
    a.close()
    assert protocol.recv_frame(b, allow_eof=True) is None
    with pytest.raises(RelayError, match="connection closed before a reply frame"):
        protocol.recv_frame(b)


def test_truncated_payload_raises(pair):
    a, b = pair
    a.sendall(protocol.encode_header({"op": "put"}, 100) + b"y" * 40)
    a.close()
    with pytest.raises(RelayError, match="got 40 of 100 bytes"):
        protocol.recv_frame(b)


@pytest.mark.parametrize(
    "raw, message",
    [
        (protocol.HEADER_LEN.pack(0), "header length 0"),
        (protocol.HEADER_LEN.pack(protocol.MAX_HEADER_BYTES + 1), "outside 1.."),
        (protocol.HEADER_LEN.pack(3) + b"\xff\xfe{", "not valid UTF-8 JSON"),
        (protocol.HEADER_LEN.pack(2) + b"[]", "JSON list, expected an object"),
        (protocol.HEADER_LEN.pack(13) + json.dumps({"op": "put"}).encode(), "payload_bytes=None"),
    ],
)
def test_bad_headers_raise(pair, raw, message):
    a, b = pair
    a.sendall(raw)
    with pytest.raises(RelayError, match=message):
        protocol.recv_frame(b)


def test_timeout_raises(pair):
    _, b = pair
    b.settimeout(0.05)
    with pytest.raises(RelayError, match="timed out"):
        protocol.recv_frame(b)


@pytest.mark.parametrize("addr", ["nohost", "h:notaport", ":80", "h:0", "h:70000"])
def test_bad_addresses_raise(addr):
    with pytest.raises(RelayError, match="relay address"):
        protocol.parse_addr(addr)


def test_addresses_parse():
    assert protocol.parse_addr("127.0.0.1:9000") == ("127.0.0.1", 9000)
    assert protocol.parse_addr("[::1]:9000") == ("::1", 9000)
