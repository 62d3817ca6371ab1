"""Temporal client and object store for a process, from its deployment settings."""

from __future__ import annotations

from temporalio.client import Client

from laminar.errors import LaminarError
from storage.objects import ObjectStore, open_store
from workers.settings import Settings


async def connect(settings: Settings) -> Client:
    try:
        return await Client.connect(settings.temporal_address, namespace=settings.namespace)
    except RuntimeError as e:
        raise LaminarError(
            f"cannot reach Temporal at {settings.temporal_address} (namespace {settings.namespace}): {e}; "
            "start the dev stack with `laminar dev up` or set LAMINAR_TEMPORAL_ADDRESS"
        ) from None


def store_for(settings: Settings) -> ObjectStore:
    return open_store(settings.store_url, endpoint_url=settings.s3_endpoint)
