"""The relay's version store holds several runs at once: per-run keep_versions, a total byte bound,
idle eviction of finished runs. Real segments in a temporary directory; a hand-driven clock."""

from __future__ import annotations

import pytest

from laminar.errors import RelayError
from laminar.relay import client
from laminar.relay.segments import Segment
from laminar.relay.server import RelayServer
from laminar.relay.versions import Version, VersionStore


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def make(tmp_path):
    def version(run: str, number: int, size: int, digest: str = "d") -> Version:
        v = Version(number, run, Segment(tmp_path, f"{run}-{number}-{digest}", size), chunk_bytes=size)
        v.complete(f"{digest}{number}")
        return v
    return version


def test_two_runs_keep_their_versions_side_by_side(make):
    retired: list[str] = []
    store = VersionStore(2, retire=lambda seg: retired.append(seg.path.name))
    for n in (0, 1, 2):
        assert store.put(make("a", n, 100)).stored
    assert store.put(make("b", 0, 50)).stored  # another run's version 0 drops nothing of run a
    assert store.get(0, "b") is not None and store.newest("a").policy_version == 2
    # keep_versions=2 is per run: a holds [1, 2] (0 went when 2 came), b holds [0].
    assert store.runs()["a"]["versions"] == [1, 2] and store.runs()["b"]["versions"] == [0]
    assert retired == ["a-0-d"]
    # 2 * 100 + 50 = 250 bytes across both runs; summary's list is the latest put's run (b).
    assert store.summary() == ([0], 250)
    assert store.summary("a") == ([1, 2], 250)
    assert store.get(1, "c") is None and store.newest("c") is None  # an unknown run sees nothing


def test_byte_bound_evicts_the_least_recently_used_runs_older_versions_first(make):
    clock = Clock()
    store = VersionStore(3, max_bytes=500, clock=clock)
    for n in (0, 1, 2):  # run a: 3 * 100 = 300 bytes at t=1000..1002
        store.put(make("a", n, 100))
        clock.now += 1
    store.put(make("b", 0, 100))  # 400 bytes, t=1003
    clock.now += 1
    store.newest("a")  # a polled at t=1004: now b is the least recently used run
    clock.now += 1
    out = store.put(make("b", 1, 150))  # 550 > 500, t=1005 (b is now the most recently used)
    # Least recently used first: a was used at 1004, b at 1005, so a's oldest (0, 100 bytes) goes: 450 <= 500.
    assert out.evicted == [("a", 0, "bytes")]
    assert store.runs()["a"]["versions"] == [1, 2] and store.runs()["b"]["versions"] == [0, 1]
    clock.now += 1
    out = store.put(make("b", 2, 200))  # 450 + 200 = 650; a (1004) older than b (1006)
    # a's 1 (100) -> 550, a's 2 would be a's newest: never for bytes; then b's 0 (100) -> 450 <= 500.
    assert out.evicted == [("a", 1, "bytes"), ("b", 0, "bytes")]
    assert store.summary("a") == ([2], 450) and store.summary("b") == ([1, 2], 450)
    assert store.over_bytes() == 0
    assert [e[:2] for e in store.evicted] == [("a", 0), ("a", 1), ("b", 0)]


def test_older_versions_are_retained_for_retain_s_within_the_byte_bound(make):
    clock = Clock()
    store = VersionStore(2, max_bytes=450, retain_s=60.0, clock=clock)
    for n in range(4):  # one version a second: 0..3 stored at t=1000..1003
        store.put(make("a", n, 100))
        clock.now += 1
    # keep_versions=2 would hold [2, 3]; 0 and 1 are younger than 60 s and 400 bytes <= 450: all four stay
    assert store.runs()["a"]["versions"] == [0, 1, 2, 3] and store.get(0, "a") is not None
    store.put(make("a", 4, 100))  # 500 > 450 at t=1004: the byte bound wins over retention, oldest first
    assert store.runs()["a"]["versions"] == [1, 2, 3, 4]
    clock.now = 1061.5  # version 1 (stored at 1001) is 60.5 s old, 2 (1002) 59.5 s: the next put lets 1 go only
    out = store.put(make("a", 5, 50))
    assert store.runs()["a"]["versions"] == [2, 3, 4, 5] and out.evicted == []  # (keep_versions evictions: not logged)
    with pytest.raises(RelayError, match="retain_s=-1"):
        VersionStore(2, retain_s=-1)


