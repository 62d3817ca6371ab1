"""The relay data plane of issue 14: one running digest per byte, segments reused without a reader ever
seeing bytes change, and a trainer push that never waits for the chain. Real relays and sockets only."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from laminar.errors import RelayError
from laminar.relay import auth, client, protocol, segments
from tests.helpers import chunk_digests
from tests.test_relay_chain import relays, versions_of, wait_until, weights

__all__ = ["relays"]  # the fixture, imported for this module's tests


def test_running_digest_gives_each_chunk_and_the_whole_version_whatever_the_chunk_size():
    payload = os.urandom(300_000)
    # 300000 bytes in 65536-byte chunks: 4 full chunks and one of 300000 - 4 * 65536 = 37856 bytes.
    digests = chunk_digests(payload, 65536)
    assert len(digests) == 5
    # d_i is the digest of bytes 0..end of chunk i, so the last one is the whole version's digest...
    assert digests[1] == protocol.digest_hex(payload[:131072])
    assert digests[-1] == protocol.digest_hex(payload)
    # ...whatever the chunking: the same bytes pushed with another chunk size keep their identity.
    assert chunk_digests(payload, 100_000)[-1] == digests[-1]
    assert len(protocol.digest_hex(payload)) == protocol.DIGEST_HEX_CHARS


def _segments_of(relay_id: str) -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"lmr-{os.getpid()}-{relay_id}-")}


def test_dropped_segments_are_reused_and_a_mapped_one_never_changes(relays):
    server, master = relays("master", keep_versions=1)
    client.push(master, 1, weights(1), chain=[])
    first = server._store.get(1).segment
    client.push(master, 2, weights(2), chain=[])  # keep 1: version 1 is dropped and its segment kept spare
    client.push(master, 3, weights(3), chain=[])  # the same size: version 3 lands in version 1's segment
    assert server._store.get(3).segment is first and first.generation == 1
    assert client.fetch_latest(master) == (3, weights(3))

    with client.pull_local(master) as pulled:  # a reader maps version 3 (shared flock while mapped)
        landed = []
        for v in (4, 5, 6):  # 4 drops 3: the reader holds it, so it is only unlinked, never written again
            client.push(master, v, weights(v), chain=[])
            landed.append(server._store.get(v).segment)
        assert all(seg is not first for seg in landed)
        assert landed[2] is landed[0]  # 6 lands in 4's segment (dropped by 5, nobody mapped it)
        assert pulled.policy_version == 3 and bytes(pulled.buffer) == weights(3)  # unchanged under the reader
        pulled.verify()
        copied = bytearray(len(weights(3)))
        pulled.readinto(memoryview(copied))  # and so is what a copy out of the reader's kept mapping reads
        assert copied == weights(3)
    # Only the held version and at most 2 spares have names; no segment leaks.
    assert len(_segments_of("master")) + len([n for n in os.listdir("/dev/shm")
                                              if n.startswith(f"lmr-{os.getpid()}-spare-")]) <= 3


def test_a_reader_given_the_name_of_a_reused_segment_is_told_to_ask_again(relays):
    server, master = relays("master", keep_versions=1)
    client.push(master, 1, weights(1), chain=[])
    reply, _ = client.request(master, {"op": "local", "run": "", "policy_version": None})
    client.push(master, 2, weights(2), chain=[])
    client.push(master, 3, weights(3), chain=[])  # version 1's segment now holds version 3, under 3's name
    from laminar.relay import segments

    with pytest.raises(RelayError, match="is gone"):
        segments.open_readonly(reply["path"], reply["size"])
    with client.pull_local(master) as pulled:  # asking again finds version 3
        assert bytes(pulled.buffer) == weights(3)


class StuckRelay:
    """A peer that greets like a relay, accepts the put and then never reads: a chain that does not move."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            self.conns.append(conn)
            auth.serve_handshake(conn, "stuck", None)  # then nothing is ever read

    def close(self) -> None:
        self.server.close()
        for conn in self.conns:
            conn.close()


