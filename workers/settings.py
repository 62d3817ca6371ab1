"""Deployment settings (where things are), read only here from `LAMINAR_*` environment variables.

Every process entry point calls `Settings.from_env()` once and passes the result down; launchers hand
the same values to child processes with `Settings.to_env()`. An empty variable counts as unset.

| variable                  | default                                                          |
|---------------------------|------------------------------------------------------------------|
| LAMINAR_HOME              | `.laminar` under the current directory (state dir)               |
| LAMINAR_TEMPORAL_ADDRESS  | address in `<home>/dev.json` (`laminar dev up`), else 127.0.0.1:7233 |
| LAMINAR_NAMESPACE         | `default`                                                        |
| LAMINAR_STORE             | S3 url in dev.json when the dev stack runs S3, else `file://<home>/store` |
| LAMINAR_S3_ENDPOINT       | S3 endpoint in dev.json when the dev stack runs S3, else none (AWS) |
| LAMINAR_HOST_ID           | `host-0`                                                         |
| LAMINAR_RELAY_BIND        | `127.0.0.1`                                                      |
| LAMINAR_RELAY_TOKEN       | none: relays accept unauthenticated peers (`laminar run` sets one) |
| LAMINAR_LOG_FORMAT        | `console` (or `json`)                                            |
| LAMINAR_LOG_LEVEL         | `info` (debug, info, warning, error, critical)                   |
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from laminar.errors import ConfigError, DevStackError
from workers.devstack import DevStackInfo, read_record

DEFAULT_TEMPORAL_ADDRESS = "127.0.0.1:7233"
LOG_FORMATS = ("console", "json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

_HOST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_HOSTNAME = re.compile(
    r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)
_NAMESPACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{1,254}$")


@dataclass(frozen=True)
class Settings:
    """Where things are for this deployment; see the module docstring for variables and defaults."""

    home: Path  # state dir (dev.json, logs, SQLite, file store); absolute
    temporal_address: str  # host:port of the Temporal frontend (gRPC)
    namespace: str  # Temporal namespace
    store_url: str  # object store root: file:///abs/path or s3://bucket[/prefix]
    s3_endpoint: str | None  # http(s)://host:port of an S3-compatible server; None = AWS
    host_id: str  # this machine's name in task-queue names
    relay_bind: str  # address the weight relay listens on
    relay_token: str | None  # shared run token relays demand (HMAC challenge); None: no authentication
    log_format: str  # console | json
    log_level: str  # debug | info | warning | error | critical

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, cwd: Path | None = None) -> Settings:
        """Read and validate the settings; raise ConfigError naming the variable, the value and the fix."""
        env = os.environ if env is None else env

        def get(name: str) -> str | None:
            value = env.get(name, "")
            return value.strip() or None

        home = _parse_home(get("LAMINAR_HOME"), cwd or Path.cwd())
        dev = _dev_record(home)
        dev_s3 = dev is not None and dev.s3_endpoint is not None

        address = get("LAMINAR_TEMPORAL_ADDRESS")
        if address is not None:
            _check_address("LAMINAR_TEMPORAL_ADDRESS", address)
        else:
            address = dev.temporal_address if dev is not None else DEFAULT_TEMPORAL_ADDRESS

        namespace = get("LAMINAR_NAMESPACE") or "default"
        if not _NAMESPACE.match(namespace):
            raise _invalid(
                "LAMINAR_NAMESPACE", namespace, "use 2-255 letters, digits, '.', '_' or '-' (e.g. default)"
            )

        store_url = get("LAMINAR_STORE")
        if store_url is not None:
            _check_store_url(store_url)
        else:
            store_url = dev.store_url if dev_s3 else (home / "store").as_uri()

        s3_endpoint = get("LAMINAR_S3_ENDPOINT")
        if s3_endpoint is not None:
            if not re.match(r"^https?://[^/\s]+/?$", s3_endpoint):
                raise _invalid(
                    "LAMINAR_S3_ENDPOINT", s3_endpoint, "use http(s)://host:port, e.g. http://127.0.0.1:9000"
                )
            s3_endpoint = s3_endpoint.rstrip("/")
        elif dev_s3:
            s3_endpoint = dev.s3_endpoint

        host_id = get("LAMINAR_HOST_ID") or "host-0"
        if not _HOST_ID.match(host_id):
            raise _invalid(
                "LAMINAR_HOST_ID", host_id, "use up to 63 letters, digits, '.', '_' or '-' (e.g. host-0)"
            )

        relay_bind = get("LAMINAR_RELAY_BIND") or "127.0.0.1"
        if not _is_host(relay_bind):
            raise _invalid("LAMINAR_RELAY_BIND", relay_bind, "use an IP address or host name, without a port")

        relay_token = get("LAMINAR_RELAY_TOKEN")
        if relay_token is not None and len(relay_token) < 16:
            raise _invalid("LAMINAR_RELAY_TOKEN", "<hidden>", "use a secret of at least 16 characters "
                           "(e.g. `python -c 'import secrets; print(secrets.token_hex(16))'`)")

        log_format = (get("LAMINAR_LOG_FORMAT") or "console").lower()
        if log_format not in LOG_FORMATS:
            raise _invalid("LAMINAR_LOG_FORMAT", log_format, f"use one of {', '.join(LOG_FORMATS)}")

        log_level = (get("LAMINAR_LOG_LEVEL") or "info").lower()
        if log_level not in LOG_LEVELS:
            raise _invalid("LAMINAR_LOG_LEVEL", log_level, f"use one of {', '.join(LOG_LEVELS)}")

        return cls(
            home=home,
            temporal_address=address,
            namespace=namespace,
            store_url=store_url,
            s3_endpoint=s3_endpoint,
            host_id=host_id,
            relay_bind=relay_bind,
            relay_token=relay_token,
            log_format=log_format,
            log_level=log_level,
        )

    def to_env(self) -> dict[str, str]:
        """The same settings as `LAMINAR_*` variables, so `from_env(s.to_env()) == s` in a child process."""
        env = {
            "LAMINAR_HOME": str(self.home),
            "LAMINAR_TEMPORAL_ADDRESS": self.temporal_address,
            "LAMINAR_NAMESPACE": self.namespace,
            "LAMINAR_STORE": self.store_url,
            "LAMINAR_HOST_ID": self.host_id,
            "LAMINAR_RELAY_BIND": self.relay_bind,
            "LAMINAR_LOG_FORMAT": self.log_format,
            "LAMINAR_LOG_LEVEL": self.log_level,
        }
        if self.s3_endpoint is not None:
            env["LAMINAR_S3_ENDPOINT"] = self.s3_endpoint
        if self.relay_token is not None:
            env["LAMINAR_RELAY_TOKEN"] = self.relay_token
        return env

    def with_relay_token(self, token: str) -> Settings:
        return replace(self, relay_token=token)


def _invalid(name: str, value: str, fix: str) -> ConfigError:
    return ConfigError(f"{name}={value!r} is invalid; {fix}")


def _parse_home(value: str | None, cwd: Path) -> Path:
    path = Path(value or ".laminar").expanduser()
    if not path.is_absolute():
        path = cwd / path
    path = path.resolve()
    if path.exists() and not path.is_dir():
        raise _invalid(
            "LAMINAR_HOME",
            value or ".laminar",
            f"{path} exists and is not a directory; point it at a directory",
        )
    return path


def _dev_record(home: Path) -> DevStackInfo | None:
    try:
        return read_record(home)
    except DevStackError as e:
        raise ConfigError(f"{e}; LAMINAR_* defaults are taken from it") from e


def _check_address(name: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    if (
        not sep
        or not host
        or not port.isdigit()
        or not 0 < int(port) < 65536
        or not _is_host(host.strip("[]"))
    ):
        raise _invalid(name, value, "use host:port, e.g. 127.0.0.1:7233")


def _check_store_url(value: str) -> None:
    if value.startswith("file://"):
        if not value[len("file://") :].startswith("/"):
            raise _invalid("LAMINAR_STORE", value, "use an absolute path, e.g. file:///data/laminar-store")
    elif value.startswith("s3://"):
        if not re.match(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$", value):
            raise _invalid("LAMINAR_STORE", value, "use s3://bucket[/prefix] with a valid bucket name")
    else:
        raise _invalid("LAMINAR_STORE", value, "use file:///abs/path or s3://bucket[/prefix]")


def _is_host(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return bool(_HOSTNAME.match(value))
