"""The relay benchmark (`laminar bench relay`): chain broadcast vs sending to each relay in turn vs the
object store, per relay count, next to the chain model, measured on one link.

Every node runs as its own process (bench.node): the trainer agent and the master relay share a
node (loopback between them, as on the trainer's host), each relay is a node, the object store
(moto_server, S3 API) is a node, and each relay node has a reader agent for the storage baseline.
With rate_mbit, nodes live in network namespaces whose uplinks are tc-rate-limited (bench.netns), so
the link, not the CPU, is the bottleneck; without it everything runs over loopback.

Measured per relay count p:
    stall_s         trainer's push to the master until the master's ack (median of reps; stall_each_s
                    the reps in order)
    all_relays_s    push start until the last relay holds the verified version (median of reps)
    single_hop_s    one relay receiving the whole version over one link (the same for every p)
    sequential_s    the master sending the whole version to each of the p relays in turn
    storage_s       trainer writes safetensors to the object store, then all p relays read it
    model_s         T = M/B + (p-2)*t_start + 2*sqrt((p-2)*M/B*t_start), p = relays + master,
                    B and t_start measured on the same link
    local_pull_gbps map the version from the master's shared memory and copy it into the engine's
                    parameters: best of 15 pulls, each of a version the master has just received;
                    local_pull_median_gbps their median; memcpy_gbps the best torch copy_ of the same
                    size timed right before each of those pulls, which local_pull_fraction_of_memcpy
                    divides by (local_pull_fraction_of_best_memcpy divides by the best memcpy of the
                    whole run instead, its start included); local_pull_each_s and memcpy_each_s the
                    timings, in order
    relay_cpu_s_per_gib   CPU seconds (user + system, /proc/<pid>/stat via psutil) each relay that
                    received and forwarded spent per GiB it forwarded, over the chain reps: mean and
                    max over those relays (None at p = 1, where the only relay forwards nothing);
                    tail_cpu_s_per_gib is the last relay's (receive only), master_cpu_s_per_gib the
                    master's (receive from the trainer and forward once)
    forward_bytes_per_s   aggregate forwarding rate: p * size / all_relays_s (bytes that reached relays)
and once per run loopback_tcp_bytes_per_s: one TCP stream over this machine's loopback, not pinned,
in the same run, for scale.
The timed reps run in rounds after every relay count's warm-up: round k broadcasts one version to each
relay count in turn, so the ratios between relay counts compare the same moments of the machine.
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

from laminar.bench.netns import Netns
from laminar.devstack.stack import free_port
from laminar.errors import LaminarError
from laminar.relay import protocol

REPO_ROOT = Path(__file__).resolve().parents[1]
STORE_PORT = 9077
OTHER_HOST_NICE = 10
WARMUP_VERSIONS = 3  # untimed chain broadcasts per relay count before the timed reps


class BenchError(LaminarError):
    """A benchmark process failed or did not answer; the message names its log file."""


@dataclass(frozen=True)
class BenchConfig:
    """What to measure: payload size (bytes), relay counts, link rate (Mbit/s; None = loopback)."""

    size: int = 256 << 20
    relays: tuple[int, ...] = (1, 2, 4, 8)
    rate_mbit: float | None = None
    chunk_bytes: int | None = None  # None: the chain model's optimum for the measured link
    reps: int = 5  # rounds of timed broadcasts (one per relay count each round); medians over them
    storage: bool = True
    macs: bool = True  # a run token, so every frame and chunk carries HMAC-SHA256 (relay.auth); False: no token


class _Proc:
    """A benchmark subprocess with a log file; agents talk JSON lines over stdin/stdout."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log)
        self._stdin: IO[bytes] = self.proc.stdin  # type: ignore[assignment]

    def readline(self, timeout_s: float) -> str:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout_s)
        sel.close()
        line = self.proc.stdout.readline().decode() if ready else ""
        if not line:
            raise BenchError(f"{self.name} (pid {self.proc.pid}) gave no answer within {timeout_s} s "
                             f"(exit code {self.proc.poll()}); see {self.log_path}")
        return line.strip()

    def send(self, cmd: str, **args: Any) -> None:
        self._stdin.write((json.dumps({"cmd": cmd, **args}) + "\n").encode())
        self._stdin.flush()

    def result(self, timeout_s: float = 600.0) -> dict[str, Any]:
        reply = json.loads(self.readline(timeout_s))
        if not reply.pop("ok"):
            raise BenchError(f"{self.name}: {reply['error']}; see {self.log_path}")
        return reply

    def call(self, cmd: str, timeout_s: float = 600.0, **args: Any) -> dict[str, Any]:
        self.send(cmd, **args)
        return self.result(timeout_s)

    def stop(self) -> None:
        """SIGTERM (a relay then unlinks its segments), SIGKILL after 5 s; our own child, by pid."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait(10)


def _unwind_on_sigterm(stack: ExitStack) -> None:
    """SIGTERM (a CI timeout, `timeout`, `kill`) stops the benchmark like Ctrl-C: the stack unwinds, so every node
    process is stopped and the network namespaces are deleted instead of outliving the run. Main thread only
    (where Python delivers signals); the previous handler comes back when the stack closes."""
    if threading.current_thread() is not threading.main_thread():
        return

    def _stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, _stop)
    stack.callback(signal.signal, signal.SIGTERM, previous)


def _other_host(node: str) -> list[str]:
    """argv prefix for a node: nodes other than the trainer's host ("m") stand for other machines.

    On a shared machine they must not take the trainer host's CPU during its upload: with 2+ CPUs the
    trainer host gets CPU 0 and every other node the remaining ones (taskset), and they run niced.
    """
    cpus = os.cpu_count() or 1
    if cpus < 2 or shutil.which("taskset") is None:
        return [] if node == "m" else ["nice", "-n", str(OTHER_HOST_NICE)]
    if node == "m":
        return ["taskset", "-c", "0"]
    return ["taskset", "-c", f"1-{cpus - 1}", "nice", "-n", str(OTHER_HOST_NICE)]


def loopback_tcp_bytes_per_s(size: int, reps: int = 3) -> float:
    """Best of `reps`: one TCP stream of `size` bytes over 127.0.0.1 (sendall of one buffer, recv_into a
    4 MiB one in another thread; both release the GIL in their syscalls), this process unpinned."""
    payload = memoryview(bytearray(os.urandom(1 << 20)) * max(1, size >> 20))
    best = 0.0
    for _ in range(reps):
        with socket.create_server(("127.0.0.1", 0)) as server:
            got: list[int] = []
            reader = threading.Thread(target=lambda got=got, server=server: got.append(_receive_all(server)),
                                      daemon=True)
            reader.start()
            with socket.create_connection(server.getsockname()[:2]) as sock:
                start = time.perf_counter()
                sock.sendall(payload)
                sock.shutdown(socket.SHUT_WR)
                reader.join(120)
                elapsed = time.perf_counter() - start
        if got != [len(payload)]:
            raise BenchError(f"loopback TCP check received {got} of {len(payload)} bytes")
        best = max(best, len(payload) / elapsed)
    return best


def _receive_all(server: socket.socket) -> int:
    conn, _ = server.accept()
    sink, total = memoryview(bytearray(4 << 20)), 0
    with conn:
        while (n := conn.recv_into(sink)) > 0:
            total += n
    return total


def _cpu_s(procs: list[psutil.Process]) -> list[float]:
    """User + system CPU seconds of each process so far (/proc/<pid>/stat)."""
    return [sum(p.cpu_times()[:2]) for p in procs]


def run_bench(cfg: BenchConfig, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Run every scenario for every relay count; returns the JSON-ready report."""
    max_p = max(cfg.relays)
    relay_nodes = [f"r{i}" for i in range(1, max_p + 1)]
    nodes = ["m", *relay_nodes, "s"]
    log_dir = Path(tempfile.mkdtemp(prefix="lmr-bench-"))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "LAMINAR_RELAY_TOKEN": secrets.token_hex(16) if cfg.macs else "",
           "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
           "NO_PROXY": "*", "OMP_NUM_THREADS": "1"}
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "HTTP_PROXY", "HTTPS_PROXY"):
        env.pop(name, None)
    procs: list[_Proc] = []
    with ExitStack() as stack:
        _unwind_on_sigterm(stack)
        if cfg.rate_mbit:
            net = stack.enter_context(Netns(nodes, cfg.rate_mbit))
            host = net.addresses.__getitem__
            prefix = net.exec_prefix
        else:
            host = lambda node: "127.0.0.1"  # noqa: E731
            prefix = lambda node: []  # noqa: E731
        stack.callback(lambda: [p.stop() for p in reversed(procs)])

        def spawn(name: str, node: str, *args: str) -> _Proc:
            nice = _other_host(node)
            argv = [*prefix(node), *nice, sys.executable, "-m", "laminar.bench.node", *args]
            proc = _Proc(name, argv, log_dir, env)
            procs.append(proc)
            return proc

        progress(f"starting {max_p + 1} relays, agents and the object store (logs in {log_dir})")
        master = spawn("relay-master", "m", "relay", "--id", "master", "--host", host("m"))
        relays = [spawn(f"relay-{n}", n, "relay", "--id", n, "--host", host(n)) for n in relay_nodes]
        trainer = spawn("agent-trainer", "m", "agent")
        readers = [spawn(f"agent-{n}", n, "agent") for n in relay_nodes] if cfg.storage else []
        master_info = json.loads(master.readline(60))
        relay_infos = [json.loads(r.readline(60)) for r in relays]
        master_addr, relay_addrs = master_info["addr"], [r["addr"] for r in relay_infos]
        master_ps = psutil.Process(master_info["pid"])
        relay_ps = [psutil.Process(r["pid"]) for r in relay_infos]
        store_port = STORE_PORT if cfg.rate_mbit else free_port()
        endpoint = f"http://{host('s')}:{store_port}"
        if cfg.storage:
            moto = Path(sys.executable).with_name("moto_server")
            store = _Proc("store", [*prefix("s"), *_other_host("s"), str(moto), "-H", host("s"), "-p", str(store_port)], log_dir, env)
            procs.append(store)

        payload = trainer.call("payload", size=cfg.size)
        size = payload["size"]
        progress("measuring one loopback TCP stream")
        loopback = loopback_tcp_bytes_per_s(size)
        memcpy = trainer.call("memcpy", size=size)["memcpy_gbps"]
        progress(f"payload {size} bytes; memcpy {memcpy:.2f} GB/s; measuring the link")
        link = trainer.call("link", addr=relay_addrs[0], run="bench-link", reps=2)
        bucket = f"lmr-bench-{secrets.token_hex(4)}"
        if cfg.storage:
            trainer.call("store_setup", endpoint=endpoint, bucket=bucket, create=True)
            for r in readers:
                r.call("store_setup", endpoint=endpoint, bucket=bucket, create=False)

        # Every relay count is warmed up first, then the timed reps run in rounds, each round one broadcast per
        # relay count in turn: stall(p)/stall(1) and the chain times compare moments of this shared machine
        # side by side, instead of one relay count's minute against the next one's.
        chunks, runs = {}, {}
        for p in cfg.relays:
            chunks[p] = cfg.chunk_bytes or protocol.chunk_bytes_for(size, p + 1, link["bytes_per_s"], link["t_start_s"])
            runs[p] = f"bench-chain-{p}"
            progress(f"{p} relay(s): warm-up, chunk {chunks[p]} bytes")
            # Steady state for every relay count alike: WARMUP_VERSIONS untimed versions first, so each relay
            # holds its keep-2 versions and a spare segment (a trainer publishes every step; only the first
            # version of a run lands in fresh pages, whose faults would favour whichever count runs later).
            for v in range(1, WARMUP_VERSIONS + 1):
                trainer.call("push", addr=master_addr, chain=relay_addrs[:p], version=v, run=runs[p],
                             chunk_bytes=chunks[p])
                trainer.call("wait", addrs=[master_addr, *relay_addrs[:p]], version=v, run=runs[p], wait_s=600.0)
        stalls: dict[int, list[float]] = {p: [] for p in cfg.relays}
        alls: dict[int, list[float]] = {p: [] for p in cfg.relays}
        cpu_s: dict[int, list[float]] = {p: [0.0] * (p + 1) for p in cfg.relays}
        for i, v in enumerate(range(WARMUP_VERSIONS + 1, WARMUP_VERSIONS + cfg.reps + 1)):
            progress(f"round {i + 1}/{cfg.reps}: chain broadcast to {', '.join(map(str, cfg.relays))} relay(s) in turn")
            for p in cfg.relays:
                chain = relay_addrs[:p]
                before = _cpu_s([master_ps, *relay_ps[:p]])
                pushed = trainer.call("push", addr=master_addr, chain=chain, version=v, run=runs[p],
                                      chunk_bytes=chunks[p])
                done = trainer.call("wait", addrs=[master_addr, *chain], version=v, run=runs[p], wait_s=600.0)
                after = _cpu_s([master_ps, *relay_ps[:p]])
                cpu_s[p] = [acc + b - a for acc, a, b in zip(cpu_s[p], before, after, strict=True)]
                stalls[p].append(pushed["stall_s"])
                alls[p].append(max(done["completed_at"]) - pushed["start"])

        results = []
        for p in cfg.relays:
            chain, chunk = relay_addrs[:p], chunks[p]
            gib = cfg.reps * size / 2**30  # what each relay received (and, but the tail, forwarded)
            cpu = [s / gib for s in cpu_s[p]]
            forwarding = cpu[1:-1]  # relays 1..p-1 received and forwarded; the tail only received
            pull = trainer.call("local_pull", addr=master_addr, run=f"bench-chain-{p}", reps=15)

            progress(f"{p} relay(s): master sends to each relay in turn")
            seq = trainer.call("sequential", addrs=chain, version=1, run=f"bench-seq-{p}", chunk_bytes=None)
            storage_s = None
            if cfg.storage:
                progress(f"{p} relay(s): object store write, then {p} reads")
                key = f"bench/{p}/model.safetensors"
                put = trainer.call("store_put", key=key)
                for r in readers[:p]:
                    r.send("store_get", key=key)
                ends = [r.result()["end"] for r in readers[:p]]
                storage_s = max(ends) - put["start"]
                trainer.call("store_delete", key=key)
            results.append({
                "relays": p,
                "chunk_bytes": chunk,
                "stall_s": statistics.median(stalls[p]),
                "stall_each_s": stalls[p],  # in round order; round k of every relay count ran back to back
                "all_relays_s": statistics.median(alls[p]),
                "single_hop_s": link["single_hop_s"],
                "sequential_s": seq["end"] - seq["start"],
                "storage_s": storage_s,
                "model_s": protocol.chain_model_s(size, p + 1, link["bytes_per_s"], link["t_start_s"]),
                "local_pull_gbps": pull["local_pull_gbps"],
                "local_pull_median_gbps": pull["local_pull_median_gbps"],
                "local_pull_each_s": pull["pulls_s"],  # in order, each right after a memcpy_each_s
                "memcpy_each_s": pull["memcpys_s"],
                # the best memcpy timed in this pull phase (one right before each pull): the same minutes of the
                # machine as the pulls it is compared with
                "memcpy_gbps": pull["memcpy_gbps"],
                "local_pull_fraction_of_memcpy": pull["local_pull_gbps"] / pull["memcpy_gbps"],
                # against the best memcpy of the whole run (the run's start included): the ratio this benchmark
                # reported before 2026-12-01; a slow minute of a shared machine during the pulls lowers it
                "local_pull_fraction_of_best_memcpy": pull["local_pull_gbps"] / max(memcpy, pull["memcpy_gbps"]),
                "relay_cpu_s_per_gib": statistics.mean(forwarding) if forwarding else None,
                "relay_cpu_s_per_gib_max": max(forwarding) if forwarding else None,
                "tail_cpu_s_per_gib": cpu[-1],
                "master_cpu_s_per_gib": cpu[0],
                "forward_bytes_per_s": p * size / statistics.median(alls[p]),
            })
    shutil.rmtree(log_dir, ignore_errors=True)
    return {
        "size": size,
        "rate_mbit": cfg.rate_mbit,
        "transport": "netns+veth+tc tbf" if cfg.rate_mbit else "loopback",
        "macs": cfg.macs,
        "cpus": os.cpu_count(),
        "reps": cfg.reps,
        "memcpy_gbps": max([memcpy, *(r["memcpy_gbps"] for r in results)]),
        "loopback_tcp_bytes_per_s": loopback,
        "link": {"bytes_per_s": link["bytes_per_s"], "t_start_s": link["t_start_s"],
                 "single_hop_s": link["single_hop_s"]},
        "results": results,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def done_when(report: dict[str, Any]) -> list[tuple[str, float, str, bool]]:
    """The issue's acceptance ratios at the largest relay count: (what, value, bound, holds)."""
    rows = report["results"]
    first, last = rows[0], rows[-1]
    checks = [
        (f"all_relays / single_hop at {last['relays']} relays", last["all_relays_s"] / last["single_hop_s"], "<= 1.5"),
        (f"sequential / all_relays at {last['relays']} relays", last["sequential_s"] / last["all_relays_s"], ">= 4"),
        (f"stall({last['relays']}) / stall({first['relays']})", last["stall_s"] / first["stall_s"], "<= 1.1"),
        ("local pull / memcpy", min(r["local_pull_fraction_of_memcpy"] for r in rows), ">= 0.8"),
    ]
    out = []
    for what, value, bound in checks:
        op, limit = bound.split()
        out.append((what, value, bound, value <= float(limit) if op == "<=" else value >= float(limit)))
    return out


def plot(report: dict[str, Any], path: Path) -> None:
    """Broadcast time vs relay count for every method, next to the chain model and the trainer stall."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    xs = [r["relays"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = [("all_relays_s", "chain broadcast (measured)", "o-"), ("model_s", "chain model", "k--"),
              ("sequential_s", "master to each relay in turn", "s-"), ("storage_s", "object store", "^-"),
              ("single_hop_s", "one hop", ":"), ("stall_s", "trainer stall", "d-")]
    for key, label, style in series:
        ys = [r[key] for r in rows]
        if all(y is not None for y in ys):
            ax.plot(xs, ys, style, label=label)
    rate = f"{report['rate_mbit']:g} Mbit/s links" if report["rate_mbit"] else "loopback"
    ax.set(xlabel="relays", ylabel="seconds", xticks=xs,
           title=f"Publishing {report['size'] / 2**20:.0f} MiB to p relays ({rate}, {report['cpus']} CPUs)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