def test_the_trainer_push_returns_while_the_chain_has_not_moved(relays):
    _, master = relays("master", forward_timeout_s=60.0)
    stuck = StuckRelay()
    try:
        payload = os.urandom(8 << 20)  # 8 MiB: far more than the socket buffers toward a peer that never reads
        client.push(master, 1, payload, chain=[stuck.addr], chunk_bytes=1 << 20)
        # push returned: the master holds the whole checked version while its forwarder is still blocked.
        assert client.fetch_latest(master) == (1, payload)
        st = client.stats(master)
        assert st["forwards_pending"] == 1 and st["forwards_done"] == 0
    finally:
        stuck.close()
    # The stuck peer went away: the forward fails and the chain is exhausted, nothing else changes.
    wait_until(lambda: client.stats(master), lambda s: s["forwards_failed"] == 1, 20, "the forward to fail")
    assert versions_of([master]) == [1]


def _pull_into(addr: str, size: int) -> tuple[bytes, str]:
    """A local pull copied out with readinto, as load_into does: (the bytes, the segment's path)."""
    dest = bytearray(size)
    with client.pull_local(addr) as pulled:
        pulled.readinto(memoryview(dest))
        return bytes(dest), pulled.path


def test_a_reader_keeps_its_mapping_and_reads_the_next_version_in_a_reused_segment_through_it(relays):
    server, master = relays("master", keep_versions=1)
    segments.reader_mappings.clear()
    client.push(master, 1, weights(1), chain=[])
    got, path = _pull_into(master, len(weights(1)))
    assert got == weights(1) and path in segments.reader_mappings  # mapped once, kept after the pull
    first = server._store.get(1).segment
    client.push(master, 2, weights(2), chain=[])  # keep 1: version 1's segment becomes a spare...
    client.push(master, 3, weights(3), chain=[])  # ...and version 3 lands in it: the kept mapping holds no lock
    assert server._store.get(3).segment is first and first.generation == 1
    got, path = _pull_into(master, len(weights(3)))
    assert path == str(first.path) and path in segments.reader_mappings
    assert got == weights(3)  # the relay's new bytes, read through the page tables mapped for version 1


def test_a_reader_of_the_buffer_alone_keeps_no_mapping(relays):
    _, master = relays("master")
    segments.reader_mappings.clear()
    client.push(master, 1, weights(1), chain=[])
    with client.pull_local(master) as pulled:  # the zero-copy view only (state_dict_from_buffer's way)
        assert bytes(pulled.buffer) == weights(1)
        path = pulled.path
    assert path not in segments.reader_mappings and len(segments.reader_mappings) == 0


def test_a_kept_mapping_of_a_segment_the_relay_dropped_is_unmapped_at_the_next_pull(relays):
    _, master = relays("master", keep_versions=1, spare_segments=0)
    client.push(master, 1, weights(1), chain=[])
    _, old = _pull_into(master, len(weights(1)))
    client.push(master, 2, weights(2), chain=[])  # no spares: version 1's segment is unlinked, not reused
    assert not os.path.exists(old)
    assert any(old in line for line in open("/proc/self/maps"))  # still pinned by this reader's mapping
    got, new = _pull_into(master, len(weights(2)))
    assert got == weights(2) and new in segments.reader_mappings
    assert not any(old in line for line in open("/proc/self/maps"))  # unmapped: its memory is free


def test_a_reader_keeps_at_most_limit_mappings_least_recently_used_go_first(relays):
    server, master = relays("master", keep_versions=3)
    for v in (1, 2, 3):
        client.push(master, v, weights(v), chain=[])
    paths = {v: str(server._store.get(v).segment.path) for v in (1, 2, 3)}
    kept = segments.ReaderMappings(limit=2)
    for v in (1, 2, 1, 3):  # 1 used again after 2: 2 is the least recently used when 3 needs room
        mapped = segments.open_readonly(paths[v], len(weights(v)), kept)
        first = bytearray(32)
        mapped.readinto(memoryview(first), 0)  # the first copy out of a segment maps it and keeps it
        assert first == weights(v)[:32]
        mapped.close()
    assert len(kept) == 2 and paths[1] in kept and paths[3] in kept and paths[2] not in kept
    kept.clear()
    assert len(kept) == 0


def test_copying_out_of_a_closed_pull_is_refused(relays):
    _, master = relays("master")
    client.push(master, 1, weights(1), chain=[])
    pulled = client.pull_local(master)
    pulled.close()  # the shared lock is gone: the relay may reuse the segment, so nothing may be read
    with pytest.raises(RelayError, match="after its LocalPull was closed"):
        pulled.readinto(memoryview(bytearray(16)))
