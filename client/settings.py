"""Deployment settings (where things are), read only here from `LAMINAR_*` environment variables.

Every process entry point calls `Settings.from_env()` once and passes the result down; launchers hand
the same values to child processes with `Settings.to_env()`. An empty variable counts as unset.
The variables are read and validated by pydantic-settings (`_Variables`); `Settings` adds the defaults
that depend on the state dir (dev.json).

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
| LAMINAR_METRICS_PORT      | `0`: no Prometheus endpoint (`laminar run` gives each process a free port) |
| LAMINAR_METRICS_BIND      | `127.0.0.1`: the interface the metrics endpoint listens on       |
| LAMINAR_METRICS_TOKEN     | none: the endpoint asks no token; required off loopback (`Authorization: Bearer`) |
| LAMINAR_INSECURE          | `false`: a relay or metrics endpoint off loopback without its secret refuses to start |
| LAMINAR_NOTICE_S          | `30`: a worker told to leave (SIGTERM, `laminar drain`) finishes within this (s) |
| LAMINAR_RELAY_CONNECT_TIMEOUT_S | `1`: connecting to a relay gives up after this (s); then the next relay is used |
| LAMINAR_RELAY_IO_TIMEOUT_S | `2`: a relay connection idle this long (no byte read or written) has failed (s) |
| LAMINAR_TEMPORAL_TLS      | `false`; on by itself when any variable below is set             |
| LAMINAR_TEMPORAL_TLS_CERT | none: the client certificate (PEM file) for mTLS; with _KEY      |
| LAMINAR_TEMPORAL_TLS_KEY  | none: its private key (PEM file)                                 |
| LAMINAR_TEMPORAL_TLS_CA   | none: the system's roots; else the CA (PEM) of the server's cert  |
| LAMINAR_TEMPORAL_TLS_SERVER_NAME | none: the address's host; the name on the server's certificate |
| LAMINAR_TEMPORAL_API_KEY  | none: an API key (Temporal Cloud), sent as `Authorization: Bearer` |

TLS file paths are resolved against the current directory and checked here (exists, is PEM of the right kind),
so that a wrong path fails every command and worker at once, naming the variable.
"""

from __future__ import annotations

import ipaddress
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from laminar.devstack.record import DevStackInfo, read_record
from laminar.errors import ConfigError, DevStackError
from laminar.private import private_dir

