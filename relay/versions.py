"""The versions a relay holds: per run, the newest `keep_versions` complete policy versions, in shared memory.

Several runs share one worker set, so a relay holds versions keyed by (run, policy_version). Memory is
bounded per run (`keep_versions`) and in total (`max_bytes`); a run with no get or put for `idle_evict_s`
is finished (or gone) as far as the relay knows, and its versions are dropped.

A `Version` starts receiving when a put's header arrives; its chunks land in its segment in order and
the forwarder may send chunk i downstream as soon as it is there. Only after the last chunk and the
whole-version digest check does the store admit it, and only admitted versions are ever served.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from laminar.errors import RelayError
from laminar.relay.segments import Segment

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
        self.tags: list[str | None] = []  # each chunk's checked payload tag (protocol.Session; None: no run token)
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

    def chunk_landed(self, index: int, digest: str, tag: str | None = None) -> None:
        with self._cond:
            if index != len(self.digests):
                raise RelayError(f"policy_version {self.policy_version}: chunk {index} arrived out of order "
                                 f"(expected {len(self.digests)})")
            self.tags.append(tag)
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

    def wait_chunk(self, index: int, timeout_s: float) -> tuple[memoryview, str, str | None]:
        """Chunk `index`, its d_i and its tag once it has landed; UpstreamFailedError if it never will."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self.digests) > index or self.state == FAILED, timeout_s):
                raise UpstreamFailedError(f"policy_version {self.policy_version}: chunk {index} did not arrive "
                                          f"within {timeout_s} s")
            if len(self.digests) <= index:
                raise UpstreamFailedError(f"policy_version {self.policy_version} failed upstream: {self.error}")
            digest, tag = self.digests[index], self.tags[index]
        return self.chunk_view(index), digest, tag

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
    evicted: list[tuple[str, int, str]] = field(default_factory=list)  # (run, policy_version, why) let go


@dataclass
class _Run:
    versions: OrderedDict[int, Version] = field(default_factory=OrderedDict)  # oldest first
    last_used: float = 0.0  # clock() at its last get or put
    stored_at: dict[int, float] = field(default_factory=dict)  # policy_version -> clock() when it was stored


EVICTED_LOG = 32  # evictions kept for the relay's stats