def test_live_runs_keep_their_newest_even_over_the_bound(make):
    store = VersionStore(2, max_bytes=250, clock=Clock())
    store.put(make("a", 0, 200))
    out = store.put(make("b", 0, 200))  # 400 > 250, but each run holds only its newest
    assert out.stored and out.evicted == []
    assert store.newest("a").policy_version == 0 and store.newest("b").policy_version == 0
    assert store.over_bytes() == 150  # 400 - 250, reported by the relay


def test_idle_runs_are_dropped_whole(make):
    clock = Clock()
    retired: list[str] = []
    store = VersionStore(2, retire=lambda seg: retired.append(seg.path.name), idle_evict_s=60, clock=clock)
    store.put(make("a", 0, 10))
    store.put(make("a", 1, 10))
    store.put(make("b", 0, 10))
    clock.now += 59
    store.newest("b")  # b polled at t=1059; a last used at t=1000
    assert store.sweep() == []  # a idle 59 s < 60
    clock.now += 1
    assert store.sweep() == [("a", 0, "idle"), ("a", 1, "idle")]  # a idle 60 s: finished
    assert retired == ["a-0-d", "a-1-d"]
    assert store.newest("a") is None and list(store.runs()) == ["b"]  # b idle 1 s stays
    clock.now += 60
    out = store.put(make("c", 0, 10))  # a put sweeps too: b idle 60 s
    assert out.evicted == [("b", 0, "idle")] and list(store.runs()) == ["c"]


def test_same_version_again_and_stale_are_per_run(make):
    store = VersionStore(2)
    store.put(make("a", 5, 10))
    assert store.put(make("b", 1, 10)).stored  # 1 < 5 is stale only within run a
    assert store.put(make("a", 4, 10, digest="x")).stale
    out = store.put(make("a", 5, 10, digest="y"))  # new bytes for a's newest: replaced
    assert out.replaced and store.newest("a").digest == "y5"


def test_store_rejects_bad_bounds():
    with pytest.raises(RelayError, match="max_bytes=-1"):
        VersionStore(2, max_bytes=-1)
    with pytest.raises(RelayError, match="idle_evict_s=-5"):
        VersionStore(2, idle_evict_s=-5)


def test_relay_serves_two_runs_and_reports_them(tmp_path):
    # A real relay: run b's put no longer evicts run a's version 0 (the pool bug this fixes).
    with RelayServer("r0", shm_dir=str(tmp_path), max_bytes=0) as relay:
        addr = relay.addr
        client.push(addr, 0, b"a" * 1000, chain=[], run="run-a")
        client.push(addr, 0, b"b" * 2000, chain=[], run="run-b")
        client.push(addr, 1, b"B" * 2000, chain=[], run="run-b")
        assert client.fetch_latest(addr, run="run-a") == (0, b"a" * 1000)
        assert client.fetch_latest(addr, run="run-b") == (1, b"B" * 2000)
        assert client.latest_version(addr, run="run-c") is None
        st = client.stats(addr)
        # 1000 + 2 * 2000 bytes held; run b (latest put) holds [0, 1].
        assert st["bytes_held"] == 5000 and st["run"] == "run-b" and st["versions"] == [0, 1]
        assert {r: v["versions"] for r, v in st["runs"].items()} == {"run-a": [0], "run-b": [0, 1]}
        with pytest.raises(RelayError, match=r"does not hold policy_version 0 \(holds \[\] of run 'run-c'"):
            client.fetch_version(addr, 0, run="run-c")
