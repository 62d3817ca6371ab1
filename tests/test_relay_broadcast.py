"""Chunked, pipelined chain broadcast; shared-memory pulls; run-token authentication. Real relays only:
threads in this process and real subprocesses killed by pid. No timing assertions (see laminar bench)."""

from __future__ import annotations

import hashlib
import os
import signal
import threading

import pytest
import torch
from safetensors.torch import save

from laminar.errors import RelayError
from laminar.relay import client, protocol
from laminar.relay.weights import load_into, state_dict_from_buffer
from tests.helpers import chunk_digests
from tests.test_relay_chain import _start_subprocess_relay, relays, versions_of, wait_until, weights

__all__ = ["relays"]  # the fixture, imported for this module's tests


class HeldStream:
    """A put to a relay that streams its first `release_after` chunks, then waits for release()."""

    def __init__(self, addr: str, policy_version: int, payload: bytes, chain: list[str], chunk_bytes: int,
                 release_after: int, token: str | None = None) -> None:
        self.gate = threading.Event()
        self.error: BaseException | None = None
        self.reply: dict | None = None
        view = memoryview(payload)
        n_chunks = -(-len(view) // chunk_bytes)
        digests = chunk_digests(view, chunk_bytes)

        def chunk(i: int) -> tuple[memoryview, str]:
            if i >= release_after:
                self.gate.wait(30)
            return view[i * chunk_bytes:(i + 1) * chunk_bytes], digests[i]

        header = {"op": "put", "policy_version": policy_version, "run": "", "chain": chain,
                  "size": len(view), "chunk_bytes": chunk_bytes, "digest": None}

        def send() -> None:
            try:
                sock = client.open_connection(addr, token=token)
                try:
                    self.reply = client.send_version(sock, addr, header, chunk, n_chunks,
                                                     lambda: protocol.digest_hex(view))
                finally:
                    sock.close()
            except BaseException as exc:  # reported by join()
                self.error = exc

        self._thread = threading.Thread(target=send, daemon=True)
        self._thread.start()

    def release(self) -> None:
        self.gate.set()

    def join(self) -> dict:
        self._thread.join(30)
        assert not self._thread.is_alive(), "the held put did not finish"
        if self.error is not None:
            raise self.error
        return self.reply


def receiving(addr: str) -> list[list[int]]:
    return client.stats(addr)["receiving"]


def test_chunked_broadcast_to_a_four_relay_chain_delivers_identical_bytes(relays):
    addrs = [relays(f"r{i}")[1] for i in range(4)]
    payload = os.urandom(5 * 1024 * 1024 + 13)
    # 64 KiB chunks: 5 MiB + 13 bytes is 80 full chunks and one of 13 bytes, 81 chunks per hop.
    client.push(addrs[0], 1, payload, chain=addrs[1:], chunk_bytes=64 * 1024)
    wait_until(lambda: versions_of(addrs), lambda v: v == [1, 1, 1, 1], 20, "version 1 on all four relays")
    digest = hashlib.sha256(payload).hexdigest()
    for addr in addrs:
        version, got = client.fetch_latest(addr)
        assert version == 1 and hashlib.sha256(got).hexdigest() == digest
    assert [client.stats(a)["forwards_done"] for a in addrs] == [1, 1, 1, 0]


def test_default_chunk_size_follows_the_chain_model():
    # M = 256 MiB, 8 relays + master + trainer hop: hops = 9, p = 10, p - 2 = 8;
    # chunk = sqrt(M * B * t_start / 8) = sqrt(268435456 * 1.25e9 * 2e-4 / 8) = 2896309 bytes.
    assert protocol.chunk_bytes_for(256 << 20, 9) == 2896309
    assert protocol.chunk_bytes_for(256 << 20, 1) == protocol.MAX_CHUNK_BYTES  # one hop: no pipelining
    assert protocol.chunk_bytes_for(1000, 9) == protocol.MIN_CHUNK_BYTES
    # The model: M/B = 1 s, t_start = 1 ms, p = 10: 1 + 8 * 0.001 + 2 * sqrt(8 * 1 * 0.001) = 1.18689 s.
    assert protocol.chain_model_s(10**9, 10, 1e9, 1e-3) == pytest.approx(1.18689, abs=1e-5)


def test_partially_received_version_is_never_served(relays):
    _, master = relays("master")
    _, tail = relays("tail")
    client.push(master, 1, weights(1), chain=[tail])
    wait_until(lambda: versions_of([master, tail]), lambda v: v == [1, 1], 10, "version 1 on both relays")

    payload = os.urandom(1024 * 1024)
    held = HeldStream(master, 2, payload, [tail], chunk_bytes=64 * 1024, release_after=4)
    # 4 of 16 chunks have landed on the master; the tail is receiving them too (cut-through).
    wait_until(lambda: receiving(master), lambda r: r == [[2, 4, 16]], 10, "4 chunks of version 2 on master")
    wait_until(lambda: receiving(tail), lambda r: r == [[2, 4, 16]], 10, "4 chunks of version 2 on tail")
    for addr in (master, tail):
        assert client.latest_version(addr) == 1
        assert client.fetch_latest(addr) == (1, weights(1))
        with pytest.raises(RelayError, match="does not hold policy_version 2"):
            client.fetch_version(addr, 2)
        with client.pull_local(addr) as pulled:
            assert pulled.policy_version == 1 and bytes(pulled.buffer) == weights(1)
    held.release()
    assert held.join()["stored"] is True
    wait_until(lambda: versions_of([master, tail]), lambda v: v == [2, 2], 10, "version 2 on both relays")
    assert client.fetch_latest(tail) == (2, payload)


def test_relay_killed_mid_broadcast_is_skipped_and_the_tail_completes(relays, tmp_path):
    _, master = relays("master")
    proc, mid = _start_subprocess_relay("mid", tmp_path / "mid.stderr")
    try:
        _, tail = relays("tail")
        payload = os.urandom(2 * 1024 * 1024)
        held = HeldStream(master, 1, payload, [mid, tail], chunk_bytes=64 * 1024, release_after=8)
        wait_until(lambda: receiving(tail), lambda r: r == [[1, 8, 32]], 10, "8 chunks through mid to tail")

        os.kill(proc.pid, signal.SIGKILL)  # mid dies half-way through the broadcast
        proc.wait(timeout=10)
        held.release()
        held.join()

        wait_until(lambda: versions_of([master, tail]), lambda v: v == [1, 1], 20, "version 1 past the dead relay")
        assert client.fetch_latest(tail) == (1, payload)
        st = client.stats(master)
        # mid failed part way (1 failed), then the master streamed the whole version to tail (1 done).
        assert (st["forwards_done"], st["forwards_failed"]) == (1, 1)
        assert client.stats(tail)["receiving"] == []  # the partial copy from mid was discarded
        relays("next")  # a relay starting on this host sweeps the segments the dead relay left behind
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"lmr-{proc.pid}-")]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_corrupted_chunk_is_rejected_and_nothing_is_served(relays):
    _, master = relays("master")
    _, tail = relays("tail")
    payload = memoryview(os.urandom(256 * 1024))
    chunk_bytes = 64 * 1024
    digests = chunk_digests(payload, chunk_bytes)
    sent = bytearray(payload)
    sent[2 * chunk_bytes + 7] ^= 0xFF  # one bit pattern flipped in transit, inside chunk 2 of 4
    wire = memoryview(sent)

    def corrupt_chunk(i: int) -> tuple[memoryview, str]:
        return wire[i * chunk_bytes:(i + 1) * chunk_bytes], digests[i]  # the sender's digests, of good bytes

    header = {"op": "put", "policy_version": 1, "run": "", "chain": [tail], "size": len(payload),
              "chunk_bytes": chunk_bytes, "digest": None}
    sock = client.open_connection(master)
    try:
        with pytest.raises(RelayError, match="chunk 2 digest mismatch"):
            client.send_version(sock, master, header, corrupt_chunk, 4, lambda: protocol.digest_hex(payload))
    finally:
        sock.close()
    wait_until(lambda: client.stats(master)["forwards_pending"], lambda n: n == 0, 10, "master forwarder idle")
    wait_until(lambda: receiving(tail), lambda r: r == [], 10, "tail to drop its partial copy")
    assert versions_of([master, tail]) == [None, None]
    assert client.stats(master)["forwards_aborted"] == 1
    mine = (f"lmr-{os.getpid()}-master-", f"lmr-{os.getpid()}-tail-")
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(mine)]  # the partial segments were unlinked


