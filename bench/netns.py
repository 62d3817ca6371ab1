"""A rate-limited test network: one Linux network namespace per node, joined by veth pairs to a bridge.

On a 2-core machine loopback TCP is limited by the CPU, not a wire; to measure a broadcast the way it
behaves on a cluster, each node (trainer + master relay, each relay, the object store) gets its own
namespace whose only interface `eth0` sends through a `tc tbf` rate limit, so every node's uplink is a
link of `rate_mbit`. The bridge lives in a namespace of its own; nothing touches the host's network,
and only the 10.77.0.0/24 addresses inside these namespaces are used. Names carry the prefix
`lmr-<pid>-`, so parallel runs never collide; `close()` (also on failure) deletes every namespace,
which removes its veth ends with it. Needs root and iproute2 (`ip`, `tc`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

from laminar.errors import LaminarError
from laminar.logs import get_logger

log = get_logger("laminar.bench.netns")

SUBNET = "10.77.0"


class NetnsError(LaminarError):
    """The benchmark network (namespaces, veth pairs, tc rate limits) could not be set up."""


@dataclass
class Netns:
    """Namespaces for nodes named in `nodes`, each with address SUBNET.<i+1>, uplinks of rate_mbit."""

    nodes: list[str]
    rate_mbit: float
    prefix: str = field(default_factory=lambda: f"lmr-{os.getpid()}-")
    addresses: dict[str, str] = field(default_factory=dict)
    _created: list[str] = field(default_factory=list)

    @property
    def bridge_ns(self) -> str:
        return f"{self.prefix}br"

    def ns(self, node: str) -> str:
        return f"{self.prefix}{node}"

    def exec_prefix(self, node: str) -> list[str]:
        """The argv prefix that runs a command inside `node`'s namespace."""
        return ["ip", "netns", "exec", self.ns(node)]

    def __enter__(self) -> Netns:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def open(self) -> None:
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise NetnsError(f"`{tool}` not found; install iproute2 (apt-get install -y iproute2) or run "
                                 "the benchmark without --rate (loopback)")
        if os.geteuid() != 0:
            raise NetnsError("network namespaces need root; run as root or without --rate (loopback)")
        if len(self.nodes) > 250:
            raise NetnsError(f"{len(self.nodes)} nodes do not fit {SUBNET}.0/24")
        self._add_ns(self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        # Burst: 2 ms at the line rate, at least 256 KiB so 64 KiB GSO packets always pass.
        burst = max(256 << 10, int(self.rate_mbit * 1e6 / 8 * 0.002))
        for i, node in enumerate(self.nodes):
            ns, peer, addr = self.ns(node), f"p{i}", f"{SUBNET}.{i + 1}"
            self._add_ns(ns)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", peer, "netns", self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "set", peer, "master", "br0")
            _ip("-n", self.bridge_ns, "link", "set", peer, "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _run(["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", f"{self.rate_mbit}mbit",
                  "burst", str(burst), "latency", "100ms"])
            self.addresses[node] = addr
        log.info("netns_created", prefix=self.prefix, nodes=len(self.nodes), rate_mbit=self.rate_mbit)

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)

    def close(self) -> None:
        """Delete every namespace this run created (their veth ends go with them); never raises."""
        for name in reversed(self._created):
            try:
                _ip("netns", "del", name)
            except NetnsError as exc:
                log.warning("netns_delete_failed", namespace=name, error=str(exc))
        self._created.clear()


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