DEFAULT_TEMPORAL_ADDRESS = "127.0.0.1:7233"
LOG_FORMATS = ("console", "json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

_HOSTNAME = re.compile(
    r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)


def _is_host(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return bool(_HOSTNAME.match(value))


def _host(value: str) -> str:
    if not _is_host(value):
        raise ValueError(value)
    return value


def _address(value: str) -> str:
    host, _, port = value.rpartition(":")
    if not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(value)
    _host(host.strip("[]"))
    return value


_Lower = BeforeValidator(lambda v: v.lower() if isinstance(v, str) else v)

# The fix each variable's error message suggests; the message also names the variable and the value.
_FIXES = {
    "temporal_address": "use host:port, e.g. 127.0.0.1:7233",
    "namespace": "use 2-255 letters, digits, '.', '_' or '-' (e.g. default)",
    "store": "use an absolute path as file:///abs/path or s3://bucket[/prefix] with a valid bucket name",
    "s3_endpoint": "use http(s)://host:port, e.g. http://127.0.0.1:9000",
    "host_id": "use up to 63 letters, digits, '.', '_' or '-' (e.g. host-0)",
    "relay_bind": "use an IP address or host name, without a port",
    "relay_token": "use a secret of at least 16 characters "
    "(e.g. `python -c 'import secrets; print(secrets.token_hex(16))'`)",
    "log_format": f"use one of {', '.join(LOG_FORMATS)}",
    "log_level": f"use one of {', '.join(LOG_LEVELS)}",
    "metrics_port": "use a port number 1-65535, or 0 to turn the metrics endpoint off",
    "metrics_bind": "use an IP address or host name, without a port",
    "metrics_token": "use a secret of at least 16 characters "
    "(e.g. `python -c 'import secrets; print(secrets.token_hex(16))'`)",
    "insecure": "use 1 or true to accept listeners off loopback without their secret, 0 or false (the default) "
    "to refuse them",
    "notice_s": "use seconds between 1 and 3600 (a preemption warning is typically 30-120 s)",
    "relay_connect_timeout_s": "use seconds between 0.01 and 600; about 1 on a LAN (a connect takes < 1 ms there)",
    "relay_io_timeout_s": "use seconds between 0.01 and 600; a few on a LAN (the longest a healthy relay is silent)",
    "temporal_tls": "use true or false (TLS turns on by itself when a LAMINAR_TEMPORAL_TLS_* variable or "
    "LAMINAR_TEMPORAL_API_KEY is set)",
    "temporal_tls_server_name": "use the host name on the server's certificate, without a port",
    "temporal_api_key": "use the API key as issued (no 'Bearer ' prefix, no spaces)",
}
_SECRETS = ("relay_token", "temporal_api_key", "metrics_token")  # never echoed in an error message

# LAMINAR_TEMPORAL_TLS_* files: variable, what the file must hold, the PEM marker that shows it does.
_TLS_FILES = {
    "temporal_tls_cert": ("the client certificate (PEM)", "-----BEGIN CERTIFICATE-----"),
    "temporal_tls_key": ("the client certificate's private key (PEM)", "PRIVATE KEY-----"),
    "temporal_tls_ca": ("the CA certificate(s) of the server's certificate (PEM)", "-----BEGIN CERTIFICATE-----"),
}


class _Variables(BaseSettings):
    """The LAMINAR_* variables as set (None: unset or blank), each validated; Settings resolves defaults."""

    model_config = SettingsConfigDict(env_prefix="LAMINAR_", extra="ignore", frozen=True)

    home: str | None = None
    temporal_address: Annotated[str, AfterValidator(_address)] | None = None
    namespace: str = Field("default", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{1,254}$")
    store: str | None = Field(None, pattern=r"^(file:///|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/|$))")
    s3_endpoint: Annotated[str, AfterValidator(lambda v: v.rstrip("/"))] | None = Field(
        None, pattern=r"^https?://[^/\s]+/?$"
    )
    host_id: str = Field("host-0", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    relay_bind: Annotated[str, AfterValidator(_host)] = "127.0.0.1"
    relay_token: str | None = Field(None, min_length=16)
    log_format: Annotated[Literal[LOG_FORMATS], _Lower] = "console"  # type: ignore[valid-type]
    log_level: Annotated[Literal[LOG_LEVELS], _Lower] = "info"  # type: ignore[valid-type]
    metrics_port: int = Field(0, ge=0, le=65535)
    metrics_bind: Annotated[str, AfterValidator(_host)] = "127.0.0.1"
    metrics_token: str | None = Field(None, min_length=16)
    insecure: bool = False
    notice_s: float = Field(30.0, ge=1.0, le=3600.0)
    relay_connect_timeout_s: float = Field(1.0, ge=0.01, le=600.0)
    relay_io_timeout_s: float = Field(2.0, ge=0.01, le=600.0)
    temporal_tls: bool | None = None
    temporal_tls_cert: str | None = None
    temporal_tls_key: str | None = None
    temporal_tls_ca: str | None = None
    temporal_tls_server_name: Annotated[str, AfterValidator(_host)] | None = None
    temporal_api_key: str | None = Field(None, pattern=r"^[^\s]+$")

    @model_validator(mode="before")
    @classmethod
    def _blank_is_unset(cls, data: object) -> object:
        if isinstance(data, Mapping):
            return {k: v.strip() for k, v in data.items() if not isinstance(v, str) or v.strip()}
        return data

    @classmethod
    def read(cls, env: Mapping[str, str] | None) -> _Variables:
        """From os.environ (env None) or the given mapping; ConfigError naming the variable, value and fix."""
        try:
            if env is None:
                return cls()
            prefix = cls.model_config["env_prefix"]
            return cls.model_validate({k[len(prefix):].lower(): v for k, v in env.items() if k.startswith(prefix)})
        except ValidationError as e:
            problems = []
            for err in e.errors():
                field = str(err["loc"][0])
                value = "<hidden>" if field in _SECRETS else err["input"]  # never echo secrets
                problems.append(_invalid(f"LAMINAR_{field.upper()}", value, _FIXES[field]))
            raise ConfigError("; ".join(str(p) for p in problems)) from None


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
    metrics_port: int = 0  # Prometheus endpoint of this process (laminar.metrics); 0: off
    metrics_bind: str = "127.0.0.1"
    # laminar.listeners: the metrics endpoint's bearer token (required off loopback); insecure: accept a relay or
    # metrics endpoint off loopback without its secret (a warning names the risk) instead of refusing to start
    metrics_token: str | None = field(default=None, repr=False)
    insecure: bool = False
    notice_s: float = 30.0  # a worker told to leave (laminar/notice.py) lets its work finish within this
    relay_connect_timeout_s: float = 1.0  # relay.client.TIMEOUTS: bounded by what the network needs, not 30 s
    relay_io_timeout_s: float = 2.0
    # Temporal over TLS (client/connect.py): on/off; mTLS client cert + key, the server's CA, the name on its
    # certificate (absolute paths, checked to exist and hold PEM); or an API key (kept out of repr and errors).
    temporal_tls: bool = False
    temporal_tls_cert: Path | None = None
    temporal_tls_key: Path | None = None
    temporal_tls_ca: Path | None = None
    temporal_tls_server_name: str | None = None
    temporal_api_key: str | None = field(default=None, repr=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, cwd: Path | None = None) -> Settings:
        """Read and validate the settings (os.environ when env is None); raise ConfigError naming the
        variable, the value and the fix. Unset values default to the dev stack's dev.json, if any."""
        v = _Variables.read(env)
        cwd = cwd or Path.cwd()
        home = _parse_home(v.home, cwd)
        try:
            private_dir(home)  # the state directory is owner-only (laminar/private.py)
        except OSError as e:
            raise _invalid("LAMINAR_HOME", v.home or ".laminar", f"cannot create {home} ({e.strerror}); point it "
                           "at a directory this user can create") from e
        tls = _temporal_tls(v, cwd)
        dev = _dev_record(home)
        dev_s3 = dev is not None and dev.s3_endpoint is not None
        return cls(
            home=home,
            temporal_address=v.temporal_address
            or (dev.temporal_address if dev is not None else DEFAULT_TEMPORAL_ADDRESS),
            namespace=v.namespace,
            store_url=v.store or (dev.store_url if dev_s3 else (home / "store").as_uri()),
            s3_endpoint=v.s3_endpoint or (dev.s3_endpoint if dev_s3 else None),
            host_id=v.host_id,
            relay_bind=v.relay_bind,
            relay_token=v.relay_token,
            log_format=v.log_format,
            log_level=v.log_level,
            metrics_port=v.metrics_port,
            metrics_bind=v.metrics_bind,
            metrics_token=v.metrics_token,
            insecure=v.insecure,
            notice_s=v.notice_s,
            relay_connect_timeout_s=v.relay_connect_timeout_s,
            relay_io_timeout_s=v.relay_io_timeout_s,
            **tls,
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
            "LAMINAR_METRICS_PORT": str(self.metrics_port),
            "LAMINAR_METRICS_BIND": self.metrics_bind,
            "LAMINAR_NOTICE_S": f"{self.notice_s:g}",
            "LAMINAR_RELAY_CONNECT_TIMEOUT_S": f"{self.relay_connect_timeout_s:g}",
            "LAMINAR_RELAY_IO_TIMEOUT_S": f"{self.relay_io_timeout_s:g}",
        }
        if self.s3_endpoint is not None:
            env["LAMINAR_S3_ENDPOINT"] = self.s3_endpoint
        if self.relay_token is not None:
            env["LAMINAR_RELAY_TOKEN"] = self.relay_token
        if self.metrics_token is not None:
            env["LAMINAR_METRICS_TOKEN"] = self.metrics_token
        env["LAMINAR_INSECURE"] = "true" if self.insecure else "false"
        env["LAMINAR_TEMPORAL_TLS"] = "true" if self.temporal_tls else "false"
        for name in ("temporal_tls_cert", "temporal_tls_key", "temporal_tls_ca", "temporal_tls_server_name",
                     "temporal_api_key"):
            if (value := getattr(self, name)) is not None:
                env[f"LAMINAR_{name.upper()}"] = str(value)
        return env

    def with_relay_token(self) -> Settings:
        """These settings with a relay token: LAMINAR_RELAY_TOKEN's, else a fresh one for this run's processes."""
        return self if self.relay_token else replace(self, relay_token=secrets.token_hex(16))


def process_table_path(home: Path, run_id: str) -> Path:
    """`<LAMINAR_HOME>/runs/<run_id>/processes.json`: the local launcher's process table of a `laminar run`
    (workers/launcher.py writes it; `laminar chaos` reads it: chaos/command.py, chaos/nemesis.py)."""
    return home / "runs" / run_id / "processes.json"


def _invalid(name: str, value: str, fix: str) -> ConfigError:
    return ConfigError(f"{name}={value!r} is invalid; {fix}")


def _temporal_tls(v: _Variables, cwd: Path) -> dict[str, object]:
    """The Temporal TLS fields of Settings: files resolved and checked, cert and key both or neither, TLS on
    when anything asks for it and refused when LAMINAR_TEMPORAL_TLS=false contradicts that."""
    files = {name: _tls_file(name, getattr(v, name), cwd) for name in _TLS_FILES}
    cert, key = v.temporal_tls_cert, v.temporal_tls_key
    if (cert is None) != (key is None):
        have, missing = ("CERT", "KEY") if cert is not None else ("KEY", "CERT")
        raise ConfigError(
            f"LAMINAR_TEMPORAL_TLS_{missing} is unset while LAMINAR_TEMPORAL_TLS_{have}={cert or key!r} is set; "
            "set both (the client certificate and its private key) or neither"
        )
    asked = [f"LAMINAR_{n.upper()}" for n in (*_TLS_FILES, "temporal_tls_server_name", "temporal_api_key")
             if getattr(v, n) is not None]
    if v.temporal_tls is False and asked:
        raise ConfigError(
            f"LAMINAR_TEMPORAL_TLS=false contradicts {', '.join(asked)}: those need TLS; "
            "unset LAMINAR_TEMPORAL_TLS (or set it to true), or unset them"
        )
    return {
        "temporal_tls": bool(v.temporal_tls) or bool(asked),
        **files,
        "temporal_tls_server_name": v.temporal_tls_server_name,
        "temporal_api_key": v.temporal_api_key,
    }


def _tls_file(name: str, value: str | None, cwd: Path) -> Path | None:
    if value is None:
        return None
    what, marker = _TLS_FILES[name]
    variable = f"LAMINAR_{name.upper()}"
    path = Path(value).expanduser()
    path = (path if path.is_absolute() else cwd / path).resolve()
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        raise _invalid(variable, value, f"{path} does not exist; point it at {what}") from None
    except OSError as e:
        raise _invalid(variable, value, f"cannot read {path} ({e.strerror}); point it at {what} "
                                         "that this user can read") from None
    if marker not in text:
        raise _invalid(variable, value, f"{path} has no '{marker}' block; point it at {what}")
    return path


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
