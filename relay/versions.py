"""The versions a relay holds: the newest `keep_versions` complete policy versions, in shared memory.

A `Version` starts receiving when a put's header arrives; its chunks land in its segment in order and
the forwarder may send chunk i downstream as soon as it is there. Only after the last chunk and the
whole-version digest check does the store admit it, and only admitted versions are ever served.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from laminar.errors import RelayError
from relay.segments import Segment

RECEIVING, COMPLETE, FAILED = "receiving", "complete", "failed"


class UpstreamFailedError(RelayError):
    """The version being forwarded stopped arriving (its sender died or it failed verification)."""


class Version:
    """One policy version in a segment: receiving chunk by chunk, then complete (or failed)."""

    def __init__(self, policy_version: int, run: str, segment: Segment, chunk_bytes: int,
                 digest: str | None = None) -> None:
        if chunk_bytes <= 0:
            raise RelayError(f"chunk_bytes={chunk_bytes} must be positive")
        self.policy_version = policy_version
        self.run = run
        self.segment = segment
        self.generation = segment.generation  # a reused segment's bytes are this version's only in this one
        self.size = segment.size
        self.chunk_bytes = chunk_bytes
        self.digest = digest  # expected digest (protocol.digest_hex); known from the put header or the end frame
        self.n_chunks = -(-self.size // chunk_bytes)
        self.digests: list[str] = []  # d_i of every chunk landed and checked so far (protocol.RunningDigest)
        self.state = RECEIVING
        self.error: str | None = None
        self.completed_at: float | None = None  # wall clock (time.time()) when it became servable
        self._cond = threading.Condition()

    @property
    def payload(self) -> memoryview:
        return self.segment.view

    def chunk_view(self, index: int) -> memoryview:
        start = index * self.chunk_bytes
        return self.segment.view[start:min(start + self.chunk_bytes, self.size)]

    def chunk_offset(self, index: int) -> int:
        return index * self.chunk_bytes

    def chunk_landed(self, index: int, digest: str) -> None:
        with self._cond:
            if index != len(self.digests):
                raise RelayError(f"policy_version {self.policy_version}: chunk {index} arrived out of order "
                                 f"(expected {len(self.digests)})")
            self.digests.append(digest)
            self._cond.notify_all()

    def complete(self, digest: str) -> None:
        with self._cond:
            self.digest = digest
            self.state = COMPLETE
            self.completed_at = time.time()
            self._cond.notify_all()

    def fail(self, reason: str) -> None:
        with self._cond:
            if self.state == RECEIVING:
                self.state, self.error = FAILED, reason
                self._cond.notify_all()

    def wait_chunk(self, index: int, timeout_s: float) -> tuple[memoryview, str]:
        """Chunk `index` and its d_i once it has landed; UpstreamFailedError if it never will."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.digests) > index or self.state == FAILED, timeout_s):
                raise UpstreamFailedError(f"policy_version {self.policy_version}: chunk {index} did not arrive "
                                          f"within {timeout_s} s")
            if len(self.digests) <= index:
                raise UpstreamFailedError(f"policy_version {self.policy_version} failed upstream: {self.error}")
            digest = self.digests[index]
        return self.chunk_view(index), digest

    def wait_complete(self, timeout_s: float) -> str:
        """The verified digest once the version is complete; UpstreamFailedError if it fails."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.state != RECEIVING, timeout_s):
                raise UpstreamFailedError(f"policy_version {self.policy_version} did not complete within "
                                          f"{timeout_s} s")
            if self.state == FAILED:
                raise UpstreamFailedError(f"policy_version {self.policy_version} failed upstream: {self.error}")
            assert self.digest is not None
            return self.digest


@dataclass
class PutOutcome:
    """What admitting a complete version did: stored as newest, the newest held, replaced or duplicate."""

    stored: bool
    newest: int | None
    replaced: bool = False  # same policy_version, new bytes (a restarted trainer re-published it)
    stale: bool = False  # older than the newest held: not stored


class VersionStore:
    """The newest `keep_versions` complete versions, oldest first; thread-safe.

    A held version it drops (evicted, replaced, or of another run) goes to `retire` (the relay's
    SparePool, which reuses or unlinks its segment); a version it never stored (stale, or the same bytes
    again, which the forwarder may still be sending) is unlinked.
    """

    def __init__(self, keep_versions: int, retire: Callable[[Segment], object] = Segment.unlink) -> None:
        self._keep = keep_versions
        self._retire = retire
        self._lock = threading.Lock()
        self._versions: OrderedDict[int, Version] = OrderedDict()
        self.run = ""  # the run whose versions are held; version numbers are per run

    def put(self, version: Version) -> PutOutcome:
        """Admit a complete version; a version for another run first drops everything held."""
        dropped: list[Version] = []  # held versions let go
        unstored: list[Version] = []  # this version, when it is not stored
        with self._lock:
            try:
                if version.run != self.run:
                    dropped.extend(self._versions.values())
                    self._versions.clear()
                    self.run = version.run
                newest = next(reversed(self._versions), None)
                if newest is not None and version.policy_version < newest:
                    unstored.append(version)
                    return PutOutcome(stored=False, newest=newest, stale=True)
                if newest is not None and version.policy_version == newest:
                    held = self._versions[newest]
                    if held.digest != version.digest:
                        # A restarted trainer recomputed this version from its checkpoint (replay need not be
                        # bit-identical): the newest bytes win, so every relay converges.
                        self._versions[newest] = version
                        dropped.append(held)
                        return PutOutcome(stored=True, newest=newest, replaced=True)
                    unstored.append(version)  # same bytes again: a re-broadcast
                    return PutOutcome(stored=False, newest=newest)
                self._versions[version.policy_version] = version
                while len(self._versions) > self._keep:
                    dropped.append(self._versions.popitem(last=False)[1])
                return PutOutcome(stored=True, newest=version.policy_version)
            finally:
                for old in unstored:
                    old.segment.unlink()
                for old in dropped:
                    self._retire(old.segment)

    def clear(self) -> None:
        with self._lock:
            for held in self._versions.values():
                held.segment.unlink()
            self._versions.clear()

    def newest(self, run: str | None = None) -> Version | None:
        with self._lock:
            if run is not None and run != self.run:
                return None
            return self._versions[next(reversed(self._versions))] if self._versions else None

    def get(self, policy_version: int, run: str | None = None) -> Version | None:
        with self._lock:
            if run is not None and run != self.run:
                return None
            return self._versions.get(policy_version)

    def summary(self) -> tuple[list[int], int]:
        with self._lock:
            return list(self._versions), sum(v.size for v in self._versions.values())

    def completed_at(self) -> dict[int, float | None]:
        with self._lock:
            return {n: v.completed_at for n, v in self._versions.items()}
