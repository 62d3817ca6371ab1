"""A local store's temp files do not accumulate: a writer killed mid-write leaves its `.tmp-` file, which readers
never see and the next list() of its directory removes, while the temp file of a write in progress is kept however
old it is. Real writer processes; the write is held between its bytes and its rename by holding the child's fsync."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from laminar.storage.objects import _HOST, STALE_TMP_S, LocalObjectStore, _remove_if_stale
from tests.fixtures.waiting import wait_until

WRITER = """
import os, sys, time
from laminar.storage.objects import LocalObjectStore
os.fsync = lambda fd: time.sleep(3600)  # the bytes are written; the write waits here, before its rename
LocalObjectStore(sys.argv[1]).put("runs/r1/big.bin", b"x" * 1_000_000)
"""


def _temps(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name.startswith(".tmp-")) if d.is_dir() else []


def _age(p: Path, seconds: float) -> None:
    t = time.time() - seconds
    os.utime(p, (t, t))


def test_a_killed_writer_leaves_a_temp_file_the_next_list_removes_and_a_live_write_keeps_its_own(tmp_path):
    store = LocalObjectStore(tmp_path)
    store.put("runs/r1/a.json", b"{}")
    d = tmp_path / "runs" / "r1"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)],
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        wait_until(lambda: any(p.stat().st_size == 1_000_000 for p in _temps(d)), 30, "the writer's bytes")
        (tmp,) = _temps(d)
        assert tmp.name.startswith(".tmp-big.bin~") and f"~{writer.pid}~" in tmp.name
        assert store.list("runs/r1/") == ["runs/r1/a.json"] and _temps(d) == [tmp]  # a write in progress
        # looked at long after the stale window: its writer runs, so it is still a write in progress
        assert not _remove_if_stale(tmp, now=time.time() + 2 * STALE_TMP_S) and _temps(d) == [tmp]
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=10)
        assert _temps(d) == [tmp]  # the kill leaves it behind
        assert store.list("runs/") == ["runs/r1/a.json"]  # the next list walking its directory removes it
        assert _temps(d) == []
    finally:
        writer.kill()
        writer.wait()


def test_temp_files_of_writers_not_seen_from_here_go_only_when_old_and_a_reused_pid_is_not_the_writer(tmp_path):
    store = LocalObjectStore(tmp_path)
    store.put("k/a", b"1")
    d = tmp_path / "k"
    other = d / ".tmp-b~another-host~4242~abcd1234"  # a writer on a host sharing the directory
    legacy = d / ".tmp-c.abcd1234"  # named before the writer was recorded
    reused = d / f".tmp-e~{_HOST}~{os.getpid()}~abcd1234"  # this host's pid, but a process started after the file
    for p in (other, legacy, reused):
        p.write_bytes(b"partial")
    _age(reused, time.time() - psutil.Process().create_time() + 60)
    assert store.list("k/") == ["k/a"]
    assert _temps(d) == [other, legacy]  # recent: their writers may still be writing
    _age(other, STALE_TMP_S + 60)
    _age(legacy, STALE_TMP_S + 60)
    assert store.list("k/") == ["k/a"] and _temps(d) == []
    assert store.get("k/a") == b"1"