def test_keep_k_versions_for_resumed_trajectories(relays):
    _, master = relays("master", keep_versions=3)
    _, tail = relays("tail", keep_versions=3)
    for v in range(1, 6):
        client.push(master, v, weights(v, size=70_000 + v), chain=[tail], chunk_bytes=16 * 1024)
        wait_until(lambda: client.latest_version(tail), lambda got, v=v: got == v, 10, f"version {v} on tail")
    for addr in (master, tail):
        st = client.stats(addr)
        # keep_versions=3 after versions 1..5: 3, 4 and 5 remain, 70003 + 70004 + 70005 = 210012 bytes.
        assert st["versions"] == [3, 4, 5] and st["bytes_held"] == 210012
        assert client.fetch_version(addr, 3) == weights(3, size=70_003)
        with client.pull_local(addr, policy_version=4) as pulled:
            assert bytes(pulled.buffer) == weights(4, size=70_004)
        with pytest.raises(RelayError, match="does not hold policy_version 2"):
            client.pull_local(addr, policy_version=2)


def test_shared_memory_pull_round_trips_a_safetensors_file(relays):
    _, master = relays("master")
    _, tail = relays("tail")
    tensors = {
        "embed.weight": torch.randn(64, 32),
        "layers.0.mlp.weight": torch.randn(32, 32).to(torch.bfloat16),
        "layers.0.norm.scale": torch.ones(32, dtype=torch.float16),
        "step": torch.tensor(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 4),
    }
    payload = save(tensors, metadata={"policy_version": "3"})
    client.push(master, 3, payload, chain=[tail], run="run-a")
    wait_until(lambda: client.latest_version(tail, run="run-a"), lambda v: v == 3, 10, "version 3 on tail")
    assert client.pull_local(tail, run="run-b") is None  # another run sees nothing
    with client.pull_local(tail, run="run-a") as pulled:
        assert pulled.policy_version == 3 and pulled.buffer.readonly
        assert bytes(pulled.buffer) == payload
        pulled.verify()
        loaded = state_dict_from_buffer(pulled.buffer)
        assert loaded.keys() == tensors.keys()
        for name, tensor in tensors.items():
            assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
        params = {name: torch.zeros_like(t) for name, t in tensors.items()}  # the engine's own parameters
        for name, view in loaded.items():
            params[name].copy_(view)
        del loaded, view
    for name, tensor in tensors.items():
        assert torch.equal(params[name], tensor)
    fresh = {name: torch.zeros_like(t) for name, t in tensors.items()}
    with client.pull_local(tail, run="run-a") as pulled:
        # One copy per tensor straight into the parameters: the sizes of all six tensors' data.
        assert load_into(fresh, pulled) == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, tensor in tensors.items():
        assert torch.equal(fresh[name], tensor), name


