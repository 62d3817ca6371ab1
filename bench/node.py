"""One process of the relay benchmark, started by bench.relay inside a node's network namespace.

    python -m bench.node relay --id r3 --host 10.77.0.4   serve a relay; print {"addr", "pid"}
    python -m bench.node agent                            run JSON commands from stdin

An agent reads one JSON command per line on stdin and answers one JSON line on stdout
({"ok": true, ...} or {"ok": false, "error"}); it is the trainer (pushes), a rollout (local pulls) or an
object-store reader, depending on the commands. Timestamps are time.time(), the one wall clock every
namespace on the machine shares. The run token comes from LAMINAR_RELAY_TOKEN.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import threading
import time
from typing import Any

import typer

from laminar.logs import configure_logging
from laminar.relay import client, protocol

app = typer.Typer(add_completion=False, pretty_exceptions_show_locals=False)


@app.command("relay")
def serve_relay(relay_id: str = typer.Option(..., "--id"), host: str = typer.Option(..., "--host"),
                keep_versions: int = typer.Option(2, "--keep")) -> None:
    """Serve a relay on host; print its address and pid as one JSON line."""
    from laminar.relay.server import RelayServer

    configure_logging(level="warning")
    token = os.environ.get("LAMINAR_RELAY_TOKEN") or None
    # Without a token (`laminar bench relay --no-macs`, to measure what the MACs cost) the relay would refuse an
    # address off loopback; the benchmark's namespaces reach nothing else, so it accepts that risk itself.
    server = RelayServer(relay_id, bind_host=host, keep_versions=keep_versions, token=token,
                         forward_timeout_s=60.0, insecure=token is None)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    print(json.dumps({"addr": server.start(), "pid": os.getpid()}), flush=True)  # the pid: for its CPU time
    stopped.wait()
    server.stop()


class Agent:
    """Executes benchmark commands; holds the payload, the object store and the engine's parameters."""

    def __init__(self) -> None:
        self.token = os.environ.get("LAMINAR_RELAY_TOKEN") or None
        self.payload = b""
        self.params: dict[str, Any] | None = None
        self.memcpy_bufs: tuple[Any, Any] | None = None
        self.store = None

    def payload_cmd(self, size: int) -> dict[str, Any]:
        """A safetensors file of about `size` bytes: random uint8 tensors of 8 MiB (the last one smaller)."""
        import numpy as np
        import torch
        from safetensors.torch import save

        raw = torch.frombuffer(bytearray(np.random.default_rng(0).bytes(size)), dtype=torch.uint8)
        step = 8 << 20
        tensors = {f"layers.{i // step}.weight": raw[i:i + step] for i in range(0, size, step)}
        self.payload = save(tensors)
        self.params = None
        return {"size": len(self.payload), "digest": protocol.digest_hex(self.payload)}

    def push_cmd(self, addr: str, chain: list[str], version: int, run: str, chunk_bytes: int | None) -> dict:
        start = time.time()
        stall_s = client.push(addr, version, self.payload, chain, timeout_s=60.0, run=run, token=self.token,
                              chunk_bytes=chunk_bytes)
        return {"start": start, "stall_s": stall_s}

    def wait_cmd(self, addrs: list[str], version: int, run: str, wait_s: float) -> dict:
        deadline = time.monotonic() + wait_s
        left = list(addrs)
        while left:
            left = [a for a in left if client.latest_version(a, run=run, token=self.token, timeout_s=30.0) != version]
            if left and time.monotonic() > deadline:
                raise TimeoutError(f"version {version} of {run} not on {left} after {wait_s} s")
            if left:
                time.sleep(0.01)
        done = [client.stats(a, token=self.token, timeout_s=30.0)["completed_at"][str(version)] for a in addrs]
        return {"completed_at": done}

    def sequential_cmd(self, addrs: list[str], version: int, run: str, chunk_bytes: int | None) -> dict:
        """The master's alternative to a chain: send the whole version to each relay in turn."""
        start = time.time()
        for addr in addrs:
            client.push(addr, version, self.payload, [], timeout_s=60.0, run=run, token=self.token,
                        chunk_bytes=chunk_bytes)
        return {"start": start, "end": time.time()}

    def link_cmd(self, addr: str, run: str, reps: int) -> dict:
        """B and t_start of the link to addr: one-hop time of the payload, half a tiny round trip."""
        hops = []
        for v in range(1, reps + 1):
            hops.append(client.push(addr, v, self.payload, [], timeout_s=60.0, run=run, token=self.token))
        sock = client.open_connection(addr, 30.0, token=self.token)
        rtts = []
        try:
            for _ in range(50):
                t = time.perf_counter()
                protocol.send_frame(sock, {"proto": protocol.PROTOCOL_VERSION, "op": protocol.OP_VERSION, "run": run})
                protocol.recv_frame(sock)
                rtts.append(time.perf_counter() - t)
        finally:
            sock.close()
        single = statistics.median(hops)
        return {"single_hop_s": single, "bytes_per_s": len(self.payload) / single,
                "t_start_s": statistics.median(rtts) / 2}

    def _memcpy_s(self, size: int) -> float:
        """Seconds of one copy_ of `size` bytes between two warm tensors (kept for later calls)."""
        import torch

        if self.memcpy_bufs is None or self.memcpy_bufs[0].numel() != size:
            src = torch.randint(0, 255, (size,), dtype=torch.uint8)
            self.memcpy_bufs = (src, torch.zeros_like(src))
            self.memcpy_bufs[1].copy_(src)  # warm: the destination's pages exist before any timed copy
        src, dst = self.memcpy_bufs
        t = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t

    def memcpy_cmd(self, size: int) -> dict:
        """Best-of-5 bandwidth of one large in-memory copy (torch copy_, warm buffers), GB/s."""
        size = max(size, 256 << 20)  # larger than any cache
        return {"memcpy_gbps": size / min(self._memcpy_s(size) for _ in range(5)) / 1e9}

    def local_pull_cmd(self, addr: str, run: str, reps: int) -> dict:
        """Map the relay's newest version from shared memory and copy it into the engine's parameters.

        Each timed pull reads a version the relay has just received (pushed untimed before it, with no
        chain), as a rollout pulls each new version once; a memcpy of the same size is timed right before
        each pull, so both best-ofs see the same moments of a shared machine.
        """
        from laminar.relay.weights import load_into, state_dict_from_buffer

        if self.params is None:
            import torch

            self.params = {k: torch.zeros_like(v) for k, v in state_dict_from_buffer(self.payload).items()}
        newest = client.latest_version(addr, run=run, token=self.token) or 0
        size = max(len(self.payload), 256 << 20)
        pulls, copies, version = [], [], None
        for v in range(newest + 1, newest + reps + 1):
            client.push(addr, v, self.payload, [], timeout_s=60.0, run=run, token=self.token)
            copies.append(self._memcpy_s(size))
            t = time.perf_counter()
            pulled = client.pull_local(addr, run=run, token=self.token)
            assert pulled is not None, f"relay {addr} holds no version of {run}"
            with pulled:
                version = pulled.policy_version
                load_into(self.params, pulled)
            pulls.append(time.perf_counter() - t)
        assert version == newest + reps, f"pulled version {version}, expected {newest + reps}"
        return {"local_pull_s": min(pulls), "local_pull_gbps": len(self.payload) / min(pulls) / 1e9,
                "local_pull_median_gbps": len(self.payload) / statistics.median(pulls) / 1e9,
                "memcpy_gbps": size / min(copies) / 1e9, "policy_version": version,
                "pulls_s": pulls, "memcpys_s": copies}

    def store_setup_cmd(self, endpoint: str, bucket: str, create: bool) -> dict:
        import boto3

        from laminar.storage.objects import S3ObjectStore

        deadline = time.monotonic() + 60
        while True:
            try:
                if create:
                    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
                self.store = S3ObjectStore(bucket, endpoint_url=endpoint)
                self.store.exists("probe")
                return {}
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def store_put_cmd(self, key: str) -> dict:
        start = time.time()
        self.store.put(key, self.payload)
        return {"start": start, "end": time.time()}

    def store_get_cmd(self, key: str) -> dict:
        data = self.store.get(key)
        return {"end": time.time(), "bytes": len(data)}

    def store_delete_cmd(self, key: str) -> dict:
        self.store.delete(key)
        return {}


@app.command("agent")
def run_agent() -> None:
    """Run JSON commands from stdin, one reply line each."""
    configure_logging(level="warning")
    agent = Agent()
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        name = command.pop("cmd")
        try:
            reply = {"ok": True, **getattr(agent, f"{name}_cmd")(**command)}
        except Exception as exc:  # reported to the orchestrator, which raises it there
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    app()
