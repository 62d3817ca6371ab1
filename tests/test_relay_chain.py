"""Relay tier end to end: real relay servers (threads in this process, and one real subprocess)."""

from __future__ import annotations

import hashlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from prometheus_client import REGISTRY

from laminar.errors import RelayError
from laminar.relay import client, protocol
from laminar.relay.server import RelayServer

T = TypeVar("T")
REPO_ROOT = Path(__file__).resolve().parents[1]


def wait_until(probe: Callable[[], T], done: Callable[[T], bool], timeout_s: float, what: str) -> T:
    """Poll probe() until done(value); fail naming what we waited for and the last value seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if done(value):
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}; last value: {value!r}")
        time.sleep(0.02)


def weights(policy_version: int, size: int = 256 * 1024) -> bytes:
    """Deterministic, version-specific opaque bytes standing in for a safetensors file."""
    seed = hashlib.sha256(f"v{policy_version}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


@pytest.fixture
def relays() -> Iterator[Callable[..., tuple[RelayServer, str]]]:
    started: list[RelayServer] = []

    def start(relay_id: str, **kwargs) -> tuple[RelayServer, str]:
        server = RelayServer(relay_id, **kwargs)
        addr = server.start()
        started.append(server)
        return server, addr

    yield start
    for server in started:
        server.stop()


def versions_of(addrs: list[str]) -> list[int | None]:
    return [client.latest_version(a) for a in addrs]


def test_push_reaches_every_relay_of_a_three_relay_chain(relays):
    _, master = relays("master")
    _, mid = relays("mid")
    _, tail = relays("tail")
    payload = weights(1, size=3 * 1024 * 1024 + 7)  # odd size: crosses several recv chunks
    names = ("master", "mid", "tail")
    before = {(kind, r): REGISTRY.get_sample_value(f"laminar_relay_{kind}_bytes_total", {"relay": r}) or 0.0
              for kind in ("received", "forwarded") for r in names}  # the registry is per process
    spent_s = client.push(master, 1, payload, chain=[mid, tail])
    assert spent_s > 0
    wait_until(lambda: versions_of([master, mid, tail]), lambda v: v == [1, 1, 1], 10, "version 1 on all relays")
    for addr in (master, mid, tail):
        version, got = client.fetch_latest(addr)
        assert version == 1
        assert hashlib.sha256(got).hexdigest() == hashlib.sha256(payload).hexdigest()
        assert client.fetch_version(addr, 1) == payload
    # master forwarded once (to mid), mid once (to tail), tail has nobody downstream.
    assert [client.stats(a)["forwards_done"] for a in (master, mid, tail)] == [1, 1, 0]
    st = client.stats(tail)
    assert st["relay_id"] == "tail" and st["versions"] == [1] and st["bytes_held"] == len(payload)
    # the Prometheus series (laminar/metrics.py): each relay received the payload once; the tail forwarded nothing
    grew = {k: (REGISTRY.get_sample_value(f"laminar_relay_{k[0]}_bytes_total", {"relay": k[1]}) or 0.0) - v
            for k, v in before.items()}
    n = len(payload)
    assert grew == {("received", "master"): n, ("received", "mid"): n, ("received", "tail"): n,
                    ("forwarded", "master"): n, ("forwarded", "mid"): n, ("forwarded", "tail"): 0}


def test_empty_relay_reports_no_version(relays):
    _, addr = relays("empty")
    assert client.latest_version(addr) is None
    assert client.fetch_latest(addr) == (None, None)
    with pytest.raises(RelayError, match="does not hold policy_version 3"):
        client.fetch_version(addr, 3)


def _start_subprocess_relay(relay_id: str, stderr_path: Path, **kwargs) -> tuple[subprocess.Popen, str]:
    code = (
        "import threading\n"
        "from laminar.logs import configure_logging\n"
        "from laminar.relay.server import RelayServer\n"
        "configure_logging()\n"
        f"addr = RelayServer({relay_id!r}, **{kwargs!r}).start()\n"
        "print(addr, flush=True)\n"
        "threading.Event().wait()\n"
    )
    stderr = stderr_path.open("wb")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr)
    stderr.close()
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    ready = sel.select(timeout=30)
    sel.close()
    line = proc.stdout.readline().decode().strip() if ready else ""
    if not line:
        proc.kill()
        proc.wait()
        pytest.fail(f"relay subprocess printed no address within 30 s; stderr: {stderr_path.read_text()!r}")
    return proc, line


def test_dead_middle_relay_in_a_subprocess_is_skipped(relays, tmp_path):
    _, master = relays("master")
    proc, mid = _start_subprocess_relay("mid", tmp_path / "mid.stderr")
    try:
        _, tail = relays("tail")
        client.push(master, 1, weights(1), chain=[mid, tail])
        wait_until(lambda: versions_of([master, mid, tail]), lambda v: v == [1, 1, 1], 10, "version 1 on all relays")

        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

        client.push(master, 2, weights(2), chain=[mid, tail])
        wait_until(lambda: versions_of([master, tail]), lambda v: v == [2, 2], 10, "version 2 past the dead relay")
        assert client.fetch_latest(tail) == (2, weights(2))
        st = client.stats(master)
        # v1 went to mid (1 done); v2 failed at mid (1 failed) and then went to tail (2 done).
        assert (st["forwards_done"], st["forwards_failed"]) == (2, 1)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_stopped_middle_relay_is_skipped(relays):
    _, master = relays("master")
    mid_server, mid = relays("mid")
    _, tail = relays("tail")
    mid_server.stop()
    client.push(master, 4, weights(4), chain=[mid, tail])
    wait_until(lambda: client.latest_version(tail), lambda v: v == 4, 10, "version 4 on the tail")
    wait_until(lambda: client.stats(master), lambda s: s["forwards_failed"] == 1 and s["forwards_done"] == 1,
               10, "master to count one failed and one done forward")


def test_versions_are_monotonic(relays):
    _, master = relays("master")
    _, tail = relays("tail")
    client.push(master, 5, weights(5), chain=[tail])
    wait_until(lambda: client.latest_version(tail), lambda v: v == 5, 10, "version 5 on the tail")

    client.push(master, 3, weights(3), chain=[tail])  # older: acknowledged, not stored, not forwarded
    assert client.latest_version(master) == 5
    assert client.fetch_latest(master) == (5, weights(5))
    st = wait_until(lambda: client.stats(master), lambda s: s["forwards_pending"] == 0, 10, "master forwarder idle")
    assert st["versions"] == [5] and st["forwards_done"] == 1
    assert client.latest_version(tail) == 5

    sock = client.open_connection(master)
    try:
        payload = memoryview(weights(3))
        header = {"op": "put", "policy_version": 3, "run": "", "chain": [], "size": len(payload),
                  "chunk_bytes": len(payload), "digest": None}
        # One chunk: its d_i is the digest of bytes 0..end of chunk 0, the whole payload.
        reply = client.send_version(sock, master, header, lambda i: (payload, protocol.digest_hex(payload)), 1,
                                    lambda: protocol.digest_hex(payload))
    finally:
        sock.close()
    assert reply["stored"] is False and reply["newest"] == 5


def test_same_version_rebroadcast_reaches_a_new_downstream(relays):
    _, master = relays("master")
    _, late = relays("late")
    client.push(master, 1, weights(1), chain=[])
    client.push(master, 1, weights(1), chain=[late])  # chain rebuilt: same bytes go to the new relay
    wait_until(lambda: client.latest_version(late), lambda v: v == 1, 10, "version 1 on the late relay")
    # Same version, different bytes (a restarted trainer re-published it): the new bytes replace the old.
    client.push(master, 1, weights(99), chain=[late])
    wait_until(lambda: client.fetch_latest(late)[1], lambda b: b == weights(99), 10, "replaced version 1 on late")


def test_keep_versions_bounds_memory(relays):
    _, master = relays("master", keep_versions=2)
    for v in range(1, 5):
        client.push(master, v, weights(v, size=1000 + v), chain=[])
    st = client.stats(master)
    # keep_versions=2 after versions 1..4: only 3 and 4 remain, 1003 + 1004 = 2007 bytes.
    assert st["versions"] == [3, 4]
    assert st["bytes_held"] == 2007
    assert client.fetch_version(master, 3) == weights(3, size=1003)
    with pytest.raises(RelayError, match=r"does not hold policy_version 1 \(holds \[3, 4\]"):
        client.fetch_version(master, 1)


def test_corrupted_payload_is_rejected(relays):
    _, master = relays("master")
    payload = weights(1)
    corrupted = payload[:-1] + bytes([payload[-1] ^ 0xFF])
    with pytest.raises(RelayError, match="whole-version digest mismatch"):
        client.push(master, 1, corrupted, chain=[], digest=protocol.digest_hex(payload))
    assert client.latest_version(master) is None
    assert client.stats(master)["puts_rejected"] == 1


def test_bad_frame_gets_an_error_reply(relays):
    _, master = relays("master")
    host, port = protocol.parse_addr(master)
    with socket.create_connection((host, port), timeout=10) as sock:
        hello, _ = protocol.recv_frame(sock)
        assert hello["op"] == "hello" and hello["auth"] is False and hello["relay_id"] == "master"
        body = b"not json"
        sock.sendall(protocol.HEADER_LEN.pack(len(body)) + body)
        reply, _ = protocol.recv_frame(sock)
    assert reply["ok"] is False and "not valid UTF-8 JSON" in reply["error"]
    with pytest.raises(RelayError, match="unknown op 'frobnicate'"):
        client.request(master, {"op": "frobnicate"})
    with pytest.raises(RelayError, match="chunk_bytes=0 is not in"):
        client.request(master, {"op": "put", "policy_version": 1, "size": 3, "chunk_bytes": 0, "chain": []})
    assert client.latest_version(master) is None  # the relay still serves after bad input


def test_client_error_names_a_closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = f"127.0.0.1:{port}"
    with pytest.raises(RelayError, match=f"relay {addr} could not be reached.*check that the relay process"):
        client.latest_version(addr)
    with pytest.raises(RelayError, match="not of the form host:port"):
        client.latest_version("localhost")