def test_segment_stays_valid_for_a_reader_after_the_relay_evicts_it(relays):
    _, master = relays("master", keep_versions=1)
    client.push(master, 1, weights(1), chain=[])
    pulled = client.pull_local(master)
    client.push(master, 2, weights(2), chain=[])  # evicts and unlinks version 1
    assert not os.path.exists(pulled.path)
    assert bytes(pulled.buffer) == weights(1)  # still mapped: the bytes never change under a reader
    pulled.close()


def test_wrong_or_missing_token_is_refused_for_push_and_reads(relays):
    _, master = relays("master", token="run-token-1")
    _, tail = relays("tail", token="run-token-1")
    for token, message in ((None, "requires a run token and this client has none"),
                           ("wrong", "authentication failed, wrong run token")):
        with pytest.raises(RelayError, match=message) as err:
            client.push(master, 1, weights(1), chain=[tail], token=token)
        assert "LAMINAR_RELAY_TOKEN" in str(err.value)
        with pytest.raises(RelayError, match=message):
            client.latest_version(master, token=token)
        with pytest.raises(RelayError, match=message):
            client.fetch_latest(master, token=token)
        with pytest.raises(RelayError, match=message):
            client.pull_local(master, token=token)
    assert client.stats(master, token="run-token-1")["versions"] == []

    client.push(master, 1, weights(1), chain=[tail], token="run-token-1")  # relays forward with their token
    wait_until(lambda: client.latest_version(tail, token="run-token-1"), lambda v: v == 1, 10, "version 1 on tail")
    assert client.fetch_latest(tail, token="run-token-1") == (1, weights(1))
    with client.pull_local(tail, token="run-token-1") as pulled:
        assert bytes(pulled.buffer) == weights(1)


def test_client_with_a_token_refuses_a_relay_without_auth(relays):
    _, open_relay = relays("open")
    with pytest.raises(RelayError, match="does not authenticate, but this client holds a run token"):
        client.latest_version(open_relay, token="run-token-1")
