"""The versions a relay holds: the newest `keep_versions` complete policy versions, in memory."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class Version:
    """One complete, verified policy version: its number, checksum and opaque payload bytes."""

    policy_version: int
    sha256: str
    payload: bytes
    run: str = ""  # the run this version belongs to; version numbers are per run


@dataclass
class PutOutcome:
    """What a put did: stored as newest, to be forwarded, the newest held, or why it was refused."""

    stored: bool
    forward: bool
    newest: int | None
    error: str | None = None
    replaced: bool = False  # same policy_version, new bytes (a restarted trainer re-published it)


class VersionStore:
    """The newest `keep_versions` complete versions, oldest first; thread-safe."""

    def __init__(self, keep_versions: int) -> None:
        self._keep = keep_versions
        self._lock = threading.Lock()
        self._versions: OrderedDict[int, Version] = OrderedDict()

    def put(self, version: Version) -> PutOutcome:
        with self._lock:
            newest = next(reversed(self._versions), None)
            if newest is not None and version.policy_version < newest:
                return PutOutcome(stored=False, forward=False, newest=newest)
            if newest is not None and version.policy_version == newest:
                held = self._versions[newest]
                if held.sha256 != version.sha256:
                    # A restarted trainer recomputed this version from its checkpoint (replay need not be
                    # bit-identical): the newest bytes win and are forwarded, so every relay converges.
                    self._versions[newest] = version
                    return PutOutcome(stored=True, forward=True, newest=newest, replaced=True)
                # Same bytes again: a re-broadcast (e.g. after the chain was rebuilt); pass it on.
                return PutOutcome(stored=False, forward=True, newest=newest)
            self._versions[version.policy_version] = version
            while len(self._versions) > self._keep:
                self._versions.popitem(last=False)
            return PutOutcome(stored=True, forward=True, newest=version.policy_version)

    def clear(self) -> None:
        with self._lock:
            self._versions.clear()

    def newest(self) -> Version | None:
        with self._lock:
            return self._versions[next(reversed(self._versions))] if self._versions else None

    def get(self, policy_version: int) -> Version | None:
        with self._lock:
            return self._versions.get(policy_version)

    def summary(self) -> tuple[list[int], int]:
        with self._lock:
            return list(self._versions), sum(len(v.payload) for v in self._versions.values())
