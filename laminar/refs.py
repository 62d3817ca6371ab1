"""Refs: small, JSON-able pointers into the store. These are what crosses Temporal.

A ref always carries enough to verify what it points at (sha256, sizes, counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SegmentRef:
    """A committed experience segment: one Parquet object holding one or more complete groups."""

    key: str
    sha256: str
    size: int
    rows: int
    group_ids: list[str] = field(default_factory=list)
    policy_version: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class CheckpointRef:
    """A committed checkpoint: the key of its manifest, the step it holds and the manifest's sha256."""

    run_id: str
    step: int
    manifest_key: str
    manifest_sha256: str
    policy_version: int = 0
