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
    (A reader's kept mapping, ReaderMappings, holds no lock: it is read only during a pull, under the lock.)
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


READER_MAPPINGS = 4  # segments a reader keeps mapped between pulls: a relay rotates keep_versions (2) + spares (2)
COPY_PIECE = 16 << 20  # one memcpy of 256 MiB out of a shmem mapping ran 2.5x slower here than pieces of <= 32 MiB


class _Kept:
    """A read-only mapping of one segment, through an open file of its own that never takes a flock."""

    def __init__(self, key: tuple[int, int], fd: int, size: int) -> None:
        self.key, self.fd, self.size = key, fd, size
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # every page table entry now, in one call
        self.map = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
        self.users = 0

    def linked(self) -> bool:
        return os.fstat(self.fd).st_nlink > 0

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class ReaderMappings:
    """Mappings of relay segments a reader keeps from one pull to the next, so copying a version out of a
    segment the relay reused (SparePool) touches no page it has not mapped already.

    A fresh mapping pays a page fault (or a page-table entry) per 4-KiB page: 65,536 per 256 MiB, which
    took the local pull from ~memcpy speed to 40-60 % of it here. The relay rotates its versions through
    the same few segments, so a reader that keeps its mappings finds each new version in pages it has
    already mapped. The kept mapping is made through a second open file of the segment that holds no lock:
    it never stops the relay from reusing the segment. Its bytes are read only while a LocalPull holds
    the shared flock (Mapped), so they never change under a copy. A kept mapping of a segment the relay
    unlinked (evicted without reuse, relay stopped) would pin its memory: every open_readonly drops
    those first, and at most `limit` mappings are kept (least recently used go first); `clear` drops all.
    """

    def __init__(self, limit: int = READER_MAPPINGS) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._kept: dict[tuple[int, int], _Kept] = {}  # insertion order = least recently used first

    def acquire(self, locked_fd: int, stat: os.stat_result, size: int) -> _Kept | None:
        """The kept mapping of the segment open (and share-locked) as locked_fd, made if new; None if
        mapping fails. Release it with `release` before the lock is dropped."""
        key = (stat.st_dev, stat.st_ino)
        with self._lock:
            stale = [k for k, kept in self._kept.items() if kept.users == 0 and (k == key and kept.size != size
                                                                                or not kept.linked())]
            for k in stale:
                self._kept.pop(k).close()
            kept = self._kept.pop(key, None)
            if kept is not None:
                self._kept[key] = kept  # most recently used
                if kept.size != size:  # in use at another size (a relay never resizes a segment): pread
                    return None
                kept.users += 1
                return kept
        try:  # /proc/self/fd reopens the file: a new open file description, which holds no flock
            fd = os.open(f"/proc/self/fd/{locked_fd}", os.O_RDONLY)
        except OSError:
            return None
        try:
            kept = _Kept(key, fd, size)
        except (OSError, ValueError):
            os.close(fd)
            return None
        with self._lock:
            if key in self._kept:  # another thread mapped it meanwhile: use theirs
                kept.close()
                kept = self._kept.pop(key)
            self._kept[key] = kept
            if kept.size != size:
                return None
            kept.users += 1
            spare = [k for k, other in self._kept.items() if other.users == 0]
            for k in spare[:max(0, len(self._kept) - self.limit)]:
                self._kept.pop(k).close()
        return kept

    def release(self, kept: _Kept) -> None:
        with self._lock:
            kept.users -= 1
            if kept.users == 0 and self._kept.get(kept.key) is not kept:  # dropped while in use
                kept.close()

    def clear(self) -> None:
        """Unmap every kept mapping not in use (a reader that stops pulling frees the memory it pins)."""
        with self._lock:
            idle = [k for k, kept in self._kept.items() if kept.users == 0]
            for k in idle:
                self._kept.pop(k).close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def __contains__(self, path: str | os.PathLike[str]) -> bool:
        """Whether the segment now at `path` is kept mapped."""
        stat = os.stat(path)
        with self._lock:
            return (stat.st_dev, stat.st_ino) in self._kept


reader_mappings = ReaderMappings()  # this process's; relay.client.pull_local uses it


class Mapped:
    """A relay segment opened read-only by a reader, share-locked until closed: `view` maps it lazily,
    `readinto` copies out of the reader's kept mapping of the segment (ReaderMappings, taken at the
    first readinto, so a reader of `view` alone keeps nothing), or with pread."""

    def __init__(self, path: str, fd: int, size: int, stat: os.stat_result | None = None,
                 mappings: ReaderMappings | None = None) -> None:
        self.path, self.size, self._fd = path, size, fd
        self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) if size else None
        self.view = memoryview(self._map) if self._map is not None else memoryview(b"")
        self._stat, self._mappings = stat, (mappings if size and stat is not None else None)
        self._kept: _Kept | None = None
        self._source: memoryview | None = None
        self._lock = threading.Lock()

    def _kept_source(self) -> memoryview | None:
        with self._lock:
            if self._fd < 0:
                raise RelayError(f"shared-memory segment {self.path} was read after its LocalPull was closed")
            if self._source is None and self._mappings is not None:
                self._kept = self._mappings.acquire(self._fd, self._stat, self.size)
                if self._kept is None:
                    self._mappings = None  # could not map: pread from now on
                else:
                    self._source = memoryview(self._kept.map)
            return self._source

    def readinto(self, dest: memoryview, offset: int) -> None:
        """Copy len(dest) bytes from `offset` straight into dest: one memcpy from the kept mapping (in
        pieces of COPY_PIECE), or without one, one kernel copy (pread)."""
        if dest.format != "B" or dest.ndim != 1:
            dest = dest.cast("B")
        if offset < 0 or offset + len(dest) > self.size:
            raise RelayError(f"reading {len(dest)} bytes of {self.path} at {offset}: past its {self.size} bytes")
        source = self._kept_source()
        if source is not None:
            for done in range(0, len(dest), COPY_PIECE):
                n = min(COPY_PIECE, len(dest) - done)
                dest[done:done + n] = source[offset + done:offset + done + n]
            return
        done = 0
        while done < len(dest):
            n = os.preadv(self._fd, [dest[done:]], offset + done)
            if n <= 0:
                raise RelayError(f"reading {self.path} at {offset + done} returned {n}: the segment is shorter "
                                 f"than the relay said ({self.size} bytes)")
            done += n

    def close(self) -> None:
        """Unmap and close; while views of `view` are still exported the unmap (and with it the shared
        flock) waits for the collector. The kept mapping stays with the reader's ReaderMappings."""
        with self._lock:
            if self._source is not None:
                self._source.release()
                self._source = None
                self._mappings.release(self._kept)
                self._kept = None
        try:
            self.view.release()
            if self._map is not None:
                self._map.close()
        except BufferError:
            pass
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def open_readonly(path: str, size: int, mappings: ReaderMappings | None = reader_mappings) -> Mapped:
    """Open and map a relay's segment read-only; RelayError if it is gone or not a relay segment.

    With `mappings` (default: this process's), reads go through the reader's kept mapping of the segment;
    None: a mapping of this pull only, and `readinto` reads with pread."""
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
        return Mapped(path, fd, size, stat, mappings)
    except BaseException:
        os.close(fd)
        raise
