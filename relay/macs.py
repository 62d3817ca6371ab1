"""Payload tags (keyed BLAKE3 under the run's data key, protocol.Session) hashed on worker threads beside the socket.

The wire format does not change: a frame still carries the tags of its payload before the payload, and a
receiver still admits nothing whose tag it has not checked. What changes is which thread hashes, and when:

    TagAhead  (sender) hashes the tags of the next blocks on worker threads while the sender sends block i,
              so a chunk's tag is ready when its frame header goes out; the sender's own thread only sends.
    TagCheck  (receiver) feeds each piece of a block to a worker as it lands (block j to worker j % workers),
              so a block is hashed while the next bytes are received and its tag is compared a few
              microseconds after its last byte lands; blocks are handed on in order (on_block), only once
              checked, and a failure stops the receive at the next piece.

BLAKE3's keyed mode is a MAC (a PRF under a 32-byte key). The blake3 module releases the GIL while it hashes,
like hashlib, so the workers hash in parallel with the socket and with each other; one thread each
(max_threads=1), since the workers are already the parallelism. Each pass still reads every byte once; the
cost moves off the sender's and the receiver's critical path. The scheduling decisions (which bytes fall in
which block, what to hash ahead, what to release) are relay.pipeline's, pure and unit-tested.
"""

from __future__ import annotations

import hmac
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import blake3

from laminar.errors import RelayError
from laminar.relay.pipeline import Blocks, InOrder, may_feed, window

