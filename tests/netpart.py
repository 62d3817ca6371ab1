"""A relay's port partitioned for tests: every packet to or from the port silently dropped (a gray failure: the
process lives and heartbeats, its data plane is unreachable), inside a private network namespace so that nothing
else on the machine is touched.

`run_in_netns(argv)` runs a command in a fresh namespace (its own loopback, up) and deletes the namespace after.
Inside it, `blackhole(port)` drops the port's packets on the loopback device: an HTB root qdisc whose class 1:2
holds a pfifo of limit 0 (every packet enqueued there is dropped) and two u32 filters, destination port and source
port, steering the port's packets there; leaving the block removes the qdisc. This needs root, `ip` and `tc`, and
the kernel's network namespaces, sch_htb and cls_u32 (iptables and netem are not needed). `unavailable()` says why
not, for a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """None when partitions can be made here; else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "needs the ip and tc commands (iproute2)"
    name = f"lmnr-probe-{uuid.uuid4().hex[:8]}"
    made = _run("ip", "netns", "add", name)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        htb = _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb")
        if htb.returncode != 0:
            return f"tc cannot add an htb qdisc: {htb.stderr.strip()}"
        return None
    finally:
        _run("ip", "netns", "del", name)


def run_in_netns(argv: Sequence[str], env: dict[str, str] | None = None, timeout_s: float = 600,
                 **kwargs) -> subprocess.CompletedProcess:
    """Run argv in a fresh network namespace whose loopback is up; the namespace is deleted afterwards."""
    name = f"lmnr-test-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True, timeout=30)
        return subprocess.run(["ip", "netns", "exec", name, *argv], env=env, timeout=timeout_s, **kwargs)
    finally:
        subprocess.run(["ip", "netns", "del", name], timeout=30)


def _tc(*args: str) -> None:
    done = _run("tc", *args)
    if done.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} failed: {done.stderr.strip()}")


def drop_port(port: int, dev: str = "lo") -> None:
    """Start dropping every packet to or from `port` on dev (this process's network namespace)."""
    _tc("qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
    try:
        for classid in ("1:1", "1:2"):
            _tc("class", "add", "dev", dev, "parent", "1:", "classid", classid, "htb", "rate", "100gbit")
        _tc("qdisc", "add", "dev", dev, "parent", "1:2", "handle", "20:", "pfifo", "limit", "0")
        for field in ("dport", "sport"):
            _tc("filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                "match", "ip", field, str(port), "0xffff", "flowid", "1:2")
    except BaseException:
        heal(dev)
        raise


def heal(dev: str = "lo") -> None:
    """Stop dropping (remove the root qdisc drop_port added)."""
    _run("tc", "qdisc", "del", "dev", dev, "root")


@contextmanager
def blackhole(port: int, dev: str = "lo") -> Iterator[None]:
    drop_port(port, dev)
    try:
        yield
    finally:
        heal(dev)
