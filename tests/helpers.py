"""Helpers that only tests use: a ledger's oldest ready batch and the relay protocol's chunk digests and chunked
payload reads, kept here so that the product code carries no test-only entry points."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

from laminar.contract import BatchPart
from laminar.relay import protocol
from laminar.workflows.ledger import Ledger


def next_batch(ledger: Ledger, groups: int) -> list[BatchPart]:
    """The oldest `groups` ready groups of `ledger`, grouped by segment in arrival order."""
    return ledger.batch_parts([g.group_id for g in ledger.state.ready[:groups]])


def chunk_digests(payload: bytes | bytearray | memoryview, chunk_bytes: int) -> list[str]:
    """d_i of every chunk of `payload` (one pass): what a sender puts in its chunk frames."""
    view = memoryview(payload).cast("B")
    running = protocol.RunningDigest()
    out = []
    for start in range(0, len(view), chunk_bytes):
        running.update(view[start:start + chunk_bytes])
        out.append(running.hexdigest())
    return out


def iter_payload(sock: socket.socket, header: dict[str, Any], chunk_bytes: int = protocol.RECV_CHUNK_BYTES,
                 ) -> Iterator[bytes]:
    """Yield the payload announced by `header` in chunks of at most `chunk_bytes`, its tag checked at the end."""
    left = header["payload_bytes"]
    check = protocol.tag_check(sock) if left else None
    try:
        if check is not None:
            protocol._expect(check, header, f"{left}-byte payload")
        while left > 0:
            chunk = bytearray(min(left, chunk_bytes))
            protocol.recv_exact_into(sock, memoryview(chunk), f"payload chunk ({left} bytes left)", check)
            left -= len(chunk)
            if left == 0 and check is not None:
                check.wait()  # before the last piece is handed out
            yield bytes(chunk)
    finally:
        if check is not None:
            check.abort()
