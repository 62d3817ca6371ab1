"""Shared-memory segments: one file under /dev/shm per held version, mapped by the relay and its readers.

Lifetime rule. The relay creates a segment (mode 0600: only the relay's user can map it) when a put
starts, fills it as chunks land, and serves it once the whole version is verified; from then on the
bytes never change (a re-published version gets a new segment). The relay unlinks a segment when the
version is evicted (more than keep_versions newer ones), replaced, abandoned half-way, or when the relay
stops. Unlinking only removes the name: a reader that has mapped the segment keeps valid bytes until it
unmaps (POSIX), so a rollout never sees weights change under it. A reader that opens a name after it
was unlinked gets RelayError and asks the relay again.

Plain files plus mmap are used instead of multiprocessing.shared_memory so that no resource_tracker
registers (and double-unlinks) segments that belong to another process.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import re
import secrets
import threading
import weakref
from pathlib import Path

import psutil

from laminar.errors import RelayError

DEFAULT_SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "lmr-"


def segment_name(relay_id: str, run: str, policy_version: int) -> str:
    """A unique file name: owner pid, relay, run (hashed), version, random suffix (re-publishes never clash)."""
    rid = re.sub(r"[^A-Za-z0-9_.-]", "_", relay_id)[:40]
    run_tag = hashlib.sha256(run.encode()).hexdigest()[:8]
    return f"{SEGMENT_PREFIX}{os.getpid()}-{rid}-{run_tag}-v{policy_version}-{secrets.token_hex(4)}"


def sweep_orphans(directory: str | os.PathLike[str]) -> list[str]:
    """Unlink segments whose owning relay process no longer exists (it was killed); returns their names.

    A relay unlinks its own segments when it stops; one killed by SIGKILL cannot, so every relay sweeps
    the host's leftovers when it starts.
    """
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = re.match(rf"{SEGMENT_PREFIX}(\d+)-", name)
        if m is None or psutil.pid_exists(int(m.group(1))):
            continue
        try:
            os.unlink(Path(directory) / name)
            removed.append(name)
        except OSError:
            pass
    return removed


class Segment:
    """A writable shared-memory segment owned by a relay; `view` is a memoryview over its bytes.

    `fd` stays open for the segment's whole life (also after unlink), so the relay can send its bytes
    with sendfile(2) straight from the page cache; it is closed when the Segment is collected.
    """

    def __init__(self, directory: str | os.PathLike[str], name: str, size: int) -> None:
        self.path = Path(directory) / name
        self.size = size
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise RelayError(f"creating shared-memory segment {self.path} ({size} bytes) failed: {exc}; "
                             f"check that {directory} exists and has room") from exc
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size) if size else None
        except OSError as exc:
            os.close(fd)
            self.unlink()
            raise RelayError(f"sizing shared-memory segment {self.path} to {size} bytes failed: {exc}; "
                             f"{directory} may be full") from exc
        self.fd = fd
        weakref.finalize(self, os.close, fd)
        self.view = memoryview(self._map) if self._map is not None else memoryview(b"")
        self.generation = 0  # bumped each time the segment is reused for another version (SparePool)
        self._lock = threading.Lock()
        self._users = 0  # the relay's own readers (forwarder, TCP sends) of the current generation
        self._retired = False

    def acquire(self, generation: int) -> bool:
        """Pin the bytes of `generation` for a relay-side reader; False if they are gone (retired or reused)."""
        with self._lock:
            if self._retired or generation != self.generation:
                return False
            self._users += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._users -= 1

    def unlink(self) -> None:
        """Remove the name; mappings (ours, readers') and pins (acquire) stay valid until dropped."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class SparePool:
    """Segments of dropped versions, kept to be written again: a new version received into a spare takes
    no page faults. A fresh tmpfs page is allocated and zeroed by the kernel on first touch, which costs
    about as much CPU as the receive itself (docs/relay.md, "Copies per byte").

    A segment is reused only when nobody can see its bytes change: `retire` first renames it away (its
    version's name is gone, so no new reader can open it), then takes an exclusive flock(2) on it. Every
    reader holds a shared flock for as long as it has the segment open or mapped (open_readonly; the
    mapping's own dup of the fd keeps the lock until unmapped), so the exclusive lock fails while any
    reader still maps it, and then the segment is simply unlinked and left to that reader, as before.
    The relay's own readers (forwarder, TCP sends) pin it with Segment.acquire. `limit` bounds the spares.
    """

    def __init__(self, directory: str | os.PathLike[str], limit: int = 2) -> None:
        self.directory = Path(directory)
        self.limit = limit
        self._lock = threading.Lock()
        self._spares: list[Segment] = []

    def retire(self, segment: Segment) -> bool:
        """Take a dropped version's segment as a spare (True) or unlink it (False)."""
        with segment._lock:
            reusable = self.limit > 0 and segment.size > 0 and segment._users == 0 and not segment._retired
            segment._retired = True  # from now on no relay-side reader pins the old generation
        spare = self.directory / f"{SEGMENT_PREFIX}{os.getpid()}-spare-{secrets.token_hex(4)}"
        if reusable:
            try:
                os.rename(segment.path, spare)
            except OSError:
                reusable = False
        if reusable:
            segment.path = spare
            try:
                fcntl.flock(segment.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # a reader still has it mapped: its bytes must not change
                reusable = False
        if not reusable:
            segment.unlink()
            return False
        with self._lock:
            self._spares.append(segment)
            dropped = self._spares[:-self.limit] if len(self._spares) > self.limit else []
            del self._spares[:len(dropped)]
        for old in dropped:
            old.unlink()
        return True

    def take(self, name: str, size: int) -> Segment | None:
        """A spare of exactly `size` bytes renamed to `name`, ready to be written; None if there is none."""
        with self._lock:
            found = next((seg for seg in self._spares if seg.size == size), None)
            if found is None:
                return None
            self._spares.remove(found)
        target = self.directory / name
        try:
            os.rename(found.path, target)
        except OSError:
            found.unlink()
            return None
        found.path = target
        with found._lock:
            found.generation += 1
            found._retired = False
        fcntl.flock(found.fd, fcntl.LOCK_UN)  # readers may lock it again once the version is served
        return found

    def clear(self) -> None:
        with self._lock:
            spares, self._spares = self._spares, []
        for seg in spares:
            seg.unlink()


class Mapped:
    """A relay segment opened read-only by a reader: `view` maps it lazily, `readinto` copies with pread."""

    def __init__(self, path: str, fd: int, size: int) -> None:
        self.path, self.size, self._fd = path, size, fd
        self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) if size else None
        self.view = memoryview(self._map) if self._map is not None else memoryview(b"")

    def readinto(self, dest: memoryview, offset: int) -> None:
        """Copy len(dest) bytes from `offset` straight into dest (one kernel copy, no page-table set-up)."""
        done = 0
        while done < len(dest):
            n = os.preadv(self._fd, [dest[done:]], offset + done)
            if n <= 0:
                raise RelayError(f"reading {self.path} at {offset + done} returned {n}: the segment is shorter "
                                 f"than the relay said ({self.size} bytes)")
            done += n

    def close(self) -> None:
        """Unmap and close; while views of `view` are still exported the unmap waits for the collector."""
        try:
            self.view.release()
            if self._map is not None:
                self._map.close()
        except BufferError:
            pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def open_readonly(path: str, size: int) -> Mapped:
    """Open and map a relay's segment read-only; RelayError if it is gone or not a relay segment."""
    name = os.path.basename(path)
    if not name.startswith(SEGMENT_PREFIX) or name != os.path.basename(os.path.normpath(path)):
        raise RelayError(f"relay named segment {path!r}, which is not a relay segment ({SEGMENT_PREFIX}*)")
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise RelayError(f"shared-memory segment {path} is gone (the relay evicted that version); "
                         "ask the relay again") from None
    except OSError as exc:
        raise RelayError(f"opening shared-memory segment {path} failed: {exc}; the reader must run on the "
                         "relay's host as the relay's user") from exc
    try:
        try:  # shared lock, held while the segment is open or mapped: the relay never reuses it meanwhile
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            raise RelayError(f"shared-memory segment {path} is being reused by the relay (that version was "
                             "evicted); ask the relay again") from None
        stat = os.fstat(fd)
        try:
            same = os.stat(path).st_ino == stat.st_ino
        except FileNotFoundError:
            same = False
        if not same:  # renamed away (evicted) between our open and our lock
            raise RelayError(f"shared-memory segment {path} is gone (the relay evicted that version); "
                             "ask the relay again")
        if stat.st_size != size:
            raise RelayError(f"shared-memory segment {path} holds {stat.st_size} bytes, the relay said {size}")
        return Mapped(path, fd, size)
    except BaseException:
        os.close(fd)
        raise
