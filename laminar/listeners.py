"""Secure by default off loopback: the one rule every listening socket of the project checks before it binds.

A listener bound to a loopback address is reachable from this machine only. Bound to anything else
(a LAN address, `0.0.0.0`, `::`, a host name that resolves to a non-loopback address) it is reachable
by whoever can route to it, so it must hold its secret:

| listener                       | its secret                                   | without it off loopback       |
|--------------------------------|----------------------------------------------|-------------------------------|
| weight relay (relay/server.py) | LAMINAR_RELAY_TOKEN (handshake + per-chunk MAC) | refuses to start           |
| metrics endpoint (laminar.metrics) | LAMINAR_METRICS_TOKEN (HTTP bearer token) | refuses to start             |
| S3 dev server (devstack.s3_server) | none (moto accepts any credentials)      | refuses to start              |

`check_bind` raises ConfigError naming the variable to set, or the explicit `--insecure` /
`LAMINAR_INSECURE=1` that accepts the risk; an accepted insecure bind logs `insecure_listener` at
warning level, naming the listener, the address and the risk. Nothing is ever silent.
"""

from __future__ import annotations

import ipaddress
import os
import socket

from laminar.errors import ConfigError
from laminar.logs import get_logger

log = get_logger("listeners")

INSECURE_VARIABLE = "LAMINAR_INSECURE"
INSECURE_HOW = "--insecure (or LAMINAR_INSECURE=1)"
_TRUE = ("1", "true", "yes", "on")


def insecure_from_env(env: dict[str, str] | None = None) -> bool:
    """Whether LAMINAR_INSECURE accepts insecure listeners (1/true/yes/on, any case); for processes without
    Settings (the S3 dev server). Settings.insecure reads the same variable."""
    value = (os.environ if env is None else env).get(INSECURE_VARIABLE, "")
    return value.strip().lower() in _TRUE


def is_loopback(host: str) -> bool:
    """True when `host` (an IP address or a name) only ever means this machine: 127.0.0.0/8, ::1, or a name
    every address of which is loopback. The wildcard addresses (0.0.0.0, ::) are every interface: False.
    A name that does not resolve is not loopback (the bind would fail anyway)."""
    name = host.strip("[]")
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    addrs = {info[4][0] for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def check_bind(listener: str, host: str, *, secret: str | None, variable: str | None, insecure: bool,
               risk: str) -> None:
    """Refuse to let `listener` bind `host` off loopback without its secret (held in `variable`).

    Loopback, or a secret: returns. Off loopback without it: ConfigError naming the variable and the
    explicit opt-out, unless `insecure`, which logs a warning naming the risk and returns. variable None:
    the listener has no secret of its own (only loopback or the opt-out).
    """
    if secret or is_loopback(host):
        return
    if insecure:
        log.warning("insecure_listener", listener=listener, bind=host, missing=variable or "no secret exists",
                    risk=risk, accepted_by=INSECURE_HOW)
        return
    fix = (f"Set {variable} (a secret of at least 16 characters, which its peers hold too), "
           "or bind to 127.0.0.1," if variable else "It has no secret of its own: bind it to 127.0.0.1,")
    without = f", without {variable}" if variable else ""
    raise ConfigError(f"{listener} would listen on {host}, which is not a loopback address{without}: {risk}. "
                      f"{fix} or accept the risk by name with {INSECURE_HOW}")
