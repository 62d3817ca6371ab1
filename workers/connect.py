"""Temporal client and object store for a process, from its deployment settings."""

from __future__ import annotations

import os

from temporalio.client import Client
from temporalio.runtime import Runtime, TelemetryConfig

from devstack.record import S3_CREDENTIALS, read_record
from laminar.errors import LaminarError
from storage.objects import ObjectStore, open_store
from workers.settings import Settings


async def connect(settings: Settings, core_logs: bool = True) -> Client:
    """A client of the settings' Temporal. core_logs=False: the SDK core prints nothing to stderr (its retry
    warnings would tear through `laminar run`'s progress bar, which shows an outage itself)."""
    runtime = None if core_logs else Runtime(telemetry=TelemetryConfig(logging=None))
    try:
        return await Client.connect(settings.temporal_address, namespace=settings.namespace, runtime=runtime)
    except RuntimeError as e:
        raise LaminarError(
            f"cannot reach Temporal at {settings.temporal_address} (namespace {settings.namespace}): {e}; "
            "start the dev stack with `laminar dev up` or set LAMINAR_TEMPORAL_ADDRESS"
        ) from None


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
