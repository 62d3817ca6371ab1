"""What `laminar dev up` records in `<home>/dev.json`: the endpoints and pids of the dev stack.

Deployment settings read it for their defaults, so it is kept apart from the code that starts and stops
the servers (devstack.stack): plain data, no processes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from laminar.errors import DevStackError

RECORD_FILE = "dev.json"
RECORD_VERSION = 1
S3_BUCKET = "laminar"
S3_CREDENTIALS = {
    "aws_access_key_id": "laminar",
    "aws_secret_access_key": "laminar",
    "region_name": "us-east-1",
}


@dataclass(frozen=True)
class DevStackInfo:
    """What `laminar dev up` started, as recorded in `<home>/dev.json`."""

    home: str
    temporal_pid: int
    temporal_address: str  # host:port (gRPC)
    namespace: str
    ui_url: str | None  # None when started with ui=False
    db_file: str  # SQLite state of the Temporal server; kept by `down`
    temporal_log: str
    store_url: str  # s3://<bucket> when S3 runs, else file://<home>/store
    started_at: str  # ISO 8601, UTC
    s3_pid: int | None = None
    s3_endpoint: str | None = None  # http://host:port
    s3_bucket: str | None = None
    s3_log: str | None = None
    version: int = RECORD_VERSION

    def processes(self) -> list[tuple[str, int]]:
        """(name, pid) of every process this record names."""
        procs = [("temporal", self.temporal_pid)]
        if self.s3_pid is not None:
            procs.append(("s3", self.s3_pid))
        return procs


def read_record(home: Path) -> DevStackInfo | None:
    """The record in `<home>/dev.json`, or None when there is none (liveness is not checked)."""
    path = home / RECORD_FILE
    try:
        raw = json.loads(path.read_text())
        known = {f.name for f in fields(DevStackInfo)}
        return DevStackInfo(**{k: v for k, v in raw.items() if k in known})
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as e:
        raise DevStackError(
            f"{path} is unreadable ({e}); stop any servers it names by hand, then delete it"
        ) from e