class VersionStore:
    """Per run, the newest `keep_versions` complete versions, oldest first; thread-safe.

    max_bytes: bound on the bytes held across all runs (0: none). When a put takes the total past it, the
    least recently used run's oldest versions go first; a run's newest version goes only once the run is
    idle (no get or put for `idle_evict_s`, below): a run always keeps its newest while it is live, even if
    that leaves the store over the bound (the relay logs it; `over_bytes()` says by how much).
    idle_evict_s: a run with no get or put for this long is dropped whole at the next put or `sweep()`
    (the relay cannot see a run end; a finished run stops asking). 0 disables idle eviction.
    retain_s: a version older than the newest `keep_versions` stays until it has been held this long (0: none), as
    long as max_bytes allows: a replica that resumes groups started on it (a departed replica's, a restarted one's
    pool) can still load it when versions come faster than it restarts.
    clock: monotonic seconds (injected by tests).

    A held version it drops (evicted, replaced, idle) goes to `retire` (the relay's SparePool, which
    reuses or unlinks its segment); a version it never stored (stale, or the same bytes again, which the
    forwarder may still be sending) is unlinked.
    """

    def __init__(self, keep_versions: int, retire: Callable[[Segment], object] = Segment.unlink, *,
                 max_bytes: int = 0, idle_evict_s: float = 0.0, retain_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if retain_s < 0:
            raise RelayError(f"retain_s={retain_s} must be 0 (keep only keep_versions) or positive seconds")
        self._retain_s = retain_s
        if keep_versions < 1:
            raise RelayError(f"keep_versions={keep_versions} must be at least 1 (the newest version)")
        if max_bytes < 0:
            raise RelayError(f"max_bytes={max_bytes} must be 0 (no bound) or a positive byte count")
        if idle_evict_s < 0:
            raise RelayError(f"idle_evict_s={idle_evict_s} must be 0 (never) or positive seconds")
        self._keep = keep_versions
        self._retire = retire
        self._max_bytes = max_bytes
        self._idle_s = idle_evict_s
        self._clock = clock
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}
        self.run = ""  # the run of the latest put (shown in stats); every run's versions are held
        self.evicted: list[tuple[str, int, str]] = []  # the last EVICTED_LOG evictions, oldest first

    # Under self._lock.

    def _idle(self, held: _Run, now: float) -> bool:
        return self._idle_s > 0 and now - held.last_used >= self._idle_s

    def _retained(self, held: _Run, number: int, now: float) -> bool:
        return self._retain_s > 0 and now - held.stored_at.get(number, now) < self._retain_s

    def _bytes(self) -> int:
        return sum(v.size for r in self._runs.values() for v in r.versions.values())

    def _evict(self, run: str, number: int, why: str, dropped: list[Version], out: list[tuple[str, int, str]]) -> None:
        held = self._runs[run]
        dropped.append(held.versions.pop(number))
        held.stored_at.pop(number, None)
        if not held.versions:
            del self._runs[run]
        out.append((run, number, why))

    def _sweep_idle(self, now: float, dropped: list[Version], out: list[tuple[str, int, str]]) -> None:
        for run, held in list(self._runs.items()):
            if self._idle(held, now):
                for number in list(held.versions):
                    self._evict(run, number, "idle", dropped, out)

    def _bound(self, dropped: list[Version], out: list[tuple[str, int, str]]) -> None:
        """Evict until the total fits max_bytes: versions older than a run's newest, least recently used run first.

        A run's newest version is never evicted for bytes; it goes only with the whole run, when idle.
        """
        if not self._max_bytes:
            return
        for run in sorted(self._runs, key=lambda r: self._runs[r].last_used):
            held = self._runs[run].versions
            while self._bytes() > self._max_bytes and len(held) > 1:
                self._evict(run, next(iter(held)), "bytes", dropped, out)

    def _log(self, out: list[tuple[str, int, str]]) -> None:
        self.evicted = (self.evicted + out)[-EVICTED_LOG:]

    def put(self, version: Version) -> PutOutcome:
        """Admit a complete version of its run; other runs' versions stay unless the bounds need room."""
        dropped: list[Version] = []  # held versions let go
        unstored: list[Version] = []  # this version, when it is not stored
        out: list[tuple[str, int, str]] = []
        with self._lock:
            try:
                now = self._clock()
                self._sweep_idle(now, dropped, out)
                self.run = version.run
                held = self._runs.setdefault(version.run, _Run())
                held.last_used = now
                versions = held.versions
                newest = next(reversed(versions), None)
                if newest is not None and version.policy_version < newest:
                    unstored.append(version)
                    return PutOutcome(stored=False, newest=newest, stale=True, evicted=out)
                if newest is not None and version.policy_version == newest:
                    old = versions[newest]
                    if old.digest != version.digest:
                        # A restarted trainer recomputed this version from its checkpoint (replay need not be
                        # bit-identical): the newest bytes win, so every relay converges.
                        versions[newest] = version
                        dropped.append(old)
                        self._bound(dropped, out)
                        return PutOutcome(stored=True, newest=newest, replaced=True, evicted=out)
                    unstored.append(version)  # same bytes again: a re-broadcast
                    return PutOutcome(stored=False, newest=newest, evicted=out)
                versions[version.policy_version] = version
                held.stored_at[version.policy_version] = now
                while len(versions) > self._keep and not self._retained(held, next(iter(versions)), now):
                    self._evict(version.run, next(iter(versions)), "keep_versions", dropped, [])
                self._bound(dropped, out)
                return PutOutcome(stored=True, newest=version.policy_version, evicted=out)
            finally:
                self._log(out)
                for old in unstored:
                    old.segment.unlink()
                for old in dropped:
                    self._retire(old.segment)

    def sweep(self) -> list[tuple[str, int, str]]:
        """Drop runs idle for idle_evict_s; returns what went, as (run, policy_version, "idle")."""
        dropped: list[Version] = []
        out: list[tuple[str, int, str]] = []
        with self._lock:
            self._sweep_idle(self._clock(), dropped, out)
            self._log(out)
        for old in dropped:
            self._retire(old.segment)
        return out

    def clear(self) -> None:
        with self._lock:
            for held in self._runs.values():
                for version in held.versions.values():
                    version.segment.unlink()
            self._runs.clear()

    def newest(self, run: str = "") -> Version | None:
        with self._lock:
            held = self._runs.get(run)
            if held is None or not held.versions:
                return None
            held.last_used = self._clock()
            return held.versions[next(reversed(held.versions))]

    def get(self, policy_version: int, run: str = "") -> Version | None:
        with self._lock:
            held = self._runs.get(run)
            if held is None:
                return None
            held.last_used = self._clock()
            return held.versions.get(policy_version)

    def summary(self, run: str | None = None) -> tuple[list[int], int]:
        """(versions of `run`, or of the latest put's run, oldest first; bytes held across all runs)."""
        with self._lock:
            held = self._runs.get(self.run if run is None else run)
            return (list(held.versions) if held else []), self._bytes()

    def runs(self) -> dict[str, dict[str, object]]:
        """Per run: versions held, their bytes, seconds since its last get or put."""
        with self._lock:
            now = self._clock()
            return {run: {"versions": list(h.versions), "bytes": sum(v.size for v in h.versions.values()),
                          "idle_s": round(now - h.last_used, 3)} for run, h in self._runs.items()}

    def over_bytes(self) -> int:
        """Bytes held beyond max_bytes (live runs' newest versions are never evicted); 0 when within."""
        with self._lock:
            return max(0, self._bytes() - self._max_bytes) if self._max_bytes else 0

    def completed_at(self, run: str | None = None) -> dict[int, float | None]:
        with self._lock:
            held = self._runs.get(self.run if run is None else run)
            return {n: v.completed_at for n, v in held.versions.items()} if held else {}