# Hashing threads per sender or receiver: half the cores, at most 4 (one is plenty on 2 cores: the socket's thread
# and one hashing thread each have a core; more only take turns).
WORKERS = max(1, min(4, (os.cpu_count() or 2) // 2))
FEED_BYTES = 1 << 20  # pieces of a block are handed to its worker in batches of at least this (or the block's end)
AHEAD_BYTES = 8 << 20  # the receive runs at most this far ahead of the hashing (pipeline.may_feed)
MAC_HINT = ("altered, replayed or reordered in transit, or the peer holds another run token; the connection is "
            "dropped and these bytes are not used")


def tagger(data_key: bytes) -> Any:
    """A fresh payload tag hasher (update(), hexdigest()): keyed BLAKE3, 32 bytes (64 hex characters)."""
    return blake3.blake3(key=data_key, max_threads=1)


def tag(data_key: bytes, data: bytes | bytearray | memoryview) -> str:
    """The payload tag of `data`: keyed BLAKE3 under the run's data key, in hex."""
    return blake3.blake3(data, key=data_key, max_threads=1).hexdigest()


class TagAhead:
    """The tags of `view`'s blocks of block_bytes, hashed on `workers` threads up to `depth` blocks ahead of the
    block the sender takes; tag(i) returns block i's (blocking until it is hashed). close() when done."""

    def __init__(self, data_key: bytes, view: memoryview, block_bytes: int, *, workers: int = WORKERS,
                 depth: int | None = None) -> None:
        self._key, self._view, self._block_bytes = data_key, view, block_bytes
        self._n = -(-len(view) // block_bytes)
        self._depth = depth or 2 * workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="relay-tag-ahead")
        self._futures: list[Future[str]] = []

    def _tag(self, index: int) -> str:
        start = index * self._block_bytes
        return tag(self._key, self._view[start:start + self._block_bytes])

    def tag(self, index: int) -> str:
        for j in window(index, len(self._futures), self._n, self._depth):
            self._futures.append(self._pool.submit(self._tag, j))
        return self._futures[index].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> TagAhead:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


_STOP = None


class TagCheck:
    """Checks payload tags on `workers` threads while the caller goes on reading.

    For each payload: expect(tags, tag_bytes, n_bytes, what), then update(piece) with its bytes in order as they
    land (views that stay valid and unchanged until wait() or abort()). wait() returns once every block is
    checked, or raises RelayError for the first that failed; update() raises it as soon as it is known.
    on_block(block, tag, note) is called for each checked block in order (from a worker thread, one call at a
    time); with noted=True a block is handed on only once the caller also gave its note(block, value) too (a
    relay's running digest d_i of that chunk). abort() stops the workers; nothing is handed on after it.
    """

    def __init__(self, data_key: bytes, *, workers: int = WORKERS,
                 on_block: Callable[[int, str, Any], None] | None = None, noted: bool = False,
                 ahead_bytes: int = AHEAD_BYTES) -> None:
        self._key = data_key
        self._ahead_bytes = ahead_bytes
        self._fed = 0  # bytes handed to workers
        self._hashed = 0  # of those, bytes hashed (or dropped by a stopped check)
        self._progress = threading.Condition()
        self._blocks = Blocks()
        self._expected: list[tuple[str, int, int, str]] = []  # per block: tag, start in its payload, tag_bytes, what
        self._order = InOrder(("tag", "note") if noted else ("tag",))
        self._on_block = on_block
        self._lock = threading.Lock()
        self._error: RelayError | None = None
        self._stopped = False
        self._batch: list[memoryview] = []
        self._batch_bytes = 0
        self._queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(workers)]
        self._threads = [threading.Thread(target=self._work, args=(q,), name="relay-tag-check", daemon=True)
                         for q in self._queues]
        for t in self._threads:
            t.start()

    def expect(self, tags: list[Any], tag_bytes: int, n_bytes: int, what: str) -> None:
        blocks = self._blocks.expect(n_bytes, tag_bytes)
        if len(blocks) != len(tags):
            raise RelayError(f"{what}: {len(tags)} tags for {len(blocks)} blocks of {tag_bytes} bytes")
        self._expected.extend((tag, j * tag_bytes, tag_bytes, what) for j, tag in enumerate(tags))

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._raise()
        view = memoryview(data).cast("B")
        for block, start, end, ends in self._blocks.feed(len(view)):
            self._batch.append(view[start:end])
            self._batch_bytes += end - start
            if ends or self._batch_bytes >= FEED_BYTES:
                self._hand(block, ends)

    def _hand(self, block: int, ends: bool) -> None:
        """Give the batch to block's worker, once the workers are within ahead_bytes of the bytes handed."""
        with self._progress:
            while not may_feed(self._fed, self._hashed, self._ahead_bytes):
                if self._stopped or self._error is not None:
                    break
                self._progress.wait(1.0)  # a worker notifies after each batch; the timeout only re-checks
            self._fed += self._batch_bytes
        self._raise()
        self._queues[block % len(self._queues)].put((block, self._batch, ends, self._batch_bytes))
        self._batch, self._batch_bytes = [], 0

    def note(self, block: int, value: Any) -> None:
        """The caller's part of `block` (noted=True): it is handed on once its tag is checked too."""
        with self._lock:
            self._release(self._order.add(block, "note", value))

    @property
    def error(self) -> RelayError | None:
        return self._error

    def wait(self) -> None:
        """Every block fed is checked (and handed on); RelayError for the first failure."""
        if self._blocks.filled != self._blocks.expected:
            self.abort()
            raise RelayError(f"payload tag check: {self._blocks.expected - self._blocks.filled} block(s) not "
                             "received in full")
        self._join()
        self._raise()

    def abort(self) -> None:
        """Stop: the workers finish the piece in hand and exit; nothing more is handed on."""
        with self._lock:
            self._stopped = True
        with self._progress:
            self._progress.notify_all()
        self._join()

    def _join(self) -> None:
        for q in self._queues:
            q.put(_STOP)
        for t in self._threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join()
        self._batch = []

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _work(self, q: queue.SimpleQueue[Any]) -> None:
        hashers: dict[int, Any] = {}
        while (item := q.get()) is not _STOP:
            block, views, ends, n = item
            try:
                if self._stopped or self._error is not None:
                    continue  # drain: a failed or aborted check hashes nothing more
                hasher = hashers.get(block)
                if hasher is None:
                    hasher = hashers[block] = tagger(self._key)
                for v in views:
                    hasher.update(v)
                if ends:
                    self._checked(block, hashers.pop(block).hexdigest())
            except Exception as exc:  # noqa: BLE001 - a worker that dies must fail the check, never pass it
                with self._lock:
                    if self._error is None:
                        self._error = RelayError(f"payload tag check failed: {exc!r}")
            finally:
                with self._progress:
                    self._hashed += n
                    self._progress.notify_all()

    def _checked(self, block: int, got: str) -> None:
        want, start, tag_bytes, what = self._expected[block]
        with self._lock:
            if self._stopped or self._error is not None:
                return
            if not isinstance(want, str) or not hmac.compare_digest(got, want):
                self._error = RelayError(f"{what}: bytes {start}..{start + tag_bytes} failed their MAC check: "
                                         f"{MAC_HINT}")
                return
            self._release(self._order.add(block, "tag", got))

    def _release(self, ready: list[tuple[int, dict[str, Any]]]) -> None:
        """Hand on released blocks, in order (the caller holds the lock)."""
        if self._on_block is None or self._stopped or self._error is not None:
            return
        for block, parts in ready:
            self._on_block(block, parts["tag"], parts.get("note"))
