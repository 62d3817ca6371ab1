"""Payload tags hashed beside the socket: relay.pipeline's pure decisions, and laminar.relay.macs's threads on real bytes.

The wire-level checks (a frame-rewriting proxy, a put to a real relay) are tests/test_relay_mac.py's; here the
parts: which block each byte falls in, what a sender hashes ahead, that blocks are handed on in order and only
once every part of them is in, and that the tags the threads compute are the Session's, byte for byte.
"""

from __future__ import annotations

import hashlib
import hmac
import os

import pytest

from laminar.errors import RelayError
from laminar.relay import macs, protocol
from laminar.relay.pipeline import Blocks, InOrder, may_feed, window

KEY = b"k" * 32


def test_blocks_cut_a_stream_of_payloads_into_their_tag_blocks():
    blocks = Blocks()
    assert list(blocks.expect(10, 4)) == [0, 1, 2]  # 4, 4, 2
    assert blocks.feed(3) == [(0, 0, 3, False)]
    assert blocks.feed(6) == [(0, 0, 1, True), (1, 1, 5, True), (2, 5, 6, False)]
    assert blocks.filled == 2 and blocks.expected == 3
    assert blocks.feed(1) == [(2, 0, 1, True)]
    assert blocks.filled == 3
    assert list(blocks.expect(5, 8)) == [3]  # the next payload's blocks number on: a put's chunk i is block i
    assert blocks.feed(5) == [(3, 0, 5, True)]
    with pytest.raises(ValueError, match="fed past the 4 blocks"):
        blocks.feed(1)


def test_blocks_accept_the_next_payload_after_a_partial_feed():
    blocks = Blocks()
    blocks.expect(4, 4)
    assert blocks.feed(4) == [(0, 0, 4, True)]
    blocks.expect(2, 4)
    assert blocks.feed(2) == [(1, 0, 2, True)]
    with pytest.raises(ValueError, match="must be positive"):
        blocks.expect(0, 4)


def test_window_hashes_up_to_depth_ahead_of_the_block_taken():
    assert list(window(0, 0, 10, 3)) == [0, 1, 2]
    assert list(window(1, 3, 10, 3)) == [3]  # block 1 taken: 1..3 in flight
    assert list(window(1, 4, 10, 3)) == []  # already submitted past the window
    assert list(window(8, 10, 10, 3)) == []  # never past n
    assert list(window(9, 9, 10, 4)) == [9]
    with pytest.raises(ValueError):
        window(0, 0, 10, 0)


def test_may_feed_bounds_the_bytes_handed_and_not_hashed():
    assert may_feed(fed=0, hashed=0, limit=8)
    assert may_feed(fed=7, hashed=0, limit=8)
    assert not may_feed(fed=8, hashed=0, limit=8)  # wait for the workers
    assert may_feed(fed=8, hashed=1, limit=8)


def test_in_order_releases_each_index_once_all_its_parts_are_in():
    order = InOrder(("tag", "note"))
    assert order.add(1, "tag", "t1") == []  # block 1 checked before block 0: held back
    assert order.add(1, "note", "d1") == []
    assert order.add(0, "note", "d0") == []  # block 0's tag not checked yet
    assert order.add(0, "tag", "t0") == [(0, {"tag": "t0", "note": "d0"}), (1, {"tag": "t1", "note": "d1"})]
    assert order.next == 2
    with pytest.raises(ValueError, match="released already"):
        order.add(1, "tag", "again")
    assert order.add(2, "tag", "t2") == []
    with pytest.raises(ValueError, match="twice"):
        order.add(2, "tag", "t2")
    with pytest.raises(ValueError, match="not one of"):
        order.add(2, "digest", "x")


def test_in_order_with_one_part():
    order = InOrder()
    assert order.add(0, "tag", "a") == [(0, {"tag": "a"})]


def _tags(data: bytes, block: int) -> list[str]:
    return protocol.Session(b"f" * 32, KEY, send_label=b"a", recv_label=b"b").tags(data, block)


def test_tag_ahead_computes_the_sessions_tags():
    data = os.urandom(5 * 1000 + 17)
    with macs.TagAhead(KEY, memoryview(data), 1000, workers=2, depth=2) as ahead:
        assert [ahead.tag(i) for i in range(6)] == _tags(data, 1000)


