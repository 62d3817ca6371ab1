"""Temporal client and object store for a process, from its deployment settings."""

from __future__ import annotations

import os
from pathlib import Path

from temporalio.client import Client
from temporalio.runtime import Runtime, TelemetryConfig
from temporalio.service import TLSConfig

from laminar.client.converter import DATA_CONVERTER
from laminar.client.settings import Settings
from laminar.devstack.record import S3_CREDENTIALS, read_record
from laminar.errors import LaminarError
from laminar.storage.objects import ObjectStore, open_store


async def connect(settings: Settings, core_logs: bool = True) -> Client:
    """A client of the settings' Temporal, over TLS (mTLS, API key) as the LAMINAR_TEMPORAL_* settings say.
    core_logs=False: the SDK core prints nothing to stderr (its retry warnings would tear through `laminar run`'s
    progress bar, which shows an outage itself)."""
    runtime = None if core_logs else Runtime(telemetry=TelemetryConfig(logging=None))
    tls = tls_config(settings)
    try:
        return await Client.connect(settings.temporal_address, namespace=settings.namespace, runtime=runtime,
                                    tls=tls, api_key=settings.temporal_api_key, data_converter=DATA_CONVERTER)
    except RuntimeError as e:
        raise LaminarError(
            f"cannot reach Temporal at {settings.temporal_address} (namespace {settings.namespace}) "
            f"{_how(settings)}: {e}; {_fix(settings)}"
        ) from None


def tls_config(settings: Settings) -> TLSConfig | bool:
    """What Client.connect takes as `tls`: False (plain), True (system roots, no client certificate) or a
    TLSConfig with the files' contents (read now, so a renewed certificate is used from the next start)."""
    if not settings.temporal_tls:
        return False
    if settings.temporal_tls_cert is None and settings.temporal_tls_ca is None \
            and settings.temporal_tls_server_name is None:
        return True
    return TLSConfig(
        server_root_ca_cert=_read(settings.temporal_tls_ca, "LAMINAR_TEMPORAL_TLS_CA"),
        domain=settings.temporal_tls_server_name,
        client_cert=_read(settings.temporal_tls_cert, "LAMINAR_TEMPORAL_TLS_CERT"),
        client_private_key=_read(settings.temporal_tls_key, "LAMINAR_TEMPORAL_TLS_KEY"),
    )


def _read(path: Path | None, variable: str) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as e:  # checked by Settings.from_env; gone or unreadable since
        raise LaminarError(f"{variable}={str(path)!r} cannot be read ({e.strerror}); point it at a PEM file "
                           "this user can read") from None


def _how(settings: Settings) -> str:
    if not settings.temporal_tls:
        return "without TLS"
    auth = [f"client certificate {settings.temporal_tls_cert}"] if settings.temporal_tls_cert else []
    auth += ["an API key"] if settings.temporal_api_key else []
    return f"over TLS with {' and '.join(auth)}" if auth else "over TLS without a client certificate"


def _fix(settings: Settings) -> str:
    if not settings.temporal_tls:
        return ("start the dev stack with `laminar dev up` or set LAMINAR_TEMPORAL_ADDRESS; if the server takes "
                "only TLS, set LAMINAR_TEMPORAL_TLS=true, and LAMINAR_TEMPORAL_TLS_CERT and "
                "LAMINAR_TEMPORAL_TLS_KEY when it demands a client certificate (infra/README.md)")
    fix = "check LAMINAR_TEMPORAL_ADDRESS"
    if settings.temporal_tls_cert is None:
        fix += ("; if the server demands a client certificate (mTLS), set LAMINAR_TEMPORAL_TLS_CERT and "
                "LAMINAR_TEMPORAL_TLS_KEY" + ("" if settings.temporal_api_key else
                                             ", or LAMINAR_TEMPORAL_API_KEY if it takes an API key"))
    else:
        fix += "; check that the server trusts the CA that signed LAMINAR_TEMPORAL_TLS_CERT"
    fix += ("; LAMINAR_TEMPORAL_TLS_CA must be the CA of the server's certificate (unset: the system's roots) and "
            "LAMINAR_TEMPORAL_TLS_SERVER_NAME a name on it (unset: the address's host)")
    return fix


def store_for(settings: Settings) -> ObjectStore:
    if settings.s3_endpoint is not None:
        _dev_s3_credentials(settings)
    return open_store(settings.store_url, endpoint_url=settings.s3_endpoint)


def _dev_s3_credentials(settings: Settings) -> None:
    """The dev stack's S3 server accepts any credentials; give boto3 some (inherited by child processes)
    when none are configured and the endpoint is the dev stack's own."""
    record = read_record(settings.home)
    if record is None or record.s3_endpoint != settings.s3_endpoint:
        return
    os.environ.setdefault("AWS_ACCESS_KEY_ID", S3_CREDENTIALS["aws_access_key_id"])
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", S3_CREDENTIALS["aws_secret_access_key"])
    os.environ.setdefault("AWS_DEFAULT_REGION", S3_CREDENTIALS["region_name"])
