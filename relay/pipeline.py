"""Bookkeeping for hashing payload tags beside the socket (relay.macs): pure, no threads, no clock.

A payload on an authenticated connection is cut into tag blocks (protocol.Session: tag j covers bytes
j*tag_bytes..(j+1)*tag_bytes); a relay's put is a stream of such payloads, one block per chunk. relay.macs
hashes the blocks on worker threads while the socket goes on, and uses three decisions made here:

    Blocks    where the next n bytes of the stream fall: (block, from, to, ends the block) pieces
    window    which blocks a sender submits for hashing before it needs block `taken`'s tag
    may_feed  whether a receiver may hand its workers more bytes, or must wait for them to catch up first
    InOrder   hands blocks on 0, 1, 2, ... in order, each once every part of it is in (its verified tag,
              and the receiver's running digest d_i), whatever order the workers finish in
"""

from __future__ import annotations

from typing import Any


class Blocks:
    """Tag blocks of a stream of payloads: expect() adds one payload's blocks, feed(n) cuts the next n bytes.

    Block numbers run on across payloads (a relay's put: block i is chunk i). Sizes are exact: the last
    block of a payload is its remainder.
    """

    def __init__(self) -> None:
        self._sizes: list[int] = []  # size of every block expected so far
        self._block = 0  # the block the next byte falls in
        self._left = 0  # bytes still to come of that block (0: it has not started, or nothing is expected)

    @property
    def expected(self) -> int:
        """Blocks expected so far."""
        return len(self._sizes)

    @property
    def filled(self) -> int:
        """Blocks whose every byte has been fed (0..filled-1)."""
        return self._block

    def expect(self, n_bytes: int, block_bytes: int) -> range:
        """The next payload: n_bytes in blocks of block_bytes; returns their block numbers."""
        if n_bytes <= 0 or block_bytes <= 0:
            raise ValueError(f"a payload of {n_bytes} bytes in blocks of {block_bytes}: both must be positive")
        first = len(self._sizes)
        self._sizes.extend(min(block_bytes, n_bytes - start) for start in range(0, n_bytes, block_bytes))
        if self._left == 0 and self._block < len(self._sizes):
            self._left = self._sizes[self._block]
        return range(first, len(self._sizes))

    def feed(self, n: int) -> list[tuple[int, int, int, bool]]:
        """Cut the next n bytes: [(block, start, end, ends the block)], start..end into those n bytes."""
        out: list[tuple[int, int, int, bool]] = []
        at = 0
        while at < n:
            if self._left == 0:
                raise ValueError(f"{n - at} bytes fed past the {len(self._sizes)} blocks expected")
            take = min(self._left, n - at)
            self._left -= take
            ends = self._left == 0
            out.append((self._block, at, at + take, ends))
            at += take
            if ends:
                self._block += 1
                self._left = self._sizes[self._block] if self._block < len(self._sizes) else 0
        return out


def window(taken: int, submitted: int, n: int, depth: int) -> range:
    """Blocks to submit for hashing now: up to `depth` ahead of block `taken` (the one the sender needs
    next), from `submitted` (the first not submitted yet), never past n."""
    if depth < 1:
        raise ValueError(f"depth={depth}: hash at least the block being taken")
    return range(submitted, max(submitted, min(n, taken + depth)))


def may_feed(fed: int, hashed: int, limit: int) -> bool:
    """A receiver keeps at most `limit` bytes handed to its workers and not hashed yet: past that it waits, so a
    starved hashing thread slows the socket (TCP flow control reaches the sender, whose writes stay slow but
    alive) instead of building a backlog that would hold up the reply after the last byte."""
    return fed - hashed < limit


class InOrder:
    """Releases 0, 1, 2, ... in order, each once all of `parts` are in for it.

    add(index, part, value) records one part of one index and returns the indices released by it, in order,
    each with its parts ({part: value}); an index released is never returned again.
    """

    def __init__(self, parts: tuple[str, ...] = ("tag",)) -> None:
        if not parts:
            raise ValueError("an index needs at least one part to be released")
        self.parts = frozenset(parts)
        self.next = 0  # the first index not released yet
        self._waiting: dict[int, dict[str, Any]] = {}

    def add(self, index: int, part: str, value: Any) -> list[tuple[int, dict[str, Any]]]:
        if part not in self.parts:
            raise ValueError(f"part {part!r} is not one of {sorted(self.parts)}")
        if index < self.next:
            raise ValueError(f"index {index} was released already (next is {self.next})")
        got = self._waiting.setdefault(index, {})
        if part in got:
            raise ValueError(f"index {index} got part {part!r} twice")
        got[part] = value
        out = []
        while self.parts <= self._waiting.get(self.next, {}).keys():
            out.append((self.next, self._waiting.pop(self.next)))
            self.next += 1
        return out