@pytest.mark.parametrize("workers", [1, 3])
def test_tag_check_checks_a_stream_of_payloads_and_hands_blocks_on_in_order(workers: int):
    """A relay's put: one check across chunk frames, fed in pieces that straddle blocks, with a note per block."""
    chunks = [os.urandom(n) for n in (3 << 20, 3 << 20, 1 << 20, 12345)]
    landed: list[tuple[int, object]] = []
    check = macs.TagCheck(KEY, workers=workers, noted=True, on_block=lambda i, tag, note: landed.append((i, note)))
    try:
        for i, chunk in enumerate(chunks):
            check.expect(_tags(chunk, len(chunk)), len(chunk), len(chunk), f"chunk {i}")
            view = memoryview(chunk)
            for start in range(0, len(chunk), 700_001):  # pieces as a socket returns them
                check.update(view[start:start + 700_001])
            check.note(i, f"d{i}")
        check.wait()
    finally:
        check.abort()
    assert landed == [(i, f"d{i}") for i in range(len(chunks))]


def test_tag_check_with_the_receive_held_to_the_hashing_still_checks_everything():
    """ahead_bytes=1: every batch waits until the workers hashed the one before (the receive slowed to the hashing,
    as with a starved hashing thread); nothing deadlocks and every block is handed on."""
    data = os.urandom((3 << 20) + 99)
    landed: list[int] = []
    check = macs.TagCheck(KEY, workers=2, ahead_bytes=1, on_block=lambda i, tag, note: landed.append(i))
    try:
        check.expect(_tags(data, 1 << 20), 1 << 20, len(data), "a reply")
        view = memoryview(data)
        for start in range(0, len(data), 300_000):
            check.update(view[start:start + 300_000])
        check.wait()
    finally:
        check.abort()
    assert landed == [0, 1, 2, 3]


def test_tag_check_one_payload_with_many_tags():
    data = os.urandom((4 << 20) + 5)
    check = macs.TagCheck(KEY, workers=2)
    check.expect(_tags(data, 1 << 20), 1 << 20, len(data), "a reply")
    check.update(data)
    check.wait()


@pytest.mark.parametrize("workers", [1, 2])
def test_tag_check_a_flipped_byte_fails_and_nothing_after_it_is_handed_on(workers: int):
    chunks = [bytearray(os.urandom(1 << 20)) for _ in range(4)]
    tags = [_tags(bytes(c), len(c))[0] for c in chunks]
    chunks[1][1000] ^= 1  # altered after it was tagged
    landed: list[int] = []
    check = macs.TagCheck(KEY, workers=workers, on_block=lambda i, tag, note: landed.append(i))
    with pytest.raises(RelayError, match=r"chunk 1: bytes 0\.\.1048576 failed their MAC check"):
        try:
            for i, chunk in enumerate(chunks):
                check.expect([tags[i]], len(chunk), len(chunk), f"chunk {i}")
                check.update(chunk)
            check.wait()
        finally:
            check.abort()
    # Chunk 1 failed: chunks 2 and 3, checked or not, are never handed on. Chunk 0 is, when it was checked first
    # (always with one worker: blocks are checked in order; with two, block 1 may fail while 0 is hashed).
    assert landed == [0] if workers == 1 else landed in ([], [0])
    assert isinstance(check.error, RelayError)


def test_tag_check_refuses_a_payload_not_received_in_full():
    check = macs.TagCheck(KEY)
    check.expect(["0" * 64], 10, 10, "x")
    check.update(b"12345")
    with pytest.raises(RelayError, match="not received in full"):
        check.wait()


def test_tag_check_tag_count_must_match_the_blocks():
    check = macs.TagCheck(KEY)
    try:
        with pytest.raises(RelayError, match="2 tags for 1 blocks"):
            check.expect(["a", "b"], 10, 10, "x")
    finally:
        check.abort()


def test_the_tag_is_keyed_blake3_under_the_data_key():
    # the keyed_hash of the empty input under the key of BLAKE3's published test vectors (test_vectors.json)
    vector_key = b"whats the Elvish word for friend"
    assert macs.tag(vector_key, b"") == "92b2b75604ed3c761f9d6f62392c8a9227ad0ea3f09573e783f1498a4ed60d26"
    data = os.urandom(3000)
    (tag,) = _tags(data, 3000)
    assert tag == macs.tag(KEY, data) and len(tag) == protocol.MAC_HEX_CHARS
    assert tag != macs.tag(b"j" * 32, data)  # another run's key
    assert tag != hashlib.sha256(data).hexdigest() and tag != hmac.new(KEY, data, hashlib.sha256).hexdigest()
